package cudakv

// CRC32C arithmetic for the CUDA store kernel's checksums. The kernel
// writes each segment's raw CRC (reflected Castagnoli, initial value 0, no
// final xor); a block's CRC32C is its segments' raw CRCs joined in order
// and then given the standard initial value and final xor:
//
//	raw(A‖B) = raw(A)·x^(8|B|) ⊕ raw(B)
//	crc32c(M) = ^(0xFFFFFFFF·x^(8|M|) ⊕ raw(M))
//
// Polynomials are reflected: x^0 is bit 31.

const crcPoly = 0x82F63B78

// mulModP is a·b mod P.
func mulModP(a, b uint32) uint32 {
	var p uint32
	for m := uint32(1) << 31; m != 0; m >>= 1 {
		if a&m != 0 {
			p ^= b
		}
		if b&1 != 0 {
			b = b>>1 ^ crcPoly
		} else {
			b >>= 1
		}
	}
	return p
}

// xPow8 is x^(8n) mod P: what multiplying by moves a CRC past n zero bytes.
func xPow8(n uint64) uint32 {
	p, sq := uint32(1)<<31, uint32(1)<<23 // x^0, x^8
	for ; n != 0; n >>= 1 {
		if n&1 != 0 {
			p = mulModP(p, sq)
		}
		sq = mulModP(sq, sq)
	}
	return p
}

// mulTable multiplies by one constant with four lookups (the product is
// linear in the other factor, so it is the xor of its bytes' products).
type mulTable [4][256]uint32

func newMulTable(k uint32) *mulTable {
	t := new(mulTable)
	for i := range 4 {
		for b := range 256 {
			t[i][b] = mulModP(k, uint32(b)<<(8*i))
		}
	}
	return t
}

func (t *mulTable) mul(a uint32) uint32 {
	return t[0][a&255] ^ t[1][a>>8&255] ^ t[2][a>>16&255] ^ t[3][a>>24]
}

// blockCRC joins the raw CRCs of a block's segments, each segBytes long,
// into the block's CRC32C.
type blockCRC struct {
	skip *mulTable // · x^(8·segBytes)
	init uint32    // 0xFFFFFFFF · x^(8·block bytes)
}

func newBlockCRC(segBytes, segments int) blockCRC {
	return blockCRC{
		skip: newMulTable(xPow8(uint64(segBytes))),
		init: mulModP(0xFFFFFFFF, xPow8(uint64(segBytes)*uint64(segments))),
	}
}

func (c blockCRC) join(raw []uint32) uint32 {
	var h uint32
	for _, r := range raw {
		h = c.skip.mul(h) ^ r
	}
	return ^(c.init ^ h)
}
