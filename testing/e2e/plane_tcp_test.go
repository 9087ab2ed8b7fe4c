//go:build !nixl

package e2e

// The daemons use the default (TCP) data plane.
var buildTags, planeArgs []string
