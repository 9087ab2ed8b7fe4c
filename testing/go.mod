module github.com/kvtier/kvtier/testing

go 1.26

require (
	github.com/google/go-cmp v0.7.0
	github.com/kvtier/kvtier/ctl v0.0.0
	github.com/kvtier/kvtier/cudakv v0.0.0
	github.com/kvtier/kvtier/nixlgo v0.0.0
	github.com/kvtier/kvtier/offload v0.0.0
	github.com/kvtier/kvtier/p2pd v0.0.0
	golang.org/x/sys v0.50.0
)

replace (
	github.com/kvtier/kvtier/ctl => ../ctl
	github.com/kvtier/kvtier/cudakv => ../cudakv
	github.com/kvtier/kvtier/nixlgo => ../nixlgo
	github.com/kvtier/kvtier/offload => ../offload
	github.com/kvtier/kvtier/p2pd => ../p2pd
)
