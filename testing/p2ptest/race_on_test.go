//go:build race

package p2ptest

// race says whether the race detector is on: it makes sync.Pool drop
// items at random, so allocation counts that rely on pools do not hold.
const race = true
