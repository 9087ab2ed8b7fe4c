package vllmwire

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"os/exec"
	"reflect"
	"runtime"
	"strings"
	"testing"
)

func key(i byte) []byte {
	k := make([]byte, 36)
	k[0] = i
	return k
}

// samples is one message of every type.
var samples = []Msg{
	{Type: TypeConnect, PeerID: "127.0.0.1:5710", AgentMetadata: []byte{1, 2, 3}, BaseAddr: 1 << 40, NumBlocks: 1024, BlockLen: 1835008, HashSeed: "vllm-none-hash"},
	{Type: TypeConnect, PeerID: "h:1", AgentMetadata: []byte{}, BaseAddr: 0, NumBlocks: 1, BlockLen: 8192, ConfigFingerprint: "fp", HashSeed: "s"},
	{Type: TypeConnectAck, PeerID: "127.0.0.1:5711"},
	{Type: TypeDisconnect},
	{Type: TypeLookup, KVRequestID: "r1", Keys: [][]byte{key(1), key(2)}, RoundSeq: 3},
	{Type: TypeLookupResp, KVRequestID: "r1", Keys: [][]byte{key(1), key(2)}, Hits: []bool{true, false}},
	{Type: TypeFetch, KVRequestID: "r1", Keys: [][]byte{key(1)}, BlockIndexes: []uint64{70000}, RoundSeq: 3},
	{Type: TypeFetch, KVRequestID: "r1", Keys: [][]byte{}, BlockIndexes: []uint64{}, RoundSeq: 4}, // terminal
	{Type: TypeTransferDone, KVRequestID: "r1", Success: true, RoundSeq: 3},
	{Type: TypeAbortFetch, KVRequestID: "r1", RoundSeq: 3},
	{Type: TypeAbortAck, KVRequestID: "r1", RoundSeq: 1 << 33},
}

func TestRoundTrip(t *testing.T) {
	for _, m := range samples {
		got, err := Decode(Encode(nil, m))
		if err != nil || !reflect.DeepEqual(got, m) {
			t.Errorf("%s: decoded %+v, %v; want %+v", m.Type, got, err, m)
		}
	}
}

// Issue 15: python3-msgpack (the encoder vLLM's msgspec agrees with,
// use_bin_type=True) reads what Encode writes as the dicts vLLM's
// validators expect — keys and metadata bytes, bools, ints — and what it
// writes Decode reads back to the same messages.
func TestAgainstPythonMsgpack(t *testing.T) {
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import msgpack").Run(); err != nil {
		t.Skip("python3-msgpack is not installed (.ci/run installs it)")
	}
	var hexes []string
	for _, m := range samples {
		hexes = append(hexes, hex.EncodeToString(Encode(nil, m)))
	}
	in, _ := json.Marshal(hexes)
	// Python decodes each, describes its types, and re-encodes it.
	out, err := exec.Command(py, "-c", `
import sys, json, msgpack
def kind(v):
    if isinstance(v, bool): return "bool"
    if isinstance(v, int): return "int"
    if isinstance(v, bytes): return "bytes"
    if isinstance(v, str): return "str"
    if isinstance(v, list): return "list[" + ",".join(sorted({kind(x) for x in v})) + "]"
    return type(v).__name__
res = []
for h in json.loads(sys.argv[1]):
    d = msgpack.unpackb(bytes.fromhex(h), raw=False)
    res.append({"types": {k: kind(v) for k, v in d.items()}, "again": msgpack.packb(d, use_bin_type=True).hex()})
print(json.dumps(res))
`, string(in)).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	var res []struct {
		Types map[string]string
		Again string
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	wantTypes := map[string]string{"type": "str", "peer_id": "str", "agent_metadata": "bytes", "base_addr": "int", "num_blocks": "int",
		"block_len": "int", "config_fingerprint": "str", "hash_seed": "str", "kv_request_id": "str", "keys": "list[bytes]",
		"hits": "list[bool]", "block_indexes": "list[int]", "round_seq": "int", "success": "bool"}
	for i, r := range res {
		for name, typ := range r.Types {
			if want := wantTypes[name]; typ != want && !(typ == "list[]" && strings.HasPrefix(want, "list")) {
				t.Errorf("%s: Python reads %s as %s, want %s", samples[i].Type, name, typ, want)
			}
		}
		b, _ := hex.DecodeString(r.Again)
		if got, err := Decode(b); err != nil || !reflect.DeepEqual(got, samples[i]) {
			t.Errorf("%s as Python encodes it: %+v, %v", samples[i].Type, got, err)
		}
	}
}

