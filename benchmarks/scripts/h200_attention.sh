#!/bin/bash
# Attention on a 2 x H200 machine, from the repository root:
#   XELINK_COMMIT=<commit> bash benchmarks/scripts/h200_attention.sh [final|sweep] OUTDIR
# GPU 0 runs the attention tests (GPU ones included, parallel workers); GPU 1 runs the benchmark
# (final: the issue-6 shapes through the public API; sweep: the tile candidates). Both at once, so
# their compile time overlaps; the timed kernels run alone on their GPU.
set -o pipefail
mode=${1:-final}
out=${2:-benchmarks/results/h200-attention}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv > "$out/nvidia-smi.csv" 2>&1
bench_args=(--out "$out" --warm-jobs 12)
[ "$mode" = sweep ] && bench_args+=(--sweep)
(CUDA_VISIBLE_DEVICES=0 timeout 140 python3 -m pytest -q -n 12 --timeout 120 -p no:cacheprovider \
    tests/kernels/test_attention.py 2>&1 | tee "$out/gpu_tests.log") &
tests=$!
CUDA_VISIBLE_DEVICES=1 timeout 140 python3 -m xelink.bench attention "${bench_args[@]}" 2>&1 | tee "$out/bench.log"
bench_rc=$?
wait $tests
tests_rc=$?
echo "tests rc=$tests_rc bench rc=$bench_rc"
