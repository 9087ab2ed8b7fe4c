module github.com/kvtier/kvtier/testing

go 1.26.0

require (
	github.com/google/go-cmp v0.7.0
	github.com/kvtier/kvtier/offload v0.0.0
)

require golang.org/x/sys v0.50.0 // indirect

replace (
	github.com/kvtier/kvtier/ctl => ../ctl
	github.com/kvtier/kvtier/cudakv => ../cudakv
	github.com/kvtier/kvtier/nixlgo => ../nixlgo
	github.com/kvtier/kvtier/offload => ../offload
	github.com/kvtier/kvtier/p2pd => ../p2pd
)
