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
// tokens each; a trailing partial block gets no key. Equal tokens and seeds
// give equal keys on every node.
func BlockKeys(seed string, blockTokens int, tokens []uint32) []Key {
	if blockTokens <= 0 {
		return nil
	}
	keys := make([]Key, 0, len(tokens)/blockTokens)
	parent := RootKey(seed)
	for len(tokens) >= blockTokens {
		parent = NextKey(parent, tokens[:blockTokens])
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

// NewChain returns the chain of tokens' full blocks (BlockKeys).
func NewChain(seed string, blockTokens int, tokens []uint32) *Chain {
	keys := BlockKeys(seed, blockTokens, tokens)
	c := &Chain{Root: RootKey(seed), Keys: keys, Tokens: tokens[:len(keys)*blockTokens], BlockTokens: blockTokens,
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
// exchange blocks: the KV geometry (layers, heads, dtype, block size) and
// the hash seed. Peers compare fingerprints in their handshake so that a
// different seed or layout is rejected instead of silently never hitting.
func Fingerprint(g Geometry, seed string) string {
	h := sha256.New()
	fmt.Fprintf(h, "kvtier/fingerprint/v1\x00layers=%d\x00block_tokens=%d\x00kv_heads=%d\x00head_dim=%d\x00dtype=%s\x00fused=%t\x00seed=%s",
		g.Layers, g.BlockTokens, g.KVHeads, g.HeadDim, g.DType, g.Fused, seed)
	return hex.EncodeToString(h.Sum(nil))
}
