#!/usr/bin/env bash
# What the 2026-12-02 session built but could not run on a GPU (its device time ran out), in priority order,
# each step with its own limit (about 9 minutes in all): the multi-rank GPU tests of the peer-memory layer,
# the distributed GEMM, context-parallel attention and the Llama model (ranks sharing GPU 0; they share
# launches by world size), the kernel GPU tests with every fast launch checked (gemv's and attention's
# remembered checks, common.path_key), the distributed GEMM's host-time profile (issue 21's breakdown) and
# the attention family's host rows (issue 20). Usage, from the repository root after
# `git rev-parse HEAD > .commit`: OUT=/tmp/out bash benchmarks/scripts/h200_pending.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
OUT=${OUT:-out}; mkdir -p "$OUT"
C=$(cat .commit 2>/dev/null || git rev-parse HEAD)
{ echo "commit: $C"; date -u; nvidia-smi -L; } > "$OUT/machine.txt"
step() {  # step NAME LIMIT command...: output to $OUT/NAME.log, the exit status appended
  local name=$1 limit=$2; shift 2
  { echo "commit: $C"; echo "\$ $*"; timeout "$limit" "$@"; echo "[exit $?]"; } > "$OUT/$name.log" 2>&1
  tail -n 3 "$OUT/$name.log"
}
step gpu_rank_tests 240 python3 -m pytest -q -rfEs -p no:cacheprovider tests/symm/ranks_gpu_symm.py \
  tests/dist/ranks_gpu_dist_gemm.py tests/dist/ranks_gpu_cp_attention.py tests/models
step kernels_gpu_tests 160 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu tests/kernels
step dist_host_profile 60 env XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 benchmarks/scripts/dist_host_profile.py
step bench_attention 70 python3 -m xelink.bench attention --quick --out "$OUT/bench" --commit "$C"
