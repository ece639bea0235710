#!/usr/bin/env bash
# The whole suite on a 2-GPU host (issue 9) and the probe + model check on its links (issue 3), in one command.
# Run from the repository root on the GPU machine:
#     OUT=/tmp/out bash benchmarks/scripts/h200_suite.sh            # full: under 7 minutes
#     OUT=/tmp/out bash benchmarks/scripts/h200_suite.sh --smoke    # same steps, smallest sizes: under 4 minutes
#                                                           # (or SMOKE=1)
# Steps, in order, each under `timeout` (a hang costs its cap, not the run); a failing step is logged and
# the next one runs:
#   env        versions, nvidia-smi -L / topo -m, the commit (.commit)            -> env.log
#   ipc-one    benchmarks/scripts/h200_ipc_check.py through xelink-run (one GPU visible per rank)   -> ipc-one.log
#   ipc-all    the same with every GPU visible (xelink-run --visible all)         -> ipc-all.log
#   discover   xelink topology --discover --save (NVML or nvidia-smi, logged)     -> discover.log, discovered.toml
#   suite      xelink bench all --quick --tune h200.tuning.json --out suite/ (2 ranks through xelink-run,
#              with the binding the IPC checks found to work)                   -> suite.log, suite/, h200.tuning.json
#   model      xelink bench model-check: probe of the GPU links by xelink (copy engine through CUDA IPC, GPU
#              barriers, local copy/add), then measured vs predicted GPU collectives -> model-check.log,
#              model_check.jsonl, probe.json, calibration.toml, topology.toml (smoke: the suite's calibration)
# Everything lands in $OUT; summary.txt lists each step's exit status and seconds (124 = hit its time cap).
set -u
SMOKE=${SMOKE:-0}
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export XELINK_TIMEOUT=${XELINK_TIMEOUT:-120}  # a stuck collective raises (naming the ranks) within the step's cap
PY=$(command -v python3)
COMMIT=$(cat .commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
# The suite's ranks compile Triton kernels in worker processes: no pinning of a rank to one core.
RUN=("$PY" launch_scripts/xelink-run --cpu-bind none -n 2)
if [ "$SMOKE" = 1 ]; then
  CAP_IPC=35 CAP_DISCOVER=20 CAP_SUITE=120 CAP_MODEL=45 BUDGET=225
  MODEL_ARGS=(--sizes 4K 1M 16M --check-iters 5 --check-rounds 2)
else
  CAP_IPC=45 CAP_DISCOVER=30 CAP_SUITE=210 CAP_MODEL=90 BUDGET=400
  MODEL_ARGS=(--sizes 4K 64K 1M 16M 64M 256M --check-iters 10 --check-rounds 3)
fi
START=$(date +%s)
SUMMARY=()

# step NAME CAP LOG CMD...: run CMD under `timeout CAP` (less if the budget is nearly spent), log to $OUT/LOG.
step() {
  local name=$1 cap=$2 file=$3 log=$OUT/$3; shift 3
  local left=$((BUDGET - ($(date +%s) - START)))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 5 ]; then
    SUMMARY+=("$(printf '%-9s skipped: the time budget (%s s) is spent' "$name" "$BUDGET")")
    echo "[$name skipped: budget spent]" | tee -a "$log"; return 99
  fi
  echo "== $name (cap ${cap}s): $*" | tee -a "$OUT/run.log"
  local t0=$(date +%s) rc
  { echo "commit: $COMMIT"; echo "\$ timeout $cap $*"; } >> "$log"
  timeout -k 5 "$cap" "$@" >> "$log" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t0))
  echo "[exit $rc after ${dt}s]" >> "$log"
  SUMMARY+=("$(printf '%-9s exit %-3s %4ss  %s' "$name" "$rc" "$dt" "$file")")
  echo "   exit $rc after ${dt}s" | tee -a "$OUT/run.log"
  return $rc
}

env_report() {
  echo "commit: $COMMIT   smoke: $SMOKE   date: $(date -u)"
  nvidia-smi -L; nvidia-smi topo -m
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|CUDA_VISIBLE_DEVICES)=' || true
  "$PY" - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
for name in ("triton", "mpi4py", "pynvml"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "installed"))
    except ImportError as e:
        print(name, "missing:", e)
from mpi4py import MPI
print(MPI.Get_library_version().splitlines()[0].strip("\x00 "))
EOF
  mpirun --version | head -n 1
}
export -f env_report; export PY COMMIT SMOKE
step env 30 env.log bash -c env_report
cat "$OUT/env.log"

# CUDA IPC under each binding (item: does cuIpcOpenMemHandle work when each rank sees only its GPU?).
step ipc-one "$CAP_IPC" ipc-one.log "${RUN[@]}" "$PY" benchmarks/scripts/h200_ipc_check.py; ONE=$?
step ipc-all "$CAP_IPC" ipc-all.log "${RUN[@]}" --visible all "$PY" benchmarks/scripts/h200_ipc_check.py; ALL=$?
if [ "$ONE" = 0 ]; then VISIBLE=one; elif [ "$ALL" = 0 ]; then VISIBLE=all; else VISIBLE=all; fi
echo "binding for the next steps: --visible $VISIBLE (ipc-one exit $ONE, ipc-all exit $ALL)" | tee -a "$OUT/run.log"
RUNV=("${RUN[@]}" --visible "$VISIBLE")

step discover "$CAP_DISCOVER" discover.log env XELINK_LOG=info "${RUNV[@]}" "$PY" -m xelink topology --discover \
  --save "$OUT/discovered.toml"

rm -f "$OUT/h200.tuning.json"
step suite "$CAP_SUITE" suite.log "${RUNV[@]}" "$PY" -m xelink bench all --quick --csv \
  --tune "$OUT/h200.tuning.json" --out "$OUT/suite"

MODEL=(--jsonl "$OUT/model_check.jsonl" --ops all_reduce all_gather "${MODEL_ARGS[@]}")
if [ "$SMOKE" = 1 ] && [ -f "$OUT/suite/calibration.toml" ] && [ -f "$OUT/suite/topology.toml" ]; then
  MODEL+=(--calibration "$OUT/suite/calibration.toml" --topology "$OUT/suite/topology.toml")
else
  [ "$SMOKE" = 1 ] && MODEL+=(--quick)
  MODEL+=(--probe-json "$OUT/probe.json" --calibration-out "$OUT/calibration.toml" --topology-out "$OUT/topology.toml")
fi
step model "$CAP_MODEL" model-check.log "${RUNV[@]}" "$PY" -m xelink bench model-check "${MODEL[@]}"

{
  echo "h200_suite.sh$([ "$SMOKE" = 1 ] && echo ' --smoke') on commit $COMMIT: $(($(date +%s) - START)) s in all" \
       "(budget $BUDGET s); binding --visible $VISIBLE"
  printf '%s\n' "${SUMMARY[@]}"
  echo; echo "IPC checks:"; grep -h "IPC-CHECK\|peer memory\|Error" "$OUT/ipc-one.log" "$OUT/ipc-all.log" | head -n 8
  echo; echo "suite:"; cat "$OUT/suite/summary.txt" 2>/dev/null || tail -n 15 "$OUT/suite.log"
  echo; echo "model check:"; grep -h "^summary:\|link .*GB/s\|baseline NCCL" "$OUT/model-check.log" | head -n 8
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
