"""Issue 20's host-time rows of every kernel family in one short run (the families' own ``run_host``, the
kernel-time rows left out): gemm (with the fused distributed GEMM's kernels), gemv, rmsnorm/rope and the
attention kernels, each against torch's equivalent in the same run, on one GPU.

python3 benchmarks/scripts/host_rows.py [gemm] [gemv] [norm] [attention]   (default: all; 15 rounds)
"""
import sys

import torch

from xelink.bench.families import attention, gemm, gemv, norm
from xelink.bench.kernel_timing import KernelReport, host_summary


def main():
    want, rounds = sys.argv[1:] or ["gemm", "gemv", "norm", "attention"], 15
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, f"rounds {rounds}", flush=True)
    impls = ("cuda", "triton") if torch.cuda.get_device_capability()[0] == 9 else ("triton",)
    for name, run in (("gemm", gemm.run_host), ("gemv", gemv.run_host), ("norm", norm.run_host)):
        if name in want:
            report = KernelReport()
            run(report, rounds=rounds)
            print(f"-- {name}\n{host_summary(report.rows)}", flush=True)
    if "attention" in want:
        print(f"-- attention\n{host_summary(attention.run_host(impls, rounds=rounds))}", flush=True)


if __name__ == "__main__":
    main()
