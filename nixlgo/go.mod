module github.com/kvtier/kvtier/nixlgo

go 1.26
