package p2p

import (
	"context"
	"encoding/binary"
	"testing"
	"testing/synctest"

	"github.com/kvtier/kvtier/p2pd/vllmwire"
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

// zframe is one ZMTP message frame carrying p (the fuzz seeds' framing).
func zframe(p []byte) []byte {
	if len(p) < 256 {
		return append([]byte{0, byte(len(p))}, p...)
	}
	b := []byte{2, 0, 0, 0, 0, 0, 0, 0, 0}
	binary.BigEndian.PutUint64(b[1:], uint64(len(p)))
	return append(b, p...)
}

// FuzzVLLMSession is FuzzSession for vLLM's dialect: arbitrary bytes on a
// peer's DEALER connection, after the ZMTP handshake (first byte even:
// before any connect) or after vLLM's handshake (odd: role messages).
// Whatever they are, the node survives, releases what that peer held, and
// serves another peer (S8.1).
func FuzzVLLMSession(f *testing.F) {
	keys := vkeys(testKeys(1, 2))
	for _, m := range []vllmwire.Msg{
		{Type: vllmwire.TypeLookup, KVRequestID: "kv", Keys: keys},
		{Type: vllmwire.TypeFetch, KVRequestID: "kv", Keys: keys, BlockIndexes: []uint64{1, 2}},
		{Type: vllmwire.TypeFetch, KVRequestID: "kv", Keys: [][]byte{}, BlockIndexes: []uint64{}},
		{Type: vllmwire.TypeAbortFetch, KVRequestID: "kv", RoundSeq: 1},
		{Type: vllmwire.TypeLookupResp, KVRequestID: "kv", Keys: keys, Hits: []bool{true, false}},
		{Type: vllmwire.TypeTransferDone, KVRequestID: "kv", RoundSeq: 7},
		{Type: vllmwire.TypeConnectAck, PeerID: "x:1"},
		{Type: vllmwire.TypeDisconnect},
	} {
		f.Add(append([]byte{1}, zframe(vllmwire.Encode(nil, m))...))
	}
	f.Add(append([]byte{1}, append(zframe(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv", Keys: keys})),
		zframe(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeFetch, KVRequestID: "kv", Keys: keys[:1], BlockIndexes: []uint64{0}}))...)...))
	f.Add(append([]byte{0}, zframe(vllmwire.Encode(nil, vllmwire.Msg{Type: vllmwire.TypeConnect, PeerID: "x:1", NumBlocks: 1, BlockLen: 8192, HashSeed: "vllm-none-hash", AgentMetadata: []byte{}}))...))
	f.Add([]byte{1, 4, 6, 4, 'P', 'I', 'N', 'G', 0, 1}) // a PING command
	f.Add([]byte{0, 1, 3, 'a', 'b', 'c', 0, 1, 'x'})    // a two-frame message
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		synctest.Test(t, func(t *testing.T) {
			mn := newZNet()
			n := newVNode(t, mn, "none", nil)
			ks := testKeys(1, 2)
			n.store(t, ks)
			p := newVPeer(t, mn, "fuzz:1")
			if data[0]&1 == 1 {
				p.handshake(n)
			} else {
				p.dial(n.tier.Addr())
			}
			p.dealer.NetConn().Write(data[1:])
			p.dealer.Close()
			synctest.Wait()
			if p.router != nil { // the peer goes: its session ends, its pins go
				p.router.Close()
				synctest.Wait()
			}
			if k := pins(n); k != 0 {
				t.Fatalf("%d pins held after the peer left", k)
			}
			q := newVPeer(t, mn, "other:1")
			q.handshake(n)
			q.send(vllmwire.Msg{Type: vllmwire.TypeLookup, KVRequestID: "kv2", Keys: vkeys(ks)})
			if r := q.expect(vllmwire.TypeLookupResp); len(r.Hits) != 2 || !r.Hits[0] || !r.Hits[1] {
				t.Fatalf("the node stopped serving: %+v", r)
			}
		})
	})
}
