#!/usr/bin/env bash
# The lent one-GPU runs (H200 or H100; several ranks share the GPU where a check needs them), a group a call:
#   host:     where the host time of the kernels (gemm, attention, gemv) and of the distributed GEMM goes, the
#             attention and gemv families' rows (issue 20's target: torch + 10 us) (~7 minutes);
#   tests:    every kernel GPU test with each fast launch checked against Triton's own key (XELINK_LAUNCH_CHECK=1)
#             (~5 minutes);
#   ranks:    the multi-rank GPU tests of the peer-memory layer, the distributed GEMM, context-parallel attention,
#             then the Llama model's GPU tests (~6 minutes); all: host, tests, ranks (more than one call allows);
#   collectives: the GPU collectives' one-GPU rank tests (buffers reused across calls, uneven packages; then every
#             op and algorithm with 2 ranks on the GPU: NCCL's comparisons skip there) (~9 minutes; ranks_gpu_shared.py
#             needs 2 GPUs);
#   bench:    the distributed GEMM and context-parallel attention families with 2 ranks sharing the GPU
#             (correctness and a time-sliced sanity figure; their targets need one GPU per rank, issue 28);
#   training: the gradient checks (CP attention, distributed GEMM), the CP x TP training client on CUDA, the
#             peer-memory checks of stalled and posted receives, the flash backward's GPU tests (~5 minutes);
#   rows:     issue 22/23/26 timings: decode step rows at 1K/8K/32K, the fused decode's A/B, the gated GEMM's tile
#             rows, the flash backward's tiles against SDPA and its host profile (~8 minutes);
#   tiles:    decode attention's kernel configurations at B = 1 / 8 and 8K-128K caches against SDPA, B = 1 at 8K
#             included (the latency-bound shape of issue 23's 1.1x and issue 26's 8K row) (~3 minutes);
#   suite:    the whole suite as a user launches it on one GPU, one rank and two ranks sharing it (every family
#             ok; NCCL baselines left out where ranks share the GPU) (~4 minutes);
#   slices:   issue 22's gated GEMM with column slices (k_slices): its GPU tests and the scatter GEMM's (they
#             share the waits), the gated rows of every shape (rows and column slices, flags set and copy-engine
#             arrivals), then the fused distributed GEMM's checks with ranks sharing the GPU (~6 minutes);
#   prefetch: the decode attention's prefetch of the O weight (issue 26): its GPU tests and decode graphs, then
#             its A/B in the Llama-3.1-8B step (~5 minutes);
#   abs:      the step A/B scripts on their shared helpers (step_ab.py): each run once (~6 minutes);
#   h200:     on an H200: issue 26's decode rows, issue 22's gated GEMM rows (column slices) and where its arrival rows
#             lose time (gated_arrivals_ab.py) (~7 minutes);
#   gated:    issue 22's gated GEMM rows, gated_arrivals_ab.py, then 4 / 8 / 16 chunks and slices (~6 minutes);
#   window:   sliding-window attention (window=): the attention and prefetch GPU tests with the windowed ones, the
#             decode graphs (a windowed Mistral among them), what a window saves (window_ab.py), then the decode
#             rows, unwindowed, as a check that the kernels' new arguments cost nothing (~5 minutes);
#   qgemm:    quantized projections past 8 rows: qgemm's GPU tests with every fast launch checked, the Llama GPU
#             rank checks whose W8A16 / W4A16 prefills run on it, then qgemm_ab.py (~5 minutes);
#   w4tiles:  W4A16 weights in tiles ("w4a16t"): the tensor-core gemv, qgemm and decode-graph GPU tests with every fast
#             launch checked, the decode step's A/B (tiles_ab.py: tiles against rows), the one-row GEMVs' tiles
#             (gemv_chain_sweep.py), qgemm's A/B (the kernel at 16 / 1024 rows, a W4A16 prefill and batch-16 step
#             through the model), the windowed CP = 2 check on CUDA (~10 minutes: its tests took more than the
#             200 s they had at cc7995e); w4check: the tiled format's own
#             GPU tests with tracebacks, then the step's A/B (~5 minutes);
#   windows:  sliding windows in training and context parallelism: the windowed flash backward's GPU tests (the
#             autograd tests with it), then the windowed cp_attention checks (the halo exchange, ranks sharing the
#             GPU) and the windowed Mistral at CP = 2 against transformers (~4 minutes);
#   s26:      what the twenty-sixth session changed after its last GPU run: qgemm's remembered checks (its GPU tests,
#             the remembered-call test among them), flash_attention_varlen's offsets read once a version (its GPU
#             tests), then qgemm's host time (~4 minutes);
#   s27:      the tensor-core GEMV with act="silu_mul" in the kernel (gemv.TC_ACT_FUSED, off): its tiled and act GPU
#             tests, gate_up's chain with and without it, then (unless NO_MORE=1) the W4A16 step with and without it and
#             cp_attention_varlen's CUDA checks with ranks sharing the GPU (~3 / ~7 minutes; the twenty-seventh session
#             ran the act tests and the chain on an H100, not the rest);
#   s28:      what the twenty-seventh and twenty-eighth sessions left unrun on a GPU, in order of need: the Llama
#             CP = 2 checks (a ragged batch; the decode step in a CUDA graph under TP and CP), cp_attention_varlen's
#             CUDA checks, the decode family's CP = 2 row (ranks sharing the GPU: a check, not a speed),
#             then (unless NO_MORE=1) the W4A16 step with and without TC_ACT_FUSED (~9 minutes; ran on an H100 at
#             c82e224 / fab8f6f, every step passed: h100-gpu-tests/, h100-rows/act_step_ab.log);
#   s29:      the twenty-ninth session: the model GPU tests (the Llama CP = 2 chunks after the prompt and the
#             sliding-window ring under CP against transformers, decode graphs under CP with a window), the attention /
#             prefetch / gated GEMM GPU tests with every fast launch checked (the decode attention letting the next
#             kernel go, the gated plan made in a capture), then the decode step with and without
#             attention.DECODE_RELEASE (~10 minutes); s29b: the gemv / prefetch GPU tests, the decode rows, then the
#             W4A16 step with the quantized GEMVs' prefetch at 8 and 2 MB (pdl.GEMV_PREFETCH_MB) (~10 minutes: the
#             GPU tests compile for ~4 on a fresh machine; ran at ef07a3c);
#   s30:      decode attention with one and two warps a program at several programs a multiprocessor (the split
#             kernel alone at the bench's shapes and the model's 1K, then in the Llama-3.1-8B step), then the tiled
#             W4A16 GEMVs' configurations on this GPU (the defaults came from H100 sweeps) (126 s on an H100 at 0aedc40;
#             s29b's gemv GPU tests also run the tiled test whose in-kernel SiLU reference 9600fb7 fixed);
#   s31:      what the thirty-first session left unrun on a GPU: the model GPU tests (the ragged prompt on the per-row
#             path, generate's pad tokens), the varlen tests, the GPU rank tests of peer memory, CP attention
#             (cp_unshard differentiable) and the GPU collectives' reuse (the two-round rendezvous before MPI
#             calls) (s31 the model tests, ~6 minutes; s31r the rank tests, ~4; both passed on an H100 at 10ec46b);
#             s31b: step_bound.py on this GPU (the decode attention's and the norms' share of the step), then s30's
#             tiled W4A16 GEMV sweep (~6 minutes);
#   s32:      the tiled W4A16 GEMVs' new defaults (gemv_tc.TILED_SLICE_RULES: from two H100 sweeps of the chain) in the
#             W4A16 step, off against on at 1K and 8K, then the gemv and decode-graph GPU tests (~8 minutes);
#   s33:      the thirty-third session's changes on a GPU: nn.functional's dtype checks and the peer-memory
#             ranks (numpy ranks) in the GPU rank tests, the MPI_Init watchdog under the image's mpirun (~6 minutes);
#   s35, s35b, s36: the image's Open MPI: p2p buffers, finalize, re-made worlds, CLI / communicator tests, the agreed
#             MPI frees (~8 minutes each); s36b: the CLI / launch tests after s36's fixes and the CUDA collectives
#             whose inputs share memory with their outputs (two ranks sharing the GPU) (~4 minutes);
#             s38: every gemv / prefetch / decode-graph GPU test with gemv.CU_W4 on (~7 minutes: 71 passed in 369 s on
#             an H100 at 7244271); s38h: on an H200, the cu kernel's sweep, the W4A16 step's A/B of the switch (the
#             head quantized too), the decode rows, the GEMVs' PDL placement and L2 prefetch budget, gemv's host rows
#             (the tiles' among them) (~9 minutes); s39h: s38h's most wanted part in one call (~8 minutes): the switch's
#             A/B (H200 only), the decode rows, the cu kernel's GPU tests (the build-failure fallback), gemv's host
#             rows;
#             s39f: the norms folded into the cu GEMVs (gemv_norm.CU_FOLD): their GPU tests (the cu kernel's
#             among them), the W4A16 step's A/B, the decode rows (~8 minutes);
#             s37: the CUDA C++ W4A16 GEMV (gemv_cu, KERNEL="cu"): its GPU tests, the chain sweep against the kept
#             tensor-core kernel, the W4A16 step A/B of gemv.CU_W4 (~2-3 minutes: 109 and 134 s on an H100);
# Earlier sessions' one-off steps were removed (the fifteenth and twenty-third sessions); each result README names
# the commit whose script ran its step (`git show <commit>:benchmarks/scripts/h200_pending.sh`).
# Usage, from the repository root after `git rev-parse HEAD > .commit`:
#   OUT=/tmp/out bash benchmarks/scripts/h200_pending.sh \
#     host|tests|ranks|all|collectives|bench|training|rows|tiles|suite|slices|prefetch|abs|h200|window|qgemm|w4tiles|
#     w4check|windows|s26|s27|s28|s29|s29b|s30|s31|s31r|s31b|s32|s33|s35|s35b|s36|s36b|s37|s38|s38h|s39h|s39f|gated
STEPS="host|tests|ranks|all|collectives|bench|training|rows|tiles|suite|slices|prefetch|abs|h200|window|qgemm"
STEPS="$STEPS|w4tiles|w4check|windows|s26|s27|s28|s29|s29b|s30|s31|s31r|s31b|s32|s33|s35|s35b|s36|s36b|s37|s38"
STEPS="$STEPS|s38h|s39h|s39f|gated"
if ! [[ "$1" =~ ^($STEPS)$ ]]; then
  echo "usage: OUT=<dir> bash $0 $STEPS" >&2
  exit 2
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
OUT=${OUT:-out}; mkdir -p "$OUT"
C=$(cat .commit 2>/dev/null || git rev-parse HEAD)
GPU=$(nvidia-smi -L | head -1)
step() {  # step NAME LIMIT command...: output to $OUT/NAME.log, the exit status appended
  local name=$1 limit=$2; shift 2
  { echo "commit: $C, $(date -u), $GPU"; echo "\$ $*"; timeout "$limit" "$@"; echo "[exit $?]"; } \
    > "$OUT/$name.log" 2>&1
  tail -n 3 "$OUT/$name.log"
}
case "$1" in
host|all)
  step kernel_host_profile 120 python3 benchmarks/scripts/kernel_host_profile.py gemm attention gemv
  step dist_host_profile 150 env XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 benchmarks/scripts/dist_host_profile.py
  step bench_attention 110 python3 -m xelink.bench attention --quick --out "$OUT/bench" --commit "$C"
  step bench_gemv 150 python3 -m xelink.bench gemv --quick --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt  # the logs hold the tables; the device tool returns at most 8 files
  ;;
