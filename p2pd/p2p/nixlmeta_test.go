package p2p

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/kvtier/kvtier/offload"
)

// metaBlob builds NIXL agent metadata the way NIXL's serializer lays it
// out (one UCX connection, one DRAM section of descs descriptors), with
// memType as the section's memory type.
func metaBlob(agent string, memType uint32, descs int) []byte {
	b := []byte("nixlSerDes|")
	field := func(tag string, v []byte) {
		b = append(b, tag...)
		b = binary.LittleEndian.AppendUint64(b, uint64(len(v)))
		b = append(b, v...)
		b = append(b, '|')
	}
	u64 := func(n uint64) []byte { return binary.LittleEndian.AppendUint64(nil, n) }
	field("Agent", []byte(agent))
	field("Conns", u64(1))
	field("t", []byte("UCX"))
	field("c", []byte("worker-address"))
	field("", []byte("MemSection"))
	field("nixlSecElms", u64(1))
	field("bknd", []byte("UCX"))
	field("nixlDList", []byte("nixlSDList"))
	field("t", binary.LittleEndian.AppendUint32(nil, memType))
	field("n", u64(uint64(descs)))
	for range descs {
		field("", append(make([]byte, nixlBasicDesc), "rkey"...))
	}
	return b
}

// A peer's NIXL metadata is read before NIXL sees it (found in review:
// NIXL 1.4 crashed the process on an unknown memory type in a connect's
// agent_metadata). Well-formed metadata gives its agent's name; each
// malformed one is refused — every truncation of a good blob among them.
func TestCheckNIXLMeta(t *testing.T) {
	good := metaBlob("node-a-1234", nixlDRAM, 2)
	m, err := checkNIXLMeta(good)
	if err != nil || m.Agent != "node-a-1234" {
		t.Fatalf("well-formed metadata: %+v, %v", m, err)
	}
	bad := map[string][]byte{
		"no header":        good[1:],
		"empty":            nil,
		"memory type 0x63": metaBlob("node-a", 0x63<<24, 1),
		"VRAM":             metaBlob("node-a", 1, 1),
		"no descriptors":   metaBlob("node-a", nixlDRAM, 0),
		"empty agent":      metaBlob("", nixlDRAM, 1),
		"agent with \\n":   metaBlob("a\nb", nixlDRAM, 1),
	}
	huge := append([]byte(nil), good...)
	binary.LittleEndian.PutUint64(huge[len("nixlSerDes|Agent"):], 1<<62) // the name's length
	bad["a length past the blob"] = huge
	for name, b := range bad {
		if _, err := checkNIXLMeta(b); !errors.Is(err, errNIXLMeta) {
			t.Errorf("%s: %v, want errNIXLMeta", name, err)
		}
	}
	for n := range len(good) {
		if _, err := checkNIXLMeta(good[:n]); err == nil {
			t.Fatalf("metadata cut at %d of %d bytes accepted", n, len(good))
		}
	}
}

// FuzzCheckNIXLMeta: whatever the bytes, checkNIXLMeta returns, and what
// it accepts has a printable, non-empty agent name.
func FuzzCheckNIXLMeta(f *testing.F) {
	f.Add(metaBlob("node-a-1234", nixlDRAM, 2))
	f.Add(metaBlob("x", 0x63000000, 1))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := checkNIXLMeta(b)
		if err == nil && (m.Agent == "" || !printable([]byte(m.Agent))) {
			t.Fatalf("accepted agent %q", m.Agent)
		}
	})
}

// A node whose CPU tier has more slots than a NIXL peer accepts (found in
// review: peers bound a peer's slots at vllmMaxBlocks) is refused at
// start with a config error, not by every peer at every handshake.
func TestNIXLPlaneRefusesTooManySlots(t *testing.T) {
	if err := nixlSlots(vllmMaxBlocks); err != nil {
		t.Errorf("%d slots: %v, want accepted", vllmMaxBlocks, err)
	}
	if err := nixlSlots(vllmMaxBlocks + 1); !errors.Is(err, offload.ErrConfig) {
		t.Errorf("%d slots: %v, want a config error", vllmMaxBlocks+1, err)
	}
}
