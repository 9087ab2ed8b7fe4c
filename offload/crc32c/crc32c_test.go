package crc32c

import (
	"hash/crc32"
	"math/rand/v2"
	"testing"
)

// TestUpdateMatchesHashCRC32 compares every length up to a few strides
// past the folding threshold, at every alignment of a word, and from
// several starting values, with hash/crc32.
func TestUpdateMatchesHashCRC32(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 8<<10+8)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	for _, init := range []uint32{0, 1, 0xffffffff, rng.Uint32()} {
		for off := range 8 {
			for n := 0; n+off <= len(buf); n += 1 + n/64 {
				p := buf[off : off+n]
				if got, want := Update(init, p), crc32.Update(init, table, p); got != want {
					t.Fatalf("Update(%#x, %d bytes at %d) = %#x, hash/crc32 says %#x", init, n, off, got, want)
				}
			}
		}
	}
}

// TestChained checks that a block checksummed in pieces, as the P2P
// consumer does while bytes arrive, equals the whole block's.
func TestChained(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	p := make([]byte, 1<<20+3)
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
	want := crc32.Checksum(p, table)
	var crc uint32
	for rest := p; len(rest) > 0; {
		n := min(len(rest), 1+rng.IntN(300<<10))
		crc, rest = Update(crc, rest[:n]), rest[n:]
	}
	if crc != want {
		t.Fatalf("in pieces %#x, whole %#x", crc, want)
	}
}

// TestUpdateAllocatesNothing: the consumer checks every chunk of every
// block as it arrives, so a call must not allocate (the folded remainder
// once went to hash/crc32 as a slice, which escaped: one allocation a
// call).
func TestUpdateAllocatesNothing(t *testing.T) {
	p := make([]byte, 64<<10)
	if n := testing.AllocsPerRun(100, func() { Update(1, p) }); n != 0 {
		t.Fatalf("Update allocates %v times a call", n)
	}
}

func FuzzUpdate(f *testing.F) {
	f.Add(uint32(0), make([]byte, 1024))
	f.Add(uint32(7), make([]byte, 4097))
	f.Fuzz(func(t *testing.T, init uint32, p []byte) {
		if got, want := Update(init, p), crc32.Update(init, table, p); got != want {
			t.Fatalf("Update(%#x, %d bytes) = %#x, hash/crc32 says %#x", init, len(p), got, want)
		}
	})
}

func BenchmarkUpdate(b *testing.B) {
	p := make([]byte, 128<<10)
	b.Run("crc32c", func(b *testing.B) {
		b.SetBytes(int64(len(p)))
		for b.Loop() {
			Update(0, p)
		}
	})
	b.Run("hash-crc32", func(b *testing.B) {
		b.SetBytes(int64(len(p)))
		for b.Loop() {
			crc32.Update(0, table, p)
		}
	})
}