esac
case "$1" in
tests|all)  # (on an H100: 224 kernel tests in ~280 s; 289 since the twenty-ninth session)
  step kernels_gpu_tests 480 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu \
    tests/kernels
  ;;
esac
case "$1" in
ranks|all)  # (on an H100: symm, distributed GEMM and CP ~200 s, the models ~150 s)
  step gpu_rank_tests 260 python3 -m pytest -q -rfEs -p no:cacheprovider tests/symm/ranks_gpu_symm.py \
    tests/dist/ranks_gpu_dist_gemm.py tests/dist/ranks_gpu_cp_attention.py
  step model_gpu_tests 240 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/models
  ;;
collectives)  # (not timed on an H100 yet: the GPU collectives' tests last ran in full on H200s)
  step gpu_collective_tests 330 python3 -m pytest -q -rfEs -p no:cacheprovider tests/collectives/ranks_gpu_reuse.py \
    tests/collectives/ranks_gpu_uneven.py
  step gpu_collectives_shared 200 env XELINK_RANKS_PER_DEVICE=2 python3 -m pytest -q -rfEs -p no:cacheprovider \
    tests/collectives/ranks_gpu_collectives.py tests/nn/ranks_gpu_functional.py
  ;;
bench)
  step bench_dist_gemm 150 env XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 -m xelink.bench dist-gemm --quick \
    --shapes 8192 2048x4096x4096 --out "$OUT/bench" --commit "$C"
  step bench_cp_attention 120 env XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 -m xelink.bench cp-attention --quick \
    --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt
  ;;
