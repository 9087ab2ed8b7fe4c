package p2p

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// NIXL's agent metadata comes from the peer; on vLLM's wire, from any
// peer that can reach the P2P port. NIXL 1.4's loadRemoteMD trusts parts
// of it (an unknown memory type crashes the process in
// nixlMemSection::emplace), and a failed load that names another peer's
// agent erases that peer's remote state. So a blob is read here first,
// bounded, before NIXL sees it: its layout is NIXL's serializer's (a
// header, then fields of a tag, an 8-byte little-endian length, the bytes
// and a '|'), in the order loadRemoteMD reads them — the agent name, the
// backends' connection info, then the memory sections, each a list of
// descriptors of one memory type.

// nixlMeta is what checkNIXLMeta read of a blob.
type nixlMeta struct {
	Agent string
}

// Bounds of a peer's NIXL metadata (far above what one agent with one
// registered region sends).
const (
	nixlMaxName     = 256
	nixlMaxConns    = 16
	nixlMaxConnInfo = 1 << 20
	nixlMaxSections = 64
	nixlMaxDescs    = 1 << 16
	nixlMaxDescBlob = 64 << 10
	nixlBasicDesc   = 24 // addr, len, devId
	nixlDRAM        = 0  // nixl_mem_t DRAM_SEG
)

var errNIXLMeta = errors.New("p2p: nixl: malformed agent metadata")

// checkNIXLMeta reads a peer's NIXL agent metadata without trusting it:
// every field where loadRemoteMD expects it, every length within the blob
// and its bound, every memory region DRAM (a CPU tier's). It returns the
// agent's name.
func checkNIXLMeta(b []byte) (nixlMeta, error) {
	r := metaReader{b: b}
	if !r.literal("nixlSerDes|") {
		return nixlMeta{}, fmt.Errorf("%w: no serializer header", errNIXLMeta)
	}
	name, err := r.field("Agent", nixlMaxName)
	if err != nil {
		return nixlMeta{}, err
	}
	if len(name) == 0 || !printable(name) {
		return nixlMeta{}, fmt.Errorf("%w: agent name %q", errNIXLMeta, name)
	}
	conns, err := r.count("Conns", nixlMaxConns)
	if err != nil {
		return nixlMeta{}, err
	}
	for range conns {
		if t, err := r.field("t", 64); err != nil || len(t) == 0 {
			return nixlMeta{}, fmt.Errorf("%w: backend: %v", errNIXLMeta, err)
		}
		if c, err := r.field("c", nixlMaxConnInfo); err != nil || len(c) == 0 {
			return nixlMeta{}, fmt.Errorf("%w: connection info: %v", errNIXLMeta, err)
		}
	}
	if s, err := r.field("", 64); err != nil || string(s) != "MemSection" {
		return nixlMeta{}, fmt.Errorf("%w: no memory section", errNIXLMeta)
	}
	secs, err := r.count("nixlSecElms", nixlMaxSections)
	if err != nil {
		return nixlMeta{}, err
	}
	for range secs {
		if bk, err := r.field("bknd", 64); err != nil || len(bk) == 0 {
			return nixlMeta{}, fmt.Errorf("%w: section backend: %v", errNIXLMeta, err)
		}
		if l, err := r.field("nixlDList", 64); err != nil || string(l) != "nixlSDList" {
			return nixlMeta{}, fmt.Errorf("%w: descriptor list kind", errNIXLMeta)
		}
		t, err := r.field("t", 4)
		if err != nil || len(t) != 4 {
			return nixlMeta{}, fmt.Errorf("%w: memory type", errNIXLMeta)
		}
		if mt := binary.LittleEndian.Uint32(t); mt != nixlDRAM {
			return nixlMeta{}, fmt.Errorf("%w: memory type %d, a CPU tier registers DRAM (%d)", errNIXLMeta, mt, nixlDRAM)
		}
		n, err := r.count("n", nixlMaxDescs)
		if err != nil || n == 0 {
			return nixlMeta{}, fmt.Errorf("%w: descriptor count: %v", errNIXLMeta, err)
		}
		for range n {
			if d, err := r.field("", nixlMaxDescBlob); err != nil || len(d) < nixlBasicDesc {
				return nixlMeta{}, fmt.Errorf("%w: descriptor: %v", errNIXLMeta, err)
			}
		}
	}
	return nixlMeta{Agent: string(name)}, nil
}

// metaReader reads NIXL serializer fields from b.
type metaReader struct{ b []byte }

func (r *metaReader) literal(s string) bool {
	if len(r.b) < len(s) || string(r.b[:len(s)]) != s {
		return false
	}
	r.b = r.b[len(s):]
	return true
}

// field reads tag, a length of at most max, that many bytes and '|'.
func (r *metaReader) field(tag string, max int) ([]byte, error) {
	if !r.literal(tag) || len(r.b) < 8 {
		return nil, fmt.Errorf("%w: field %q missing", errNIXLMeta, tag)
	}
	n := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	if n > uint64(max) || n >= uint64(len(r.b)) || r.b[n] != '|' {
		return nil, fmt.Errorf("%w: field %q of %d bytes", errNIXLMeta, tag, n)
	}
	v := r.b[:n]
	r.b = r.b[n+1:]
	return v, nil
}

// count reads an 8-byte count field of at most max.
func (r *metaReader) count(tag string, max uint64) (uint64, error) {
	v, err := r.field(tag, 8)
	if err != nil || len(v) != 8 {
		return 0, fmt.Errorf("%w: count %q", errNIXLMeta, tag)
	}
	n := binary.LittleEndian.Uint64(v)
	if n > max {
		return 0, fmt.Errorf("%w: count %q of %d, at most %d", errNIXLMeta, tag, n, max)
	}
	return n, nil
}

func printable(b []byte) bool {
	for _, c := range b {
		if c < 0x20 || c > 0x7e {
			return false
		}
	}
	return true
}
