package p2p

import (
	"context"
	"testing"
	"testing/synctest"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// FuzzSession writes arbitrary bytes to a node's control connection after
// a valid hello: whatever they are (a handshake, role messages, garbage),
// the node survives, releases what that peer held, and serves another
// peer (S8.1).
func FuzzSession(f *testing.F) {
	cfg := tinyConfig(1)
	connect := wire.Append(nil, wire.Connect{NodeID: "fuzz", Version: wire.Version, BlockBytes: uint64(cfg.Geometry.BlockBytes()),
		Fingerprint: cfg.Fingerprint(), HashSeed: cfg.HashSeed, Addr: "fuzz:1", DataPlane: "tcp"})
	ack := wire.Append(nil, wire.ConnectAck{})
	keys := wkeys(testKeys(1, 2))
	hs := append(append([]byte{}, connect...), ack...)
	for _, m := range []wire.Msg{
		wire.Lookup{ReqID: "kv", Round: 1, Keys: keys},
		wire.Fetch{ReqID: "kv", Round: 1, Keys: keys, Slots: []uint32{1, 2}},
		wire.Fetch{ReqID: "kv", Round: 1},
		wire.AbortFetch{ReqID: "kv", Round: 1},
		wire.LookupResp{ReqID: "kv", Round: 1, Keys: keys, Hits: []bool{true, false}},
		wire.Disconnect{Reason: "x"},
	} {
		f.Add(append(append([]byte{}, hs...), wire.Append(nil, m)...))
	}
	f.Add(append(append([]byte{}, hs...), wire.Append(wire.Append(nil, wire.Lookup{ReqID: "kv", Round: 1, Keys: keys}),
		wire.Fetch{ReqID: "kv", Round: 1, Keys: keys[:1], Slots: []uint32{0}})...))
	f.Add([]byte{0, 0, 0, 5, 99, 1, 2, 3, 4})
	f.Add(connect)
	f.Fuzz(func(t *testing.T, data []byte) {
		synctest.Test(t, func(t *testing.T) {
			mn := newMemNet()
			prod := newNode(t, mn, nil, 8)
			ks := testKeys(1, 2)
			prod.store(t, ks)
			c, err := mn.Dial(context.Background(), prod.tier.Addr())
			if err != nil {
				t.Fatal(err)
			}
			go func() {
				wire.Write(c, nil, wire.Hello{Version: wire.Version, Kind: wire.KindControl, NodeID: "fuzz"})
				c.Write(data)
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
