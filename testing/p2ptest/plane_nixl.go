//go:build nixl

package p2ptest

// DataPlane is the data plane NewNode's nodes use: NIXL in this build.
const DataPlane = "nixl"
