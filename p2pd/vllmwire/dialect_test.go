package vllmwire

import (
	"errors"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/p2pd/wire"
)

// Issue 15: every role message crosses the dialect's edge and back
// unchanged — keys gain and lose the group index 0, round_seq is the
// round, block_indexes the slots (G2's lookup_resp has no round: 0).
func TestDialectRoundTrip(t *testing.T) {
	k := wire.Key{1, 2, 3}
	for _, m := range []wire.Msg{
		wire.Lookup{ReqID: "r", Round: 3, Keys: []wire.Key{k}},
		wire.LookupResp{ReqID: "r", Keys: []wire.Key{k}, Hits: []bool{true}},
		wire.Fetch{ReqID: "r", Round: 3, Keys: []wire.Key{k}, Slots: []uint32{7}},
		wire.Fetch{ReqID: "r", Round: 4, Keys: []wire.Key{}, Slots: []uint32{}},
		wire.TransferDone{ReqID: "r", Round: 3, OK: true},
		wire.AbortFetch{ReqID: "r", Round: 3},
		wire.AbortAck{ReqID: "r", Round: 3},
	} {
		v, ok := FromWire(m)
		if !ok {
			t.Fatalf("%T: no vLLM equivalent", m)
		}
		if len(v.Keys) > 0 && (len(v.Keys[0]) != KeyLen || v.Keys[0][0] != 1 || string(v.Keys[0][32:]) != "\x00\x00\x00\x00") {
			t.Errorf("%T: key %x, want the hash and group 0", m, v.Keys[0])
		}
		back, err := ToWire(mustDecode(t, Encode(nil, v)))
		if err != nil || !reflect.DeepEqual(back, m) {
			t.Errorf("%T: back %+v, %v; want %+v", m, back, err, m)
		}
	}
	if _, ok := FromWire(wire.Ping{Seq: 1}); ok {
		t.Error("a ping crossed: vLLM's heartbeats are ZMTP's")
	}
}

func mustDecode(t *testing.T, p []byte) Msg {
	t.Helper()
	m, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// A key of another length or another KV cache group, a block index past
// uint32, or a session message is refused at the edge.
func TestDialectRejects(t *testing.T) {
	g1 := make([]byte, KeyLen)
	g1[KeyLen-1] = 1
	for name, m := range map[string]Msg{
		"32-byte key":  {Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{make([]byte, 32)}},
		"group 1":      {Type: TypeLookup, KVRequestID: "r", Keys: [][]byte{g1}},
		"huge index":   {Type: TypeFetch, KVRequestID: "r", Keys: [][]byte{make([]byte, KeyLen)}, BlockIndexes: []uint64{1 << 32}},
		"connect":      {Type: TypeConnect, PeerID: "p"},
		"connect_ack":  {Type: TypeConnectAck, PeerID: "p"},
		"unknown type": {Type: "hello"},
	} {
		if w, err := ToWire(m); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %+v, %v; want ErrMalformed", name, w, err)
		}
	}
}
