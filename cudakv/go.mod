module github.com/kvtier/kvtier/cudakv

go 1.26
