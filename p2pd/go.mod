module github.com/kvtier/kvtier/p2pd

go 1.26

replace (
	github.com/kvtier/kvtier/cudakv => ../cudakv
	github.com/kvtier/kvtier/nixlgo => ../nixlgo
	github.com/kvtier/kvtier/offload => ../offload
)