// S8.1 for vLLM's wire: a bad payload is ErrMalformed, never a panic or
// an allocation larger than the payload warrants.
func TestDecodeRejects(t *testing.T) {
	enc := func(f func(e *encoder)) []byte { e := &encoder{}; f(e); return e.b }
	lookup := func(extra func(e *encoder)) []byte {
		return enc(func(e *encoder) {
			e.mapHead(4)
			e.str("type")
			e.str("lookup")
			e.str("kv_request_id")
			e.str("r")
			e.str("round_seq")
			e.uint(1)
			extra(e)
		})
	}
	for name, p := range map[string][]byte{
		"empty":          {},
		"not a map":      {0x90},
		"truncated":      Encode(nil, samples[4])[:10],
		"trailing data":  append(Encode(nil, samples[3]), 0xc0),
		"no type":        {0x80},
		"missing field":  enc(func(e *encoder) { e.mapHead(1); e.str("type"); e.str("lookup") }),
		"huge map count": {0xdf, 0xff, 0xff, 0xff, 0xff},
		"huge list":      lookup(func(e *encoder) { e.str("keys"); e.b = append(e.b, 0xdd, 0x00, 0x01, 0x00, 0x01) }),
		"list over cap": lookup(func(e *encoder) {
			e.str("keys")
			e.arrayHead(MaxList + 1)
			for range MaxList + 1 {
				e.bin(nil)
			}
		}),
		"key too long":    lookup(func(e *encoder) { e.str("keys"); e.arrayHead(1); e.bin(make([]byte, MaxKey+1)) }),
		"key as str":      lookup(func(e *encoder) { e.str("keys"); e.arrayHead(1); e.str("abc") }),
		"bin length lies": lookup(func(e *encoder) { e.str("keys"); e.arrayHead(1); e.b = append(e.b, 0xc6, 0x7f, 0xff, 0xff, 0xff) }),
		"negative round": enc(func(e *encoder) {
			e.mapHead(3)
			e.str("type")
			e.str("abort_ack")
			e.str("kv_request_id")
			e.str("r")
			e.str("round_seq")
			e.b = append(e.b, 0xff)
		}),
		"duplicate field": enc(func(e *encoder) { e.mapHead(2); e.str("type"); e.str("disconnect"); e.str("type"); e.str("disconnect") }),
		"hits mismatch":   Encode(nil, Msg{Type: TypeLookupResp, KVRequestID: "r", Keys: [][]byte{key(1)}, Hits: []bool{}}),
		"zero blocks":     Encode(nil, Msg{Type: TypeConnect, PeerID: "p", NumBlocks: 0, BlockLen: 1, HashSeed: "s"}),
		"empty peer id":   Encode(nil, Msg{Type: TypeConnectAck}),
		"deep unknown": enc(func(e *encoder) {
			e.mapHead(1)
			e.str("x")
			e.b = append(e.b, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0xc0)
		}),
	} {
		if m, err := Decode(p); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %+v, %v; want ErrMalformed", name, m, err)
		}
	}
	// An unknown type is not an error (vLLM logs it), an unknown field is skipped.
	unknown := enc(func(e *encoder) {
		e.mapHead(2)
		e.str("type")
		e.str("hello")
		e.str("x")
		e.b = append(e.b, 0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xc0)
	})
	if m, err := Decode(unknown); err != nil || m.Type != "hello" {
		t.Errorf("an unknown type: %+v, %v", m, err)
	}
}

func FuzzDecode(f *testing.F) {
	for _, m := range samples {
		f.Add(Encode(nil, m))
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		m, err := Decode(p)
		if err != nil || required[m.Type] == 0 && m.Type != TypeDisconnect {
			return
		}
		again, err := Decode(Encode(nil, m))
		if err != nil || !reflect.DeepEqual(again, m) {
			t.Fatalf("%+v re-encoded decodes to %+v, %v", m, again, err)
		}
	})
}

// Review (issue 15): a list's count claims nothing: Decode allocates in
// proportion to what it read, not to the count (a 64 KiB payload
// claiming 65,520 keys made it allocate 1.5 MiB).
func TestDecodeAllocatesWhatItReads(t *testing.T) {
	e := &encoder{}
	e.mapHead(4)
	e.str("type")
	e.str("lookup")
	e.str("kv_request_id")
	e.str("r")
	e.str("round_seq")
	e.uint(0)
	e.str("keys")
	e.b = append(e.b, 0xdc, 0xff, 0xf0)
	e.b = append(e.b, make([]byte, 0xfff0)...) // positive fixints, not bins: fails at the first
	allocs := testing.AllocsPerRun(10, func() { Decode(e.b) })
	var a, b runtime.MemStats
	runtime.ReadMemStats(&a)
	for range 100 {
		if _, err := Decode(e.b); err == nil {
			t.Fatal("decoded")
		}
	}
	runtime.ReadMemStats(&b)
	if per := (b.TotalAlloc - a.TotalAlloc) / 100; per > 4*uint64(len(e.b)) {
		t.Errorf("a %d-byte payload made Decode allocate %d bytes (%.0f allocations)", len(e.b), per, allocs)
	}
}

// Review (issue 15): the KV-event batch is vLLM's array_like EventBatch,
// [ts, events, data_parallel_rank], as vLLM 0.26 sends it and its
// consumers decode it; Python's msgpack reads it so.
func TestEventBatchIsPositional(t *testing.T) {
	ev := []KVEvent{{Kind: BlockStored, Hashes: [][]byte{make([]byte, 32)}, TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "CPU"}, {Kind: AllBlocksCleared}}
	b := EncodeEventBatch(nil, 1.5, ev, 0, true)
	if b[0] != 0x93 {
		t.Errorf("the batch starts 0x%02x; want 0x93, an array of 3", b[0])
	}
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import msgpack").Run(); err != nil {
		t.Skip("python3-msgpack is not installed (.ci/run installs it)")
	}
	out, err := exec.Command(py, "-c", `
import sys, msgpack
b = msgpack.unpackb(bytes.fromhex(sys.argv[1]), raw=False)
assert isinstance(b, list) and len(b) == 3, "batch is %s" % type(b).__name__
ts, events, rank = b
assert ts == 1.5 and rank == 0
assert [list(e)[0] for e in events] == ["type", "type"]
assert [e["type"] for e in events] == ["BlockStored", "AllBlocksCleared"]
assert events[0]["block_hashes"] == [0] and events[0]["parent_block_hash"] is None and events[0]["token_ids"] == [1, 2]
print("ok")
`, hex.EncodeToString(b)).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "ok" {
		t.Errorf("python: %v\n%s", err, out)
	}
}
