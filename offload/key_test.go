package offload

import (
	"crypto/sha256"
	"encoding/binary"
	"testing"
)

func seq(n int, base uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = base + uint32(i)
	}
	return t
}

// S1.1: keys are SHA-256 chained over the parent key and little-endian
// token ids, seeded, for full blocks only.
func TestBlockKeys(t *testing.T) {
	tokens := seq(40, 7)
	ks := BlockKeys("s", 16, tokens)
	if len(ks) != 2 {
		t.Fatalf("%d keys for 40 tokens of 16-token blocks, want 2 (no partial block)", len(ks))
	}
	// Recompute the second key by hand.
	h := sha256.New()
	h.Write(ks[0][:])
	for _, tok := range tokens[16:32] {
		h.Write(binary.LittleEndian.AppendUint32(nil, tok))
	}
	if got := Key(h.Sum(nil)); got != ks[1] {
		t.Errorf("key 1 = %v, want SHA-256(key 0 || tokens) = %v", ks[1], got)
	}
	if again := BlockKeys("s", 16, tokens); again[0] != ks[0] || again[1] != ks[1] {
		t.Error("same tokens and seed gave different keys")
	}
	if other := BlockKeys("t", 16, tokens); other[0] == ks[0] {
		t.Error("a different seed gave the same key")
	}
	// A shared prefix gives shared keys; a different first block changes
	// every later key (chaining).
	fork := append(seq(16, 7), seq(16, 1000)...)
	if fk := BlockKeys("s", 16, fork); fk[0] != ks[0] || fk[1] == ks[1] {
		t.Error("shared first block must share key 0 and the forked block must differ")
	}
	changed := append(seq(16, 8), tokens[16:32]...)
	if ck := BlockKeys("s", 16, changed); ck[1] == ks[1] {
		t.Error("changing block 0 did not change block 1's key")
	}
	if BlockKeys("s", 0, tokens) != nil {
		t.Error("block size 0 gave keys")
	}
	// Long blocks go through NextKey's buffer in pieces.
	long := seq(1000, 3)
	if a, b := BlockKeys("s", 500, long), BlockKeys("s", 500, long); a[1] != b[1] {
		t.Error("long blocks not deterministic")
	}
}

// S1.1: the fingerprint covers geometry, dtype, block size and seed.
func TestFingerprint(t *testing.T) {
	base := Geometries["tiny"]
	fp := Fingerprint(base, "s")
	variants := map[string]func(g *Geometry) string{
		"seed":         func(g *Geometry) string { return "t" },
		"layers":       func(g *Geometry) string { g.Layers++; return "s" },
		"block_tokens": func(g *Geometry) string { g.BlockTokens++; return "s" },
		"kv_heads":     func(g *Geometry) string { g.KVHeads++; return "s" },
		"head_dim":     func(g *Geometry) string { g.HeadDim++; return "s" },
		"dtype":        func(g *Geometry) string { g.DType = "bf16"; return "s" },
		"fused":        func(g *Geometry) string { g.Fused = true; return "s" },
	}
	for name, edit := range variants {
		g := base
		seed := edit(&g)
		if Fingerprint(g, seed) == fp {
			t.Errorf("changing %s kept the fingerprint", name)
		}
	}
	if Fingerprint(base, "s") != fp {
		t.Error("fingerprint not deterministic")
	}
}

func TestGeometry(t *testing.T) {
	q := Geometries["qwen3-0.6b"]
	if got, want := q.BlockBytes(), 1792*1024; got != want {
		t.Errorf("qwen3-0.6b block = %d bytes, want 1.75 MiB (%d)", got, want)
	}
	if got := q.SegmentBytes(); got != 32*1024 {
		t.Errorf("qwen3-0.6b segment = %d, want 32 KiB", got)
	}
	f := q
	f.Fused = true
	if f.BlockBytes() != q.BlockBytes()/2 {
		t.Error("a fused block should be half a split one")
	}
	if _, err := GeometryByName("nope"); err == nil {
		t.Error("unknown preset accepted")
	}
}
