package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"reflect"
	"runtime"
	"strings"
	"testing"
)

func key(b byte) Key {
	var k Key
	for i := range k {
		k[i] = b + byte(i)
	}
	return k
}

var table = []Msg{
	Hello{Version: Version, Kind: KindControl, NodeID: "node-a", Incarnation: [16]byte{1, 2}, Nonce: [32]byte{4}},
	Hello{Version: Version, Kind: KindData, NodeID: "n", Incarnation: [16]byte{9}},
	Connect{NodeID: "node-a", Incarnation: [16]byte{3}, Version: Version, BlockBytes: 1835008, Fingerprint: "fp",
		HashSeed: "seed", Addr: "10.0.0.1:5710", DataPlane: "tcp", DataInfo: []byte{1, 2, 3}},
	ConnectAck{},
	Challenge{NodeID: "b", Incarnation: [16]byte{2}, Nonce: [32]byte{3}},
	Auth{Proof: [32]byte{5, 6}},
	Lookup{ReqID: "r1", Round: 7, Keys: []Key{key(1), key(2)}},
	LookupResp{ReqID: "r1", Round: 7, Keys: []Key{key(1), key(2)}, Hits: []bool{true, false}},
	Fetch{ReqID: "r1", Round: 8, Keys: []Key{key(1)}, Slots: []uint32{42}},
	Fetch{ReqID: "r1", Round: 9},
	TransferDone{ReqID: "r1", Round: 8, OK: true},
	AbortFetch{ReqID: "r1", Round: 8},
	AbortAck{ReqID: "r1", Round: 8},
	Disconnect{Code: CodeShutdown, Reason: "bye"},
	Ping{Seq: 1},
	Pong{Seq: 1},
}

// Every message round-trips through a frame.
func TestRoundTrip(t *testing.T) {
	for _, m := range table {
		t.Run(m.Type().String(), func(t *testing.T) {
			var buf bytes.Buffer
			if _, err := Write(&buf, nil, m); err != nil {
				t.Fatal(err)
			}
			p, err := ReadFrame(&buf, nil, MaxHandshakeFrame)
			if err != nil {
				t.Fatal(err)
			}
			got, err := Decode(p)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(m, got) {
				t.Errorf("decoded %#v, want %#v", got, m)
			}
		})
	}
}

// S8.1: malformed or oversized frames are errors, never panics or
// oversized allocations.
func TestMalformed(t *testing.T) {
	frame := func(m Msg) []byte { return Append(nil, m)[4:] }
	lookup := frame(Lookup{ReqID: "r", Round: 1, Keys: []Key{key(1)}})
	cases := map[string][]byte{
		"empty":          {},
		"unknown type":   {200},
		"truncated":      lookup[:len(lookup)-3],
		"trailing bytes": append(append([]byte{}, lookup...), 0),
		"too many keys":  append([]byte{byte(TLookup), 0, 1, 'r', 0, 0, 0, 0, 0, 0, 0, 1}, 0, 1, 0, 1),
		"keys beyond the frame": append([]byte{byte(TLookup), 0, 1, 'r', 0, 0, 0, 0, 0, 0, 0, 1},
			0, 0, 0xff, 0xff),
		"long string":  append([]byte{byte(TDisconnect), 0x10, 0x01}, bytes.Repeat([]byte{'x'}, 4097)...),
		"bad bool":     append(frame(TransferDone{ReqID: "r"})[:len(frame(TransferDone{ReqID: "r"}))-1], 2),
		"bad kind":     append([]byte{byte(THello), 0, 1, 9, 0, 0}, make([]byte, 16)...),
		"hits missing": frame(Lookup{ReqID: "r", Keys: []Key{key(1)}})[1:],
	}
	cases["hits missing"] = append([]byte{byte(TLookupResp)}, cases["hits missing"]...)
	for name, p := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := Decode(p); !errors.Is(err, ErrMalformed) {
				t.Errorf("Decode = %v, want ErrMalformed", err)
			}
		})
	}
	if _, err := ReadFrame(strings.NewReader("\x01\x00\x00\x01"), nil, MaxFrame); !errors.Is(err, ErrMalformed) {
		t.Errorf("oversized frame: %v", err)
	}
	if _, err := ReadFrame(strings.NewReader("\x00\x00\x00\x00"), nil, MaxFrame); !errors.Is(err, ErrMalformed) {
		t.Errorf("empty frame: %v", err)
	}
}

// FuzzDecode: any payload decodes or fails with ErrMalformed; what decodes
// re-encodes to the same bytes.
func FuzzDecode(f *testing.F) {
	for _, m := range table {
		f.Add(Append(nil, m)[4:])
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		m, err := Decode(p)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v is not ErrMalformed", err)
			}
			return
		}
		if again := Append(nil, m)[4:]; !bytes.Equal(again, p) {
			t.Fatalf("re-encoding %v gave %x, want %x", m.Type(), again, p)
		}
	})
}

// FuzzReadFrame: a stream of arbitrary bytes never makes ReadFrame return
// more than the limit.
func FuzzReadFrame(f *testing.F) {
	for _, m := range table {
		f.Add(Append(nil, m))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := ReadFrame(bytes.NewReader(b), nil, 1024)
		if err == nil && len(p) > 1024 {
			t.Fatalf("frame of %d bytes past the limit", len(p))
		}
	})
}

// stallReader hands out what it holds and then fails, like a peer that
// announced a large frame, sent part of it and went away.
type stallReader struct{ b []byte }

func (r *stallReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.ErrUnexpectedEOF
	}
	n := copy(p, r.b)
	r.b = r.b[n:]
	return n, nil
}

// S8.1: a frame buffer grows with the bytes that arrived, never to what
// the header claims.
func TestReadFrameGrowsWithArrivals(t *testing.T) {
	for _, arrived := range []int{0, 1000, growStep + 1, 300 << 10} {
		hdr := binary.BigEndian.AppendUint32(nil, MaxHandshakeFrame)
		r := &stallReader{b: append(hdr, make([]byte, arrived)...)}
		var allocated uint64
		var ms0, ms1 runtime.MemStats
		runtime.ReadMemStats(&ms0)
		_, err := ReadFrame(r, nil, MaxHandshakeFrame)
		runtime.ReadMemStats(&ms1)
		allocated = ms1.TotalAlloc - ms0.TotalAlloc
		if err == nil {
			t.Fatalf("%d bytes of a %d-byte frame: no error", arrived, MaxHandshakeFrame)
		}
		if limit := uint64(4*max(arrived, growStep) + 64<<10); allocated > limit {
			t.Errorf("%d bytes arrived of a claimed %d: allocated %d bytes (limit %d)", arrived, MaxHandshakeFrame, allocated, limit)
		}
	}
	// A whole frame still reads, in pieces.
	want := bytes.Repeat([]byte{7}, 200<<10)
	got, err := ReadFrame(bytes.NewReader(append(binary.BigEndian.AppendUint32(nil, uint32(len(want))), want...)), nil, MaxFrame)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("whole frame: err %v, equal %v", err, bytes.Equal(got, want))
	}
}
