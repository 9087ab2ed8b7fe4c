package offload

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"os/exec"
	"slices"
	"strings"
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
	fp := Fingerprint(base, "s", "")
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
		if Fingerprint(g, seed, "") == fp {
			t.Errorf("changing %s kept the fingerprint", name)
		}
	}
	if Fingerprint(base, "s", "") != fp || Fingerprint(base, "s", HashKvtier) != fp {
		t.Error("fingerprint not deterministic, or kvtier's scheme changed it")
	}
	if Fingerprint(base, "s", HashVLLMSHA256CBOR) == fp {
		t.Error("the key scheme does not change the fingerprint")
	}
}

// Issue 15: vLLM's sha256_cbor block hashes, checked against values
// computed by hand from canonical CBOR: the root is SHA-256 of the seed
// as a text string; a block's key SHA-256 of [parent, [tokens…], null],
// integers in their shortest form (1, 2, 3 and 5 bytes here).
func TestVLLMKeys(t *testing.T) {
	s := KeyScheme{Algo: HashVLLMSHA256CBOR, Seed: VLLMDefaultSeed}
	seedCBOR := append([]byte{0x60 | 14}, VLLMDefaultSeed...)
	if s.Root() != sha256.Sum256(seedCBOR) {
		t.Errorf("root %x, want SHA-256 of the CBOR text %x", s.Root(), seedCBOR)
	}
	tokens := []uint32{7, 200, 65535, 1 << 20}
	root := s.Root()
	want := append([]byte{0x83, 0x58, 32}, root[:]...)
	want = append(want, 0x84, 0x07, 0x18, 200, 0x19, 0xff, 0xff, 0x1a, 0x00, 0x10, 0x00, 0x00, 0xf6)
	k := s.Keys(4, tokens)
	if len(k) != 1 || k[0] != sha256.Sum256(want) {
		t.Errorf("keys %x, want SHA-256 of %x", k, want)
	}
	if kv := BlockKeys(VLLMDefaultSeed, 4, tokens); kv[0] == k[0] {
		t.Error("kvtier's and vLLM's schemes agree")
	}
}

// Issue 15: the same token ids hashed by Python's cbor2 and hashlib as
// vLLM's sha256_cbor does (Debian's python3-cbor2; .ci/run installs it)
// give this scheme's keys, for two seeds and a prompt of 3 blocks and a
// partial one.
func TestVLLMKeysAgainstCBOR2(t *testing.T) {
	py := "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import cbor2").Run(); err != nil {
		t.Skip("python3-cbor2 is not installed (Debian's python3-cbor2; .ci/run installs it)")
	}
	tokens := make([]uint32, 16*3+5)
	for i := range tokens {
		tokens[i] = uint32(i*7919) % 151936
	}
	script := `
import sys, json, hashlib, cbor2
seed, bt, toks = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
h = lambda o: hashlib.sha256(cbor2.dumps(o, canonical=True)).digest()
parent = h(seed)
for i in range(len(toks) // bt):
    parent = h((parent, tuple(toks[i*bt:(i+1)*bt]), None))
    print(parent.hex())
`
	js, _ := json.Marshal(tokens)
	for _, seed := range []string{VLLMDefaultSeed, "0"} {
		out, err := exec.Command(py, "-c", script, seed, "16", string(js)).CombinedOutput()
		if err != nil {
			t.Fatalf("python: %v\n%s", err, out)
		}
		var got []string
		for _, k := range (KeyScheme{Algo: HashVLLMSHA256CBOR, Seed: seed}).Keys(16, tokens) {
			got = append(got, hex.EncodeToString(k[:]))
		}
		if want := strings.Fields(string(out)); !slices.Equal(got, want) {
			t.Errorf("seed %q: keys\n%v\nwant (cbor2)\n%v", seed, got, want)
		}
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
