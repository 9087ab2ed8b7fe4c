# kvtier — build, test and run the workspace. Everything but `vendor` and
# `vendor-check` works offline from the committed vendor/ directory.

PKGS    := github.com/kvtier/kvtier/...
OFFLINE := GOFLAGS=-mod=vendor GOPROXY=off
GO      ?= go

.PHONY: all build test fmt-check vet race allocs nocgo vendor vendor-check bench kvbench demo clean generate check-cuda gpu-bundle fuzz test-nixl build-nixl kvbench-nixl nixl-check test-vllm

# The CUDA kernels: compiled by nvcc into a committed fatbin (sm_80, sm_90
# and compute_80 PTX) that cudakv embeds; copy.cu.sha256 records the source
# it was built from, and cudakv's tests fail when they differ.
KERNELS    := cudakv/kernels
NVCC_FLAGS := -fatbin -O3 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=compute_80

all: build

# NIXL (for the nixl build tag) is not packaged: build it yourself and point
# NIXL_PREFIX at its install prefix (docs/nixl.md).
NIXL_PREFIX ?= /opt/nixl
NIXL_LIB    := $(firstword $(wildcard $(NIXL_PREFIX)/lib/x86_64-linux-gnu $(NIXL_PREFIX)/lib64) $(NIXL_PREFIX)/lib)
NIXL_ENV    := CGO_CXXFLAGS="-I$(NIXL_PREFIX)/include" CGO_LDFLAGS="-L$(NIXL_LIB) -Wl,-rpath,$(NIXL_LIB)" UCX_TLS=$${UCX_TLS:-tcp} UCX_NET_DEVICES=$${UCX_NET_DEVICES:-lo}

## build: binaries into bin/
build:
	@mkdir -p bin
	$(OFFLINE) $(GO) build -o bin/ $(PKGS)

## test: gofmt check, go vet, race-enabled tests, and a CGO_ENABLED=0 build
test: fmt-check vet race allocs nocgo

fmt-check:
	@out=$$(git ls-files -co --exclude-standard '*.go' | grep -v '^vendor/' | xargs gofmt -l); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

vet:
	$(OFFLINE) $(GO) vet $(PKGS)

race:
	$(OFFLINE) $(GO) test -race -count=1 $(PKGS)

# allocs: the allocation tests again without the race detector, which
# changes allocation counts (sync.Pool drops items under it)
allocs:
	$(OFFLINE) $(GO) test -count=1 -run 'Allocs' $(PKGS)

nocgo:
	CGO_ENABLED=0 $(OFFLINE) $(GO) build $(PKGS)

# The packages whose tests change with the nixl tag: the binding, the NIXL
# data plane, and the P2P end-to-end tests (in-process and real daemons),
# which run over NIXL in a nixl build.
NIXL_PKGS := github.com/kvtier/kvtier/nixlgo/... github.com/kvtier/kvtier/p2pd/p2p github.com/kvtier/kvtier/testing/p2ptest github.com/kvtier/kvtier/testing/e2e

## nixl-check: check the NIXL install at NIXL_PREFIX — its header, its libraries, and that a binary built against it links them
nixl-check:
	@test -f $(NIXL_PREFIX)/include/nixl.h || { echo "no NIXL at NIXL_PREFIX=$(NIXL_PREFIX) (want include/nixl.h): see docs/nixl.md"; exit 1; }
	@for l in libnixl.so libnixl_build.so; do test -e $(NIXL_LIB)/$$l || { echo "no $$l in $(NIXL_LIB): NIXL_PREFIX=$(NIXL_PREFIX) is not a whole NIXL install (docs/nixl.md)"; exit 1; }; done
	@mkdir -p bin
	@$(OFFLINE) $(NIXL_ENV) $(GO) test -c -tags nixl -o bin/nixl-check.test github.com/kvtier/kvtier/nixlgo >bin/nixl-check.log 2>&1 || { \
		echo "building nixlgo against NIXL_PREFIX=$(NIXL_PREFIX) failed (whole log: bin/nixl-check.log):"; tail -15 bin/nixl-check.log; \
		echo "(an undefined absl symbol means abseil was built shared or without -DCMAKE_POSITION_INDEPENDENT_CODE=ON: docs/nixl.md)"; exit 1; }
	@if ldd bin/nixl-check.test | grep -q "not found"; then echo "a NIXL test binary does not find its libraries:"; ldd bin/nixl-check.test | grep "not found"; exit 1; fi
	@echo "NIXL at $(NIXL_PREFIX): $$(ldd bin/nixl-check.test | grep -c libnixl) NIXL libraries linked from $(NIXL_LIB)"

## build-nixl: binaries into bin/ built with the nixl tag against NIXL_PREFIX (p2pd -data-plane nixl)
build-nixl: nixl-check
	@mkdir -p bin
	$(OFFLINE) $(NIXL_ENV) $(GO) build -tags nixl -o bin/ $(PKGS)

## test-nixl: vet with the nixl tag, then run the NIXL tests verbosely against NIXL_PREFIX (over UCX tcp on lo unless UCX_TLS/UCX_NET_DEVICES say otherwise); fails if a test skips for want of NIXL
test-nixl: nixl-check
	@command -v promtool >/dev/null || { echo "test-nixl needs promtool (Debian package prometheus): a metrics test would skip"; exit 1; }
	$(OFFLINE) $(NIXL_ENV) $(GO) vet -tags nixl $(PKGS)
	@mkdir -p bin
	@$(OFFLINE) $(NIXL_ENV) $(GO) test -race -count=1 -v -tags nixl $(NIXL_PKGS) >bin/test-nixl.log 2>&1; rc=$$?; \
	grep -E -- '^(--- |ok|FAIL)|_test.go:' bin/test-nixl.log; \
	if grep -A1 -- '--- SKIP' bin/test-nixl.log | grep -q 'built without NIXL'; then echo "test-nixl: tests skipped for want of NIXL although it is present (bin/test-nixl.log)"; exit 1; fi; \
	[ $$rc = 0 ] || echo "test-nixl: FAIL (whole log: bin/test-nixl.log)"; exit $$rc

