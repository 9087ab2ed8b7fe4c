module github.com/kvtier/kvtier/p2pd

go 1.26.0

require (
	github.com/kvtier/kvtier/cudakv v0.0.0
	github.com/kvtier/kvtier/offload v0.0.0
	golang.org/x/sys v0.50.0
)

replace (
	github.com/kvtier/kvtier/cudakv => ../cudakv
	github.com/kvtier/kvtier/offload => ../offload
)
