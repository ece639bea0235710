#!/usr/bin/env bash
# The multi-rank GPU tests on one GPU, several ranks sharing it (XELINK_RANKS_PER_DEVICE): the peer-memory
# layer and point-to-point on CUDA tensors (tests/symm/ranks_gpu_symm.py, 2-3 ranks), buffers
# reused across calls (tests/collectives/ranks_gpu_reuse.py, 2-4 ranks on GPU 0; one launch per size with
# the symm checks) and every op x algorithm x dtype x
# size (tests/collectives/ranks_gpu_collectives.py, 2 ranks on GPU 0; its checks against NCCL skip: NCCL refuses two
# ranks of one GPU), and the decode layer's GPU test (tests/models). Run from the repository root on the
# GPU machine.
# Usage: OUT=/tmp/out [SMOKE=1] bash benchmarks/scripts/h200_gpu_tests.sh  (writes $OUT/gpu_tests_1gpu.log,
# and with SMOKE=1 $OUT/bench_smoke_1gpu.log)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
COMMIT=$(cat .commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
{
  echo "commit: $COMMIT"; date -u; nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "\$ pytest tests/symm tests/collectives/ranks_gpu_reuse.py"
  timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -q -rfEs -p no:cacheprovider ${PYTEST_ARGS:-} tests/symm \
    tests/collectives/ranks_gpu_reuse.py
  echo "[exit $?]"
  echo "\$ XELINK_RANKS_PER_DEVICE=2 pytest tests/collectives/ranks_gpu_collectives.py"
  XELINK_RANKS_PER_DEVICE=2 timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -q -rfEs -p no:cacheprovider \
    ${PYTEST_ARGS:-} tests/collectives/ranks_gpu_collectives.py
  echo "[exit $?]"
  echo "\$ pytest tests/models"
  timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -q -rfEs -p no:cacheprovider ${PYTEST_ARGS:-} tests/models
  echo "[exit $?]"
} 2>&1 | tee "$OUT/gpu_tests_1gpu.log"
# With SMOKE=1: every single-device benchmark family once, quick (checks that each runs on the GPU and
# that its timed outputs are right; the numbers of a quick run are not results).
if [ "${SMOKE:-0}" = 1 ]; then
  { for fam in gemm gemv norm attention decode; do
      echo "\$ python3 -m xelink.bench $fam --quick --out \$OUT/smoke --commit $COMMIT"
      timeout "${SMOKE_TIMEOUT:-90}" python3 -m xelink.bench "$fam" --quick --out "$OUT/smoke" --commit "$COMMIT" 2>&1 | tail -n 25
      echo "[bench $fam exit ${PIPESTATUS[0]}]"
    done; } 2>&1 | tee "$OUT/bench_smoke_1gpu.log"
fi