## kvbench-nixl: kvbench's B1 over the NIXL and TCP data planes beside plain TCP, with binaries built against NIXL_PREFIX
kvbench-nixl: build-nixl
	$(OFFLINE) $(NIXL_ENV) $(GO) run github.com/kvtier/kvtier/testing/cmd/kvbench -bin bin -data-planes tcp,nixl -json kvbench-nixl.json

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

## kvbench: the daemon benchmarks (B1-B4, M1) with two p2pd processes; writes kvbench.json
kvbench: build
	$(OFFLINE) $(GO) run github.com/kvtier/kvtier/testing/cmd/kvbench -bin bin -json kvbench.json

## test-vllm: run vLLM's own P2P session, protocol and ZeroMQ modules (G2 wire), imported unchanged from VLLM_SRC (a vLLM checkout), against live p2pd nodes in vLLM's dialect (testing/vllmharness; docs/vllm.md); with NIXL_PREFIX also vLLM's NIXL transport, moving blocks both ways; needs python3-zmq, python3-msgpack, python3-cbor2 (and python3-numpy with NIXL)
VLLM_NIXL := $(filter command line environment,$(origin NIXL_PREFIX))
test-vllm: $(if $(VLLM_NIXL),nixl-check)
	@test -n "$(VLLM_SRC)" || { echo "test-vllm needs VLLM_SRC=<a vLLM checkout> (the directory holding vllm/)"; exit 1; }
	@test -d "$(VLLM_SRC)/vllm/v1/kv_offload/tiering/p2p/session" || { echo "VLLM_SRC=$(VLLM_SRC) has no vllm/v1/kv_offload/tiering/p2p/session: not a vLLM checkout with the P2P tier"; exit 1; }
	VLLM_SRC=$(abspath $(VLLM_SRC)) $(if $(VLLM_NIXL),NIXL_PREFIX=$(abspath $(NIXL_PREFIX)) $(NIXL_ENV)) $(OFFLINE) $(GO) test -count=1 -v $(if $(VLLM_NIXL),-tags nixl) -run '^TestVLLMHarness$$' github.com/kvtier/kvtier/testing/e2e

## fuzz: run every fuzz target for FUZZTIME (default 10s) each
FUZZTIME ?= 10s
fuzz:
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzLoadConfig$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/offload
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/p2pd/wire
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzReadFrame$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/p2pd/wire
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzSession$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/p2pd/p2p
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzVLLMSession$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/p2pd/p2p
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzCheckNIXLMeta$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/p2pd/p2p
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzTokenIDs$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/p2pd/node
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzUpdate$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/offload/crc32c
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/p2pd/vllmwire
	$(OFFLINE) $(GO) test -run '^$$' -fuzz '^FuzzReadMessage$$' -fuzztime $(FUZZTIME) github.com/kvtier/kvtier/p2pd/zmtp

## demo: two p2pd on loopback: compute, fetch, pause, fetch from the paused node, shut down
demo: build
	$(OFFLINE) $(GO) run github.com/kvtier/kvtier/testing/cmd/kvdemo -bin bin

## generate: rebuild the kernels' fatbin and record the source hash (installs nvcc if missing)
generate:
	$(KERNELS)/install-nvcc.sh
	nvcc $(NVCC_FLAGS) -o $(KERNELS)/copy.fatbin $(KERNELS)/copy.cu
	cd $(KERNELS) && sha256sum copy.cu > copy.cu.sha256

## check-cuda: prove the kernels still compile and the fatbin is current (installs nvcc if missing)
check-cuda:
	$(KERNELS)/install-nvcc.sh
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	nvcc $(NVCC_FLAGS) -o $$tmp/copy.fatbin $(KERNELS)/copy.cu && echo "check-cuda: kernels compile with $$(nvcc --version | tail -1)"
	cd $(KERNELS) && sha256sum --check --quiet copy.cu.sha256

## gpu-bundle: for a GPU host without Go: cudakv's test binary and cudakv-bench (run.sh), p2pd and kvbench (kvbench.sh)
gpu-bundle:
	rm -rf bin/gpu-bundle && mkdir -p bin/gpu-bundle/kernels
	$(OFFLINE) $(GO) test -c -o bin/gpu-bundle/cudakv.test github.com/kvtier/kvtier/cudakv
	$(OFFLINE) $(GO) build -o bin/gpu-bundle/ github.com/kvtier/kvtier/cudakv/cmd/cudakv-bench
	$(OFFLINE) $(GO) build -trimpath -ldflags=-s -o bin/gpu-bundle/ github.com/kvtier/kvtier/p2pd/cmd/p2pd github.com/kvtier/kvtier/testing/cmd/kvbench
	cp $(KERNELS)/copy.cu $(KERNELS)/copy.cu.sha256 $(KERNELS)/copy.fatbin bin/gpu-bundle/kernels/
	cp cudakv/gpu-bundle.sh bin/gpu-bundle/run.sh
	cp testing/cmd/kvbench/gpu.sh bin/gpu-bundle/kvbench.sh
	@echo "gpu-bundle: on a GPU host, bin/gpu-bundle/run.sh runs the CUDA tests and B6, bin/gpu-bundle/kvbench.sh the daemon benchmarks (B1, B2, ...) on CUDA"

clean:
	rm -rf bin
