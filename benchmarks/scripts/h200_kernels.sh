#!/usr/bin/env bash
# GPU tests of the local kernels and the kernel benchmark families (xelink bench gemm, gemv, norm, decode).
# With two or more GPUs the tests run on the last GPU while the benchmark runs alone on GPU 0;
# with one GPU they run one after the other.
# Usage, from the repository root:  OUT=/tmp/out bash benchmarks/scripts/h200_kernels.sh [benchmark args]
# Writes $OUT/gpu_tests.log, $OUT/bench.log and each family's $OUT/<family>.jsonl and .txt.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-540}
# .commit (written by `git rev-parse HEAD > .commit` before the tree is copied to the GPU machine) wins:
# a copy of the tree may carry a stale .git whose HEAD is not the code that runs.
COMMIT=$(cat .commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
NGPU=$(nvidia-smi -L | wc -l)
tests() {
  {
    echo "commit: $COMMIT"; date -u; nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "\$ CUDA_VISIBLE_DEVICES=$1 python3 -m pytest -q -rfEs -n ${WORKERS:-12} tests/kernels/test_gemm.py tests/kernels/test_gemv.py tests/kernels/test_norm.py"
    CUDA_VISIBLE_DEVICES=$1 timeout "$LIMIT" python3 -m pytest -q -rfEs -p no:cacheprovider -n "${WORKERS:-12}" \
      tests/kernels/test_gemm.py tests/kernels/test_gemv.py tests/kernels/test_norm.py
    echo "[pytest exit $?]"
  } > "$OUT/gpu_tests.log" 2>&1
}
bench() {
  # One family after another; extra options go to every family (FAMILIES=gemv for the gemv sweeps).
  : > "$OUT/bench.log"
  for fam in ${FAMILIES:-gemm gemv norm decode}; do
    echo "\$ CUDA_VISIBLE_DEVICES=0 python3 -m xelink.bench $fam --out \$OUT --commit $COMMIT $*" >> "$OUT/bench.log"
    CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" python3 -m xelink.bench "$fam" --out "$OUT" --commit "$COMMIT" "$@" \
      >> "$OUT/bench.log" 2>&1
    echo "[bench $fam exit $?]" >> "$OUT/bench.log"
  done
}
if [ "$NGPU" -ge 2 ]; then
  tests $((NGPU - 1)) &
  bench "$@"
  wait
else
  tests 0
  bench "$@"
fi
tail -n 3 "$OUT/gpu_tests.log"
tail -n 80 "$OUT/bench.log"
