#!/usr/bin/env bash
# Issue 20's one-launch splits on one H200: the gemv / attention / launcher GPU tests with every fast launch
# checked (XELINK_LAUNCH_CHECK=1), then the gemv and attention families' quick runs (host-time rows against
# torch, kernel ratios); with MODELS=1 first the Llama GPU tests (issue 25: TP = 2 and CP = 2 with ranks sharing
# the GPU, against transformers). Usage, from the repository root after `git rev-parse HEAD > .commit`:
#   OUT=/tmp/out bash benchmarks/scripts/h200_split.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
OUT=${OUT:-out}; mkdir -p "$OUT"
C=$(cat .commit 2>/dev/null || git rev-parse HEAD)
step() {  # step NAME LIMIT command...: output to $OUT/NAME.log, the exit status appended
  local name=$1 limit=$2; shift 2
  { echo "commit: $C, $(date -u), $(nvidia-smi -L | head -1)"; echo "\$ $*"; timeout "$limit" "$@"; echo "[exit $?]"; } \
    > "$OUT/$name.log" 2>&1
  tail -n 3 "$OUT/$name.log"
}
if [ "${MODELS:-0}" = 1 ]; then
  step models_gpu_tests 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/models
fi
step kernel_gpu_tests 220 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu \
  tests/kernels/test_gemv.py tests/kernels/test_attention.py tests/kernels/test_launcher.py
step bench_gemv 150 python3 -m xelink.bench gemv --quick --out "$OUT/bench" --commit "$C"
step bench_attention 120 python3 -m xelink.bench attention --quick --out "$OUT/bench" --commit "$C"
rm -f "$OUT"/bench/*.txt
grep -hE ":host" "$OUT"/bench_*.log | head -40
