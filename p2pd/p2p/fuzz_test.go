package p2p

import (
	"context"
	"testing"
	"testing/synctest"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// FuzzSession writes arbitrary bytes to a node's control connection:
// when the first byte is even, straight after a hello (the unauthenticated
// side of the handshake); when odd, after a completed handshake (role
// messages from a peer). Whatever they are, the node survives, releases
// what that peer held, and serves another peer (S8.1).
func FuzzSession(f *testing.F) {
	keys := wkeys(testKeys(1, 2))
	for _, m := range []wire.Msg{
		wire.Lookup{ReqID: "kv", Round: 1, Keys: keys},
		wire.Fetch{ReqID: "kv", Round: 1, Keys: keys, Slots: []uint32{1, 2}},
		wire.Fetch{ReqID: "kv", Round: 1},
		wire.AbortFetch{ReqID: "kv", Round: 1},
		wire.LookupResp{ReqID: "kv", Round: 1, Keys: keys, Hits: []bool{true, false}},
		wire.TransferDone{ReqID: "kv", Round: 7},
		wire.Disconnect{Code: wire.CodeDuplicate, Reason: "x"},
		wire.Ping{Seq: 1},
	} {
		f.Add(append([]byte{1}, wire.Append(nil, m)...))
	}
	f.Add(append([]byte{1}, wire.Append(wire.Append(nil, wire.Lookup{ReqID: "kv", Round: 1, Keys: keys}),
		wire.Fetch{ReqID: "kv", Round: 1, Keys: keys[:1], Slots: []uint32{0}})...))
	f.Add(append([]byte{0}, wire.Append(nil, wire.Auth{})...))
	f.Add([]byte{0, 0, 0, 0, 5, 99, 1, 2, 3, 4})
	f.Add([]byte{0, 0, 1, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		synctest.Test(t, func(t *testing.T) {
			mn := newMemNet()
			prod := newNode(t, mn, nil, 8)
			ks := testKeys(1, 2)
			prod.store(t, ks)
			c, err := mn.Dial(context.Background(), prod.tier.Addr())
			if err != nil {
				t.Fatal(err)
			}
			if data[0]&1 == 1 {
				fz := newFake(t, "fuzz", "")
				if _, err := fz.shaker().dialControl(c); err != nil {
					t.Fatalf("handshake: %v", err)
				}
			} else {
				go wire.Write(c, nil, wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: "fuzz", Nonce: newNonce()})
			}
			go func() {
				c.Write(data[1:])
				c.Close()
			}()
			go func() { // drain what the node sends
				b := make([]byte, 4096)
				for {
					if _, err := c.Read(b); err != nil {
						return
					}
				}
			}()
			synctest.Wait()
			other := connectFake(t, mn, prod, "other")
			other.send(wire.Lookup{ReqID: "kv2", Round: 1, Keys: wkeys(ks)})
			if r := expect[wire.LookupResp](t, other); !r.Hits[0] || !r.Hits[1] {
				t.Fatalf("the node stopped serving: %+v", r)
			}
		})
	})
}
