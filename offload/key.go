package offload

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
)

// KeySize is the length of a block key in bytes.
const KeySize = sha256.Size

// DefaultHashSeed is the cluster-wide hash seed used when none is
// configured. Every node that should share blocks must use the same seed
// (S1.1); the config fingerprint carries it so a mismatch is detected.
const DefaultHashSeed = "kvtier-v1"

// Key identifies one full block of KV: a SHA-256 digest chained over the
// parent block's key and the block's token ids (S1.1).
type Key [KeySize]byte

// String returns the first 8 bytes of the key in hex, enough for logs.
func (k Key) String() string { return hex.EncodeToString(k[:8]) }

// MarshalText writes the whole key in lowercase hex (64 digits): keys in
// JSON (events, /v0/blocks) are strings.
func (k Key) MarshalText() ([]byte, error) {
	return hex.AppendEncode(make([]byte, 0, 2*KeySize), k[:]), nil
}

// UnmarshalText reads a key written by MarshalText.
func (k *Key) UnmarshalText(b []byte) error {
	p, err := ParseKey(string(b))
	if err != nil {
		return err
	}
	*k = p
	return nil
}

// ParseKey reads a key from 64 hex digits.
func ParseKey(s string) (Key, error) {
	var k Key
	if len(s) != 2*KeySize {
		return k, fmt.Errorf("offload: a key is %d hex digits, not %d", 2*KeySize, len(s))
	}
	if _, err := hex.Decode(k[:], []byte(s)); err != nil {
		return k, fmt.Errorf("offload: key %q: %v", s, err)
	}
	return k, nil
}

// RootKey is the parent of the first block of every sequence under seed.
func RootKey(seed string) Key {
	h := sha256.New()
	h.Write([]byte("kvtier/root\x00"))
	h.Write([]byte(seed))
	var k Key
	h.Sum(k[:0])
	return k
}

// NextKey returns the key of the block that follows parent and holds tokens:
// SHA-256(parent || tokens as little-endian uint32).
func NextKey(parent Key, tokens []uint32) Key {
	h := sha256.New()
	h.Write(parent[:])
	var buf [4 * 64]byte
	for len(tokens) > 0 {
		n := min(len(tokens), len(buf)/4)
		for i, t := range tokens[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], t)
		}
		h.Write(buf[:4*n])
		tokens = tokens[n:]
	}
	var k Key
	h.Sum(k[:0])
	return k
}

// BlockKeys returns the keys of the full blocks of tokens, blockTokens
// tokens each, in kvtier's scheme (KeyScheme for the others); a trailing
// partial block gets no key. Equal tokens and seeds give equal keys on
// every node.
func BlockKeys(seed string, blockTokens int, tokens []uint32) []Key {
	return KeyScheme{Seed: seed}.Keys(blockTokens, tokens)
}

// Key schemes (hash_algo): how block keys are computed (S1.1).
const (
	// HashKvtier: the root is SHA-256("kvtier/root\x00" + seed), a
	// block's key SHA-256(parent || token ids as little-endian uint32).
	HashKvtier = "kvtier"
	// HashVLLMSHA256CBOR is vLLM's --prefix-caching-hash-algo sha256_cbor
	// for plain text prompts: the root (vLLM's NONE_HASH) is SHA-256 of
	// the seed as a canonical CBOR text string, a block's key SHA-256 of
	// the canonical CBOR array [parent (bytes), token ids, null] — vLLM's
	// block hash (its P2P key adds a 4-byte KV cache group index on the
	// wire). vLLM's seed is PYTHONHASHSEED if set, else "vllm-none-hash".
	HashVLLMSHA256CBOR = "vllm-sha256-cbor"
)

// HashAlgos are the key schemes, for flags and errors.
var HashAlgos = []string{HashKvtier, HashVLLMSHA256CBOR}

// VLLMDefaultSeed is vLLM's seed when PYTHONHASHSEED is not set.
const VLLMDefaultSeed = "vllm-none-hash"

// KeyScheme computes block keys: Algo is one of HashAlgos ("" is
// HashKvtier), Seed the hash seed.
type KeyScheme struct {
	Algo string
	Seed string
}

// Root is the parent of every sequence's first block.
func (s KeyScheme) Root() Key {
	if s.Algo == HashVLLMSHA256CBOR {
		return sha256.Sum256(cborHead(nil, 3, uint64(len(s.Seed)), s.Seed))
	}
	return RootKey(s.Seed)
}

