#!/usr/bin/env bash
# Issue 20 on one GPU: the kernel GPU tests with every fast launch checked (TESTS=1), the host profile of
# eager gemm/rmsnorm calls, the gemm family (graph ratios, row blocks, host rows) and the quick norm, gemv
# and attention families (host rows). Usage: OUT=/tmp/out [TESTS=1] bash benchmarks/scripts/h200_issue20_host.sh
export PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-out}; mkdir -p "$OUT"
C=$(cat .commit 2>/dev/null || git rev-parse HEAD)
if [ "${TESTS:-0}" = 1 ]; then
  XELINK_LAUNCH_CHECK=1 timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -n 8 -m gpu tests/kernels/test_launcher.py \
    tests/kernels/test_norm.py tests/kernels/test_gemm.py > "$OUT/kernels_gpu_tests_host.log" 2>&1
  echo "[exit $?]" >> "$OUT/kernels_gpu_tests_host.log"; tail -3 "$OUT/kernels_gpu_tests_host.log"
fi
timeout 100 python3 benchmarks/scripts/kernel_host_profile.py > "$OUT/host_profile.txt" 2>&1; echo "[profile exit $?]" >> "$OUT/host_profile.txt"
timeout 200 python3 -m xelink.bench gemm --out "$OUT/bench" --commit "$C" > "$OUT/bench_gemm.log" 2>&1; echo "[gemm exit $?]"
for fam in norm gemv attention; do
  timeout 90 python3 -m xelink.bench $fam --quick --out "$OUT/bench" --commit "$C" > "$OUT/bench_$fam.log" 2>&1; echo "[$fam exit $?]"
done
grep -hE ":host|row-blocks|TFLOP" "$OUT"/bench_*.log | head -60
