#!/usr/bin/env bash
# Launch, device binding, the torch.distributed bridge (NCCL) and topology discovery on a GPU host.
# Run from the repository root on the GPU machine; logs go to $OUT (default: ./out).
# Usage: OUT=/tmp/out bash benchmarks/scripts/h200_foundation.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=$(command -v python3)
if mpirun --version 2>&1 | grep -qi "open mpi\|openrte\|prrte"; then
  MPIRUN="mpirun --allow-run-as-root --oversubscribe"
else
  MPIRUN="mpirun"
fi
run() { echo; echo "\$ $*"; "$@"; echo "[exit $?]"; }
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || cat .commit 2>/dev/null || echo unknown)"
  date -u
  run nvidia-smi -L
  run nvidia-smi topo -m
  run $PY -c "import torch, mpi4py, triton; from mpi4py import MPI; print('torch', torch.__version__, 'cuda', torch.cuda.device_count(), 'mpi4py', mpi4py.__version__, MPI.Get_library_version().splitlines()[0], 'triton', triton.__version__)"
  run mpirun --version
  run $MPIRUN -n 2 $PY -m xelink info
  run $MPIRUN -n 2 $PY -m xelink demo -n 5
  echo "# expected to fail: 3 ranks on a host with 2 GPUs"
  run $MPIRUN -n 3 $PY -m xelink info
  echo "# 4 ranks on 2 GPUs when sharing is asked for"
  run env XELINK_RANKS_PER_DEVICE=2 $MPIRUN -n 4 $PY -m xelink info
  run $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m xelink demo -n 5
  run $MPIRUN -n 2 $PY -m xelink topology --discover --save "$OUT/h200x2-discovered.toml"
} 2>&1 | tee "$OUT/h200_foundation.log"
