package cudakv

import (
	"encoding/binary"
	"hash/crc32"
	"math/rand/v2"
	"testing"
)

// rawCRC is the raw CRC the kernel computes per segment: initial value 0,
// no final xor (hash/crc32 applies both).
func rawCRC(p []byte) uint32 { return ^crc32.Update(0xFFFFFFFF, castagnoli, p) }

func TestMulModP(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		c, n := rng.Uint32(), rng.IntN(3000)
		// Moving a raw CRC past n zero bytes is what processing them does.
		want := ^crc32.Update(^c, castagnoli, make([]byte, n))
		if got := mulModP(xPow8(uint64(n)), c); got != want {
			t.Fatalf("c=%08x past %d zero bytes: %08x, want %08x", c, n, got, want)
		}
		k := rng.Uint32()
		if got, want := newMulTable(k).mul(c), mulModP(k, c); got != want {
			t.Fatalf("table product %08x, want %08x", got, want)
		}
	}
}

// The block's CRC32C from its segments' raw CRCs, as the CUDA backend
// joins what kv_store_sum wrote.
func TestBlockCRCJoin(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, c := range []struct{ seg, nseg int }{{16, 1}, {4096, 2}, {2050, 5}, {1, 7}, {8192, 56}} {
		block := make([]byte, c.seg*c.nseg)
		for i := range block {
			block[i] = byte(rng.Uint32())
		}
		raws := make([]uint32, c.nseg)
		for s := range raws {
			raws[s] = rawCRC(block[s*c.seg : (s+1)*c.seg])
		}
		if got, want := newBlockCRC(c.seg, c.nseg).join(raws), crc32.Checksum(block, castagnoli); got != want {
			t.Errorf("seg %d × %d: joined %08x, want %08x", c.seg, c.nseg, got, want)
		}
	}
}

// kernelCRC replays, lane by lane, what a warp of kv_store_sum computes
// for one segment (kernels/copy.cu: crc_tables_init, crc_step,
// copy_vec16, copy_segment, the warp's xor), so that the scheme is checked
// on machines without a GPU; the GPU tests check the kernel itself.
type kernelCRC struct {
	slice [16][256]uint32
	skip  *mulTable
}

func newKernelCRC() *kernelCRC {
	k := &kernelCRC{skip: newMulTable(xPow8(496))}
	for i := range 256 {
		k.slice[0][i] = castagnoli[i]
	}
	for j := 1; j < 16; j++ {
		for i := range 256 {
			c := k.slice[j-1][i]
			k.slice[j][i] = k.slice[0][c&255] ^ c>>8
		}
	}
	return k
}

func (k *kernelCRC) step(acc uint32, chunk []byte) uint32 {
	c := k.skip.mul(acc) ^ binary.LittleEndian.Uint32(chunk)
	var out uint32
	for b := range 4 {
		out ^= k.slice[15-b][c>>(8*b)&255]
	}
	for b := 4; b < 16; b++ {
		out ^= k.slice[15-b][chunk[b]]
	}
	return out
}

func (k *kernelCRC) segment(src []byte, aligned bool) uint32 {
	const warp = 32
	n := uint64(len(src))
	var sum uint32
	for lane := range uint64(warp) {
		var c uint32
		if aligned { // copy_vec16: chunks lane, lane+32, …
			chunks := n / 16
			if lane >= chunks {
				continue
			}
			for i := lane; i < chunks; i += warp {
				c = k.step(c, src[16*i:16*i+16])
			}
			last := lane + (chunks-1-lane)/warp*warp
			c = mulModP(xPow8((chunks-1-last)*16), c)
		} else { // the unaligned paths: a contiguous range per lane
			per := (n + warp - 1) / warp
			lo := min(n, lane*per)
			hi := min(n, lo+per)
			for _, b := range src[lo:hi] {
				c = k.slice[0][(c^uint32(b))&255] ^ c>>8
			}
			c = mulModP(xPow8(n-hi), c)
		}
		sum ^= c
	}
	return sum
}

func TestKernelCRCScheme(t *testing.T) {
	k := newKernelCRC()
	rng := rand.New(rand.NewPCG(5, 6))
	// Fewer chunks than lanes, one per lane, a ragged last round, many.
	for _, n := range []int{16, 32, 496, 512, 528, 4096, 4112, 8192 + 48, 64 << 10} {
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(rng.Uint32())
		}
		if got, want := k.segment(src, true), rawCRC(src); got != want {
			t.Errorf("%d bytes, 16-byte path: %08x, want %08x", n, got, want)
		}
	}
	for _, n := range []int{1, 3, 31, 33, 2050, 2052, 4099} {
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(rng.Uint32())
		}
		if got, want := k.segment(src, false), rawCRC(src); got != want {
			t.Errorf("%d bytes, unaligned path: %08x, want %08x", n, got, want)
		}
	}
}
