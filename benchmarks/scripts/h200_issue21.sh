#!/usr/bin/env bash
# Issues 20-21 on one GPU, in priority order (each step has its own time limit): the distributed GEMM's GPU
# tests (tests/dist/ranks_gpu_dist_gemm.py, 2 and 3 ranks sharing the GPU), the kernel GPU tests touched by
# the host-time work (every fast launch checked), the dist-gemm benchmark on 2 ranks sharing the GPU, and the
# quick gemv and attention families (host-time rows). Usage: OUT=/tmp/out bash benchmarks/scripts/h200_issue21.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
OUT=${OUT:-out}; mkdir -p "$OUT"
C=$(cat .commit 2>/dev/null || git rev-parse HEAD)
{ echo "commit: $C"; date -u; nvidia-smi -L; } > "$OUT/machine.txt"
timeout 190 python3 -m pytest -q -rfEs -p no:cacheprovider tests/dist/ranks_gpu_dist_gemm.py > "$OUT/dist_gpu_tests.log" 2>&1
echo "[exit $?]" >> "$OUT/dist_gpu_tests.log"; tail -4 "$OUT/dist_gpu_tests.log"
XELINK_LAUNCH_CHECK=1 timeout 140 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu tests/kernels/test_launcher.py \
  tests/kernels/test_gemv.py tests/kernels/test_attention.py > "$OUT/kernels_gpu_tests.log" 2>&1
echo "[exit $?]" >> "$OUT/kernels_gpu_tests.log"; tail -2 "$OUT/kernels_gpu_tests.log"
XELINK_RANKS_PER_DEVICE=2 timeout 120 mpirun -n 2 python3 -m xelink.bench dist-gemm --quick --shapes 8192 2048x4096x4096 \
  --out "$OUT/bench" --commit "$C" > "$OUT/bench_dist_gemm.log" 2>&1; echo "[dist-gemm exit $?]"
timeout 50 python3 -m xelink.bench gemv --quick --out "$OUT/bench" --commit "$C" > "$OUT/bench_gemv.log" 2>&1; echo "[gemv exit $?]"
PYTHONFAULTHANDLER=1 timeout -s ABRT 60 python3 -m xelink.bench attention --quick --out "$OUT/bench" --commit "$C" \
  > "$OUT/bench_attention.log" 2>&1; echo "[attention exit $?]"
grep -hE "diff|ratio|% of|pct" "$OUT"/bench_*.log | head -40
