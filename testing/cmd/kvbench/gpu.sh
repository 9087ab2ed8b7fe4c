#!/bin/sh
# kvbench on a GPU host that has only the NVIDIA driver (make gpu-bundle
# copies this to bin/gpu-bundle/kvbench.sh, beside p2pd and kvbench): B1
# and the whole request with the daemons' GPU caches in device memory (also
# with a consumer whose load_window is 64, alternating: where the load is
# the GPU's copy it should overlap the fetch; compare the two rows), B2
# on a machine with many cores, B3, B4, M1. The run fails unless both
# daemons copy with CUDA. Results go to $OUT (or ./results);
# KVBENCH_ARGS passes flags to kvbench (e.g. -rounds 3 -data-planes tcp).
case ${OUT:-} in
"" | /*) out=${OUT:-results} ;; # results: beside the script
*) out=$PWD/$OUT ;;              # a relative OUT is the caller's
esac
cd "$(dirname "$0")" || exit 1
mkdir -p "$out"
# shellcheck disable=SC2086
timeout 280 ./kvbench -bin "$PWD" -require-copies cuda -data-planes tcp,tcp+token -rounds 5 \
	-json "$out/kvbench.json" $KVBENCH_ARGS >"$out/kvbench.txt" 2>"$out/kvbench-progress.log"
rc=$?
[ "$rc" = 124 ] && echo "(kvbench ran past 280 s; narrow it with KVBENCH_ARGS, e.g. -rounds 3 -data-planes tcp)" >>"$out/kvbench.txt"
echo "== kvbench (exit $rc)"
[ "$rc" = 0 ] || tail -20 "$out/kvbench-progress.log"
cat "$out/kvbench.txt"
exit "$rc"
