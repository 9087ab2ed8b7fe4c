// Package crc32c computes CRC32C (Castagnoli), the checksum every block
// carries (SEMANTICS S7.2), with the same results as hash/crc32 and its
// Castagnoli table.
//
// On amd64 with AVX-512 and VPCLMULQDQ, buffers of at least 1 KiB are
// folded 256 bytes at a time with carry-less multiplication: 75.8 GB/s
// against hash/crc32's 19.5 on the 2-core development VM (`go test -run
// '^$' -bench Update ./offload/crc32c`, 2026-12-01). The rest, and every
// other machine, uses hash/crc32. A block is checksummed
// on every hop and the P2P consumer does it while the bytes arrive, so on
// a small machine this is a visible share of a fetch's CPU (issue 12).
package crc32c

import "hash/crc32"

var table = crc32.MakeTable(crc32.Castagnoli)

// Table is hash/crc32's Castagnoli table, for callers that need a
// hash.Hash32 (crc32.New(Table)).
var Table = table

// Checksum returns the CRC32C of p.
func Checksum(p []byte) uint32 { return Update(0, p) }

// Update returns the result of adding the bytes in p to crc, as
// crc32.Update(crc, crc32.MakeTable(crc32.Castagnoli), p) does.
func Update(crc uint32, p []byte) uint32 {
	if n := len(p) &^ (stride - 1); useFold && n >= minFold {
		lo, hi := fold(^crc, p[:n])
		// The folded remainder is congruent to everything before it:
		// checksumming its 16 bytes from a zero register, then the
		// tail, gives the CRC of the whole (see fold).
		// The 16 bytes go through the table here: a slice of them passed
		// to hash/crc32 escapes, one allocation a call (issue 12).
		reg := uint32(0) // crc32.Update's register for a start of ^0
		for i := range 16 {
			w := lo
			if i >= 8 {
				w = hi
			}
			reg = table[byte(reg)^byte(w>>(8*(i%8)))] ^ reg>>8
		}
		return crc32.Update(^reg, table, p[n:])
	}
	return crc32.Update(crc, table, p)
}

const (
	// stride is how many bytes one fold step consumes.
	stride = 256
	// minFold is the shortest input worth folding: below it the set-up
	// and the final reduction cost more than hash/crc32 saves.
	minFold = 1024
)