// Next is the key of the block that follows parent and holds tokens.
func (s KeyScheme) Next(parent Key, tokens []uint32) Key {
	if s.Algo == HashVLLMSHA256CBOR {
		b := make([]byte, 0, 4+KeySize+3+5*len(tokens)+1)
		b = append(b, 0x83)                         // array of 3
		b = cborHead(b, 2, KeySize, "")             // the parent hash: a byte string
		b = append(b, parent[:]...)                 //
		b = cborHead(b, 4, uint64(len(tokens)), "") // the token ids: an array
		for _, t := range tokens {
			b = cborHead(b, 0, uint64(t), "")
		}
		b = append(b, 0xf6) // extra_keys: null
		return sha256.Sum256(b)
	}
	return NextKey(parent, tokens)
}

// cborHead appends a canonical CBOR head of major type major and
// argument n (the shortest form), then text.
func cborHead(b []byte, major byte, n uint64, text string) []byte {
	m := major << 5
	switch {
	case n < 24:
		b = append(b, m|byte(n))
	case n <= 0xff:
		b = append(b, m|24, byte(n))
	case n <= 0xffff:
		b = append(b, m|25, byte(n>>8), byte(n))
	case n <= 0xffffffff:
		b = append(b, m|26)
		b = binary.BigEndian.AppendUint32(b, uint32(n))
	default:
		b = append(b, m|27)
		b = binary.BigEndian.AppendUint64(b, n)
	}
	return append(b, text...)
}

// Keys returns the keys of tokens' full blocks.
func (s KeyScheme) Keys(blockTokens int, tokens []uint32) []Key {
	if blockTokens <= 0 {
		return nil
	}
	keys := make([]Key, 0, len(tokens)/blockTokens)
	parent := s.Root()
	for len(tokens) >= blockTokens {
		parent = s.Next(parent, tokens[:blockTokens])
		keys = append(keys, parent)
		tokens = tokens[blockTokens:]
	}
	return keys
}

// Chain is a prompt's blocks: their keys, each block's parent and token
// ids. An engine that sets Request.Chain lets the CPU tier's stored events
// carry the parent key and token ids (S2.8), for routers that index
// blocks by tokens.
type Chain struct {
	Root        Key // the parent of Keys[0]
	Keys        []Key
	Tokens      []uint32 // len(Keys) × BlockTokens; never changed (events share it)
	BlockTokens int
	index       map[Key]int
}

// NewChain returns the chain of tokens' full blocks under the scheme.
func NewChain(scheme KeyScheme, blockTokens int, tokens []uint32) *Chain {
	keys := scheme.Keys(blockTokens, tokens)
	c := &Chain{Root: scheme.Root(), Keys: keys, Tokens: tokens[:len(keys)*blockTokens], BlockTokens: blockTokens,
		index: make(map[Key]int, len(keys))}
	for i, k := range keys {
		if _, dup := c.index[k]; !dup {
			c.index[k] = i
		}
	}
	return c
}

// Index is k's position in the chain.
func (c *Chain) Index(k Key) (int, bool) {
	i, ok := c.index[k]
	return i, ok
}

// Parent is the key before block i.
func (c *Chain) Parent(i int) Key {
	if i == 0 {
		return c.Root
	}
	return c.Keys[i-1]
}

// Fingerprint summarises everything two nodes must agree on before they
// exchange blocks: the KV geometry (layers, heads, dtype, block size), the key scheme and
// the hash seed. Peers compare fingerprints in their handshake so that a
// different seed or layout is rejected instead of silently never hitting.
func Fingerprint(g Geometry, seed, algo string) string {
	h := sha256.New()
	fmt.Fprintf(h, "kvtier/fingerprint/v1\x00layers=%d\x00block_tokens=%d\x00kv_heads=%d\x00head_dim=%d\x00dtype=%s\x00fused=%t\x00seed=%s",
		g.Layers, g.BlockTokens, g.KVHeads, g.HeadDim, g.DType, g.Fused, seed)
	if algo != "" && algo != HashKvtier {
		fmt.Fprintf(h, "\x00hash_algo=%s", algo) // kvtier's fingerprints as before
	}
	return hex.EncodeToString(h.Sum(nil))
}
