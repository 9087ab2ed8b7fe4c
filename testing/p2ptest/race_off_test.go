//go:build !race

package p2ptest

const race = false
