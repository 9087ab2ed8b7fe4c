//go:build !amd64

package crc32c

const useFold = false

func fold(r uint32, p []byte) (lo, hi uint64) { panic("crc32c: no fold on this architecture") }
