//go:build nixl

package e2e

// In a nixl build (make test-nixl) the daemons are built with NIXL and
// move blocks over it.
var (
	buildTags = []string{"-tags", "nixl"}
	planeArgs = []string{"-data-plane", "nixl"}
)
