#!/bin/bash
# Example PBS Pro / OpenPBS job: the xelink benchmark suite on 2 nodes, 4 ranks (and 4 GPUs) per node.
# Submit from the repository root: qsub launch_scripts/pbs.sh
# Adjust select / ncpus / ngpus / mpiprocs to the machine; CPU-only nodes: drop ngpus.
#PBS -N xelink-bench
#PBS -l select=2:ncpus=32:ngpus=4:mpiprocs=4
#PBS -l walltime=01:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

# $PBS_NODEFILE lists each node once per MPI process (mpiprocs), so its length is the rank count.
nranks=$(wc -l < "$PBS_NODEFILE")
# One rank per GPU: xelink-run binds local rank r to GPU r (CUDA_VISIBLE_DEVICES; for Intel GPUs pass
# --devices xpu --devices-per-node 4, which sets ZE_AFFINITY_MASK / ONEAPI_DEVICE_SELECTOR) and keeps
# NVLink multicast off.
launch_scripts/xelink-run -n "$nranks" --ppn 4 --hostfile "$PBS_NODEFILE" \
    .venv/bin/xelink bench all --out "xelink-results/pbs-${PBS_JOBID%%.*}"
