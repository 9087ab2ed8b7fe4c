package crc32c

import "golang.org/x/sys/cpu"

var useFold = cpu.X86.HasAVX512F && cpu.X86.HasAVX512VPCLMULQDQ && cpu.X86.HasAVX2

// fold reduces p (a whole number of strides, at least one) to a 128-bit
// value congruent, modulo the Castagnoli polynomial, to p with the raw
// CRC register r xored into its first four bytes; lo holds its first
// eight bytes (little-endian), hi the next eight.
//
// Each 16-byte lane A of the reflected message is moved D bits later by
// A·x^D ≡ A_hi·(x^(D+64) mod P) + A_lo·(x^D mod P): two carry-less
// products of 64 by 32 bits that fit the lane D bits on. Sixteen lanes
// (four ZMM registers) are folded 2048 bits at a time, then into one.
// The constants are rev64(x^(D+63) mod P) and rev64(x^(D-1) mod P): the
// -1 absorbs the one-bit shift of a reflected carry-less product.
//
//go:noescape
func fold(r uint32, p []byte) (lo, hi uint64)