training)
  step training_gpu_checks 150 timeout -s INT -k 10 140 env XELINK_TEST_CHECKS=gradients python3 -m pytest -q -rfE \
    -p no:cacheprovider tests/dist/ranks_gpu_cp_attention.py tests/dist/ranks_gpu_dist_gemm.py \
    tests/dist/ranks_gpu_training.py
  step symm_gpu_checks 100 env XELINK_TEST_CHECKS=receives_posted,stalled_receiver python3 -m pytest -q -rfE \
    -p no:cacheprovider tests/symm/ranks_gpu_symm.py
  step flash_bwd_gpu_tests 100 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfE -n 8 -p no:cacheprovider -m gpu \
    tests/kernels/test_autograd.py
  ;;
rows)
  step bench_decode 100 python3 -m xelink.bench decode --quick --model-only --no-transformers --contexts 1K 8K 32K \
    --out "$OUT/bench" --commit "$C"
  step rope_decode_ab 180 python3 benchmarks/scripts/rope_decode_ab.py
  step gated_tiles_bench 60 python3 benchmarks/scripts/gated_gemm_bench.py --quick --tiles
  step flash_bwd_ab 150 python3 benchmarks/scripts/flash_bwd_ab.py
  step flash_grad_profile 50 python3 benchmarks/scripts/flash_grad_profile.py 1024 4096
  rm -f "$OUT"/bench/*.txt
  ;;
tiles)
  step decode_tiles_ab 240 python3 benchmarks/scripts/decode_chunk_ab.py tiles
  ;;
suite)  # (on an H100: 97 s and 137 s)
  step suite_1rank 200 python3 -m xelink.bench all --quick --no-plots --out "$OUT/s1" --commit "$C"
  step suite_2ranks 280 env XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 -m xelink.bench all --quick --no-plots \
    --out "$OUT/s2" --commit "$C"
  rm -rf "$OUT/s1" "$OUT/s2"  # the logs hold the tables and the summary
  ;;
slices)
  step gated_gpu_tests 200 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 4 -m gpu \
    tests/kernels/test_gated_gemm.py tests/kernels/test_scatter_gemm.py
  step gated_bench 150 python3 benchmarks/scripts/gated_gemm_bench.py --jsonl "$OUT/gated.jsonl"
  step fused_gpu_checks 200 env XELINK_TEST_CHECKS=fused python3 -m pytest -q -rfEs -p no:cacheprovider \
    tests/dist/ranks_gpu_dist_gemm.py
  ;;
prefetch)  # (twentieth session's code; ~5 minutes)
  step prefetch_gpu_tests 150 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 4 -m gpu \
    tests/kernels/test_prefetch.py tests/models/test_decode_graph.py
  step next_prefetch_ab 330 python3 benchmarks/scripts/next_prefetch_ab.py
  ;;
h200)
  step bench_decode 130 python3 -m xelink.bench decode --quick --model-only --no-transformers --contexts 1K 8K 32K \
    --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt
  step gated_bench 150 python3 benchmarks/scripts/gated_gemm_bench.py --jsonl "$OUT/gated.jsonl"
  step gated_arrivals_ab 100 python3 benchmarks/scripts/gated_arrivals_ab.py 4 8
  ;;
gated)
  step gated_bench 150 python3 benchmarks/scripts/gated_gemm_bench.py --jsonl "$OUT/gated.jsonl"
  step gated_arrivals_ab 100 python3 benchmarks/scripts/gated_arrivals_ab.py 4 8
  step gated_chunks_ab 150 python3 benchmarks/scripts/gated_slices_ab.py --chunks
  ;;
qgemm)
  step qgemm_gpu_tests 200 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu \
    tests/kernels/test_qgemm.py tests/models/test_decode_graph.py
  step qgemm_rank_tests 200 env XELINK_RANKS_PER_DEVICE=2 XELINK_TEST_CHECKS=bf16_logits,decode_graph_under_tp \
    python3 -m pytest -q -rfEs -p no:cacheprovider tests/models/ranks_gpu_llama.py
  step qgemm_ab 280 python3 benchmarks/scripts/qgemm_ab.py
  ;;
w4tiles)  # in order of need, to fit one call
  step w4tiles_gpu_tests 320 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu \
    tests/kernels/test_gemv.py -k "tiled or tensor_core_kernel or act or graph or qgemm" tests/kernels/test_qgemm.py \
    tests/models/test_decode_graph.py
  step tiles_ab 150 python3 benchmarks/scripts/tiles_ab.py
  step gemv_tiled_sweep 80 python3 benchmarks/scripts/gemv_chain_sweep.py kept-w4a16 w4a16t
  step qgemm_tiles_ab 90 python3 benchmarks/scripts/qgemm_ab.py --fmts w4a16 w4a16t --rows 16 1024 --no-overrides
  step window_cp_gpu 60 env XELINK_TEST_CHECKS=sliding_window python3 -m pytest -q -rfEs -p no:cacheprovider \
    tests/models/ranks_gpu_llama.py
  ;;
w4check)  # the tiled format's own GPU tests with their failures' tracebacks, then the step's A/B
  step w4check_gpu_tests 240 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -n 5 \
    -m gpu tests/kernels/test_gemv.py tests/kernels/test_qgemm.py tests/models/test_decode_graph.py \
    -k "tiled or tiles or kernel_gpu"
  step tiles_ab 60 python3 benchmarks/scripts/tiles_ab.py
  ;;
s26)
  step cp_model_gpu_checks 150 env XELINK_TEST_CHECKS=cp2_bf16 python3 -m pytest -q -rfE --tb=short \
    -p no:cacheprovider tests/models/ranks_gpu_llama.py
  step s26_gpu_tests 240 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -n 4 -m gpu \
    tests/kernels/test_qgemm.py tests/kernels/test_attention_varlen.py
  step qgemm_host_profile 60 python3 benchmarks/scripts/kernel_host_profile.py qgemm
  ;;
s27)
  step act_gpu_tests 120 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -n 8 -m gpu \
    tests/kernels/test_gemv.py -k "tiled or act_silu_mul"
  step gemv_chain_sweep_w4a16t_act 60 python3 benchmarks/scripts/gemv_chain_sweep.py w4a16t-act
  [ -n "$NO_MORE" ] && exit 0
  step act_step_ab 110 python3 benchmarks/scripts/step_ab.py gemv.TC_ACT_FUSED=False,True --fmts w4a16 --contexts 1024
  step cp_varlen_gpu_checks 100 env XELINK_TEST_CHECKS=varlen python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
    tests/dist/ranks_gpu_cp_attention.py
  ;;
s28)
  step cp_model_gpu_checks 240 env XELINK_TEST_CHECKS=cp2_bf16,decode_graph_under_tp python3 -m pytest -q -rfE \
    --tb=short -p no:cacheprovider tests/models/ranks_gpu_llama.py
  step cp_varlen_gpu_checks 120 env XELINK_TEST_CHECKS=varlen python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
    tests/dist/ranks_gpu_cp_attention.py
  step bench_decode_cp 120 env XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 -m xelink.bench decode --quick \
    --parallel-only --model llama-3.2-1b --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt
  [ -n "$NO_MORE" ] && exit 0
  step act_step_ab 150 python3 benchmarks/scripts/step_ab.py gemv.TC_ACT_FUSED=False,True --fmts w4a16 --contexts 1024
  ;;
s29)
  step model_gpu_tests 240 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/models
  step kernel_gpu_tests 150 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu \
    tests/kernels/test_attention.py tests/kernels/test_prefetch.py tests/kernels/test_gated_gemm.py
  step release_ab 190 python3 benchmarks/scripts/step_ab.py attention.DECODE_RELEASE=False,True --fmts bf16 w4a16 \
    --contexts 1024 8192 32768
  ;;
s29b)
  step gemv_gpu_tests 400 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu \
    tests/kernels/test_gemv.py tests/kernels/test_prefetch.py
  step bench_decode 150 python3 -m xelink.bench decode --quick --model-only --no-transformers --contexts 1K 8K 32K \
    --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt
  step gemv_prefetch_ab 90 python3 benchmarks/scripts/step_ab.py pdl.GEMV_PREFETCH_MB=8,2 --fmts w4a16 --contexts 1024
  ;;
s31)
  step s31_model_gpu_tests 420 python3 -m pytest -q -rfEs -p no:cacheprovider -n 4 -m gpu tests/models \
    tests/kernels/test_attention_varlen.py
  ;;
s31r)
  step s31_rank_gpu_tests 260 python3 -m pytest -q -rfEs -p no:cacheprovider tests/symm/ranks_gpu_symm.py \
    tests/dist/ranks_gpu_cp_attention.py tests/collectives/ranks_gpu_reuse.py
  ;;
s31b)
  step step_bound 120 python3 benchmarks/scripts/step_bound.py --contexts 1024
  step gemv_tiled_sweep 230 python3 benchmarks/scripts/gemv_chain_sweep.py w4a16t
  ;;
s32)
  step tiled_rules_ab 200 python3 benchmarks/scripts/step_ab.py gemv_tc.TILED_SLICE_RULES=False,True --fmts w4a16 \
    --contexts 1024 8192
  step tiled_rules_gpu_tests 300 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu \
    tests/kernels/test_gemv.py tests/models/test_decode_graph.py
  ;;
s33)
  step s33_rank_gpu_tests 330 python3 -m pytest -q -rfEs -p no:cacheprovider tests/nn/ranks_gpu_functional.py \
    tests/symm/ranks_gpu_symm.py tests/ranks_comm.py
  step s33_runtime_tests 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_runtime.py -k "init or abort"
  ;;
s35)  # the p2p buffers kept until MPI is done and finalize's agreement, under the image's Open MPI
  step s35_runtime_tests 170 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_runtime.py -k "finalize or init or abort"
  step s35_p2p_checks 200 env XELINK_TEST_CHECKS=outlive_dropped,point_to_point,leaves_no_message \
    python3 -m pytest -q -rfEs -p no:cacheprovider tests/collectives/ranks_collectives.py
  step s35_rank_gpu_tests 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/symm/ranks_gpu_symm.py \
    tests/collectives/ranks_gpu_reuse.py
  ;;
s35b)  # after the fixes: a timed-out world made again (Open MPI), the GEMMs whose Triton imports moved
  step s35_runtime_tests 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_runtime.py -k "finalize or init or abort"
  step s35_gemm_gpu_tests 200 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 8 -m gpu \
    tests/kernels/test_gated_gemm.py tests/kernels/test_scatter_gemm.py
  step s35_dist_gemm_rank_tests 240 python3 -m pytest -q -rfEs -p no:cacheprovider tests/dist/ranks_gpu_dist_gemm.py
  ;;
s36)  # the thirty-sixth session: MPI communicators freed only on the members' agreement, under the image's Open MPI;
  # s35b's CLI / launch failures (environment, fixed at 3ad4749) run again
  step s36_cli_comm_tests 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_without_triton.py tests/test_cli.py \
    tests/test_launch_scripts.py tests/ranks_comm.py
  step s36_reuse_training_checks 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/collectives/ranks_reuse.py \
    tests/dist/ranks_training.py
  step s36_rank_gpu_tests 180 python3 -m pytest -q -rfEs -p no:cacheprovider tests/symm/ranks_gpu_symm.py \
    tests/collectives/ranks_gpu_reuse.py
  ;;
s37)  # the CUDA C++ W4A16 GEMV: the sweep (every output checked against the kept kernel's), the kernel and model
  # tests, the step's A/B
  step s37_cu_chain_sweep 170 python3 benchmarks/scripts/gemv_chain_sweep.py cu-w4a16t cu-w4a16t-act
  step s37_cu_gpu_tests 200 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu \
    tests/kernels/test_gemv.py tests/models/test_decode_graph.py -k "cu_w4 or w4a16_weights_in_tiles"
  step s37_cu_step_ab 180 python3 benchmarks/scripts/step_ab.py gemv.CU_W4=False,True --fmts w4a16 --contexts 1024
  ;;
s38)  # what the switch to the CUDA C++ W4A16 GEMV (gemv.CU_W4, on since 3f91722) left unrun: every gemv, prefetch and
  # decode-graph GPU test with each fast launch checked (the full kernel grid among them)
  step s38_gemv_gpu_tests 420 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 14 -m gpu \
    tests/kernels/test_gemv.py tests/kernels/test_prefetch.py tests/models/test_decode_graph.py
  ;;
s38h)  # on an H200 (issue 26's machine): the cu kernel's sweep, the W4A16 step's A/B of gemv.CU_W4 (the head in bf16 and
  # quantized) (both ran on an H100 at 7244271: skipped there); then on any GPU the decode rows and the rest
  if [[ "$GPU" == *H200* ]]; then
    step s38_cu_chain_sweep 200 python3 benchmarks/scripts/gemv_chain_sweep.py cu-w4a16t cu-w4a16t-act
    step s38_cu_step_ab 150 python3 benchmarks/scripts/step_ab.py gemv.CU_W4=False,True --fmts w4a16 w4a16+head \
      --contexts 1024
  fi
  step s38_bench_decode 150 python3 -m xelink.bench decode --quick --model-only --no-transformers --contexts 1K 8K 32K \
    --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt
  # the GEMVs' PDL placement and L2 prefetch budget were set with the tensor-core kernel: again with the cu kernel
  step s38_pdl_rows_ab 90 python3 benchmarks/scripts/step_ab.py gemv.PDL_EARLY_MAX_ROWS=8192,0,65536 --fmts w4a16+head \
    --contexts 1024
  step s38_prefetch_ab 90 python3 benchmarks/scripts/step_ab.py pdl.GEMV_PREFETCH_MB=2,0,8 --fmts w4a16+head \
    --contexts 1024
  step s38_gemv_host_rows 90 python3 benchmarks/scripts/host_rows.py gemv  # (the cu launch's eager host time)
  ;;
s39h)  # s38h's most wanted steps in one call's limit: the W4A16 step with the cu kernel on an H200, the rows, the
  # cu kernel's GPU tests (the NVRTC-failure fallback, never run on a GPU) and gemv's host rows
  if [[ "$GPU" == *H200* ]]; then
    step s39_cu_step_ab 150 python3 benchmarks/scripts/step_ab.py gemv.CU_W4=False,True --fmts w4a16 w4a16+head \
      --contexts 1024
  fi
  step s39_bench_decode 150 python3 -m xelink.bench decode --quick --model-only --no-transformers --contexts 1K 8K 32K \
    --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt
  step s39_cu_gpu_tests 120 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu \
    tests/kernels/test_gemv.py -k "cu_w4"
  step s39_gemv_host_rows 80 python3 benchmarks/scripts/host_rows.py gemv
  ;;
s39f)  # the RMSNorms folded into the cu GEMVs (gemv_residual, gemv_rms; gemv_norm.CU_FOLD): the GPU tests of the
  # fold and of the cu kernel (its build-failure fallback among them), after the W4A16 step's A/B; then the decode rows
  step s39_fold_step_ab 150 python3 benchmarks/scripts/step_ab.py gemv_norm.CU_FOLD=False,True --fmts w4a16 w4a16+head \
    --contexts 1024
  step s39_fold_gpu_tests 200 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 8 -m gpu \
    tests/kernels/test_gemv_norm.py tests/models/test_decode_graph.py tests/kernels/test_gemv.py \
    -k "folded or w4a16_weights_in_tiles or cu_w4"
  [ -n "$NO_ROWS" ] && exit 0  # (NO_ROWS=1: the tests and the A/B only)
  step s39_bench_decode 180 python3 -m xelink.bench decode --quick --model-only --no-transformers --contexts 1K 8K 32K \
    --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt
  ;;
s36b)  # s36's two failures after their fixes (xelink-run --devices cpu on a GPU host, the usage error under Open MPI);
  # the GPU collectives with inputs that share memory with their outputs (two ranks sharing the GPU)
  step s36b_cli_launch_tests 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_cli.py tests/test_launch_scripts.py
  step s36b_gpu_shared_memory_checks 200 env XELINK_RANKS_PER_DEVICE=2 XELINK_TEST_CHECKS=share_memory,rooted_ops \
    python3 -m pytest -q -rfEs -p no:cacheprovider tests/collectives/ranks_gpu_collectives.py
  ;;
s30)
  step decode_warps_ab 150 python3 benchmarks/scripts/decode_chunk_ab.py warps
  step decode_warps_step 170 python3 benchmarks/scripts/decode_chunk_ab.py step
  step gemv_tiled_sweep 230 python3 benchmarks/scripts/gemv_chain_sweep.py w4a16t
  ;;
windows)
  step window_bwd_gpu_tests 200 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -n 8 \
    -m gpu tests/kernels/test_attention_window.py tests/kernels/test_autograd.py
  step window_cp_gpu_checks 240 env XELINK_TEST_CHECKS=window python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
    tests/dist/ranks_gpu_cp_attention.py tests/models/ranks_gpu_llama.py
  ;;
window)
  step window_gpu_tests 330 env XELINK_LAUNCH_CHECK=1 python3 -m pytest -q -rfEs -p no:cacheprovider -n 12 -m gpu \
    tests/kernels/test_attention_window.py tests/kernels/test_attention.py tests/kernels/test_prefetch.py \
    tests/models/test_decode_graph.py
  step window_ab 120 python3 benchmarks/scripts/window_ab.py
  [ -n "$NO_ROWS" ] && exit 0  # (NO_ROWS=1: the kernels the step runs did not change)
  step bench_decode 100 python3 -m xelink.bench decode --quick --model-only --no-transformers --contexts 1K 8K 32K \
    --out "$OUT/bench" --commit "$C"
  rm -f "$OUT"/bench/*.txt
  ;;
esac
case "$1" in
abs|h200)  # (twenty-first session: next_prefetch_ab, prefetch_ab, rope_decode_ab moved onto step_ab.py)
  step step_ab 60 python3 benchmarks/scripts/step_ab.py attention.NEXT_MIN_KEYS=4096,0 --fmts bf16 --contexts 8192
  step next_prefetch_ab 150 python3 benchmarks/scripts/next_prefetch_ab.py
  step prefetch_ab 150 python3 benchmarks/scripts/prefetch_ab.py
  step rope_decode_ab 200 python3 benchmarks/scripts/rope_decode_ab.py
  ;;
esac
