module github.com/kvtier/kvtier/ctl

go 1.26
