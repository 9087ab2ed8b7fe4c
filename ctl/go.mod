module github.com/kvtier/kvtier/ctl

go 1.26.0

require github.com/kvtier/kvtier/p2pd v0.0.0

replace github.com/kvtier/kvtier/p2pd => ../p2pd
