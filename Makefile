# kvtier — build, test and run the workspace. Everything but `vendor` and
# `vendor-check` works offline from the committed vendor/ directory.

PKGS    := github.com/kvtier/kvtier/...
OFFLINE := GOFLAGS=-mod=vendor GOPROXY=off
GO      ?= go

.PHONY: all build test fmt-check vet race nocgo vendor vendor-check bench demo clean

all: build

## build: binaries into bin/
build:
	@mkdir -p bin
	$(OFFLINE) $(GO) build -o bin/ $(PKGS)

## test: gofmt check, go vet, race-enabled tests, and a CGO_ENABLED=0 build
test: fmt-check vet race nocgo

fmt-check:
	@out=$$(git ls-files -co --exclude-standard '*.go' | grep -v '^vendor/' | xargs gofmt -l); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

vet:
	$(OFFLINE) $(GO) vet $(PKGS)

race:
	$(OFFLINE) $(GO) test -race -count=1 $(PKGS)

nocgo:
	CGO_ENABLED=0 $(OFFLINE) $(GO) build $(PKGS)

## vendor: regenerate vendor/ (needs the module proxy)
vendor:
	$(GO) work vendor

## vendor-check: regenerate vendor/ and fail if it differs from the commit
vendor-check: vendor
	@git diff --exit-code -- vendor go.work.sum || { echo "vendor/ is out of date: run make vendor and commit"; exit 1; }
	@untracked=$$(git status --porcelain --untracked-files=all -- vendor); \
	if [ -n "$$untracked" ]; then echo "vendor/ has files not committed:"; echo "$$untracked"; exit 1; fi

## bench: the project's Go benchmarks, each beside its baseline in the same run
bench:
	$(OFFLINE) $(GO) test -run '^$$' -bench . -count 5 $(PKGS)

## demo: an engine-like workload through the tiering manager
demo:
	$(OFFLINE) $(GO) run github.com/kvtier/kvtier/testing/cmd/kvdemo

clean:
	rm -rf bin
