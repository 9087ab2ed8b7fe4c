#!/bin/sh
# Runs cudakv's tests (the CUDA cases included) and B6 on a host that has
# only the NVIDIA driver: no Go, no CUDA toolkit. Results go to $OUT (or
# ./results); a summary prints last. BENCH_ARGS passes flags to the bench.
cd "$(dirname "$0")" || exit 1
out=${OUT:-results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv >"$out/gpu.txt" 2>&1
./cudakv.test -test.v -test.count=1 >"$out/test.log" 2>&1
test_rc=$?
# shellcheck disable=SC2086
./cudakv-bench -json "$out/bench.json" $BENCH_ARGS >"$out/bench.txt" 2>"$out/bench-progress.log"
bench_rc=$?
echo "== GPU"
cat "$out/gpu.txt"
echo "== tests (exit $test_rc): failures and CUDA skips"
grep -E -- '--- (FAIL|SKIP): .*cuda|^(ok|FAIL|PASS)$' "$out/test.log" | head -40
grep -c -- '--- PASS: .*/cuda' "$out/test.log" | sed 's/^/CUDA cases passed: /'
echo "== B6 (exit $bench_rc)"
[ "$bench_rc" = 0 ] || tail -5 "$out/bench-progress.log"
cat "$out/bench.txt"
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
