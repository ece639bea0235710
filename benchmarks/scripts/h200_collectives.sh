#!/usr/bin/env bash
# GPU collectives on a 2-GPU host: the GPU tests (ranks_gpu_*), then the benchmark against NCCL and torch
# symmetric memory. Run from the repository root on the GPU machine; logs go to $OUT (default: ./out).
# Usage: OUT=/tmp/out bash benchmarks/scripts/h200_collectives.sh [--quick]
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
PY=$(command -v python3)
COMMIT=$(cat .commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
{
  echo "commit: $COMMIT"; date -u; nvidia-smi -L
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "\$ pytest tests/collectives/ranks_gpu_collectives.py tests/collectives/ranks_gpu_shared.py"
    timeout "${TEST_TIMEOUT:-420}" $PY -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} \
      tests/collectives/ranks_gpu_collectives.py tests/collectives/ranks_gpu_shared.py
    echo "[exit $?]"
  fi
} 2>&1 | tee "$OUT/gpu_tests.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  { echo "commit: $COMMIT"; echo "\$ mpirun -n 2 python3 -m xelink.bench gpu-collectives --out $OUT $*"
    timeout "${BENCH_TIMEOUT:-300}" mpirun -n 2 $PY -m xelink.bench gpu-collectives --out "$OUT" "$@"
    echo "[exit $?]"; } 2>&1 | tee "$OUT/gpu_bench.log"
fi
