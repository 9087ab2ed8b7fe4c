//go:build !nixl

package p2ptest

// DataPlane is the data plane NewNode's nodes use: TCP, or NIXL in a
// build with the nixl tag (make test-nixl).
const DataPlane = "tcp"
