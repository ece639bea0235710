"""Profile chosen GEMV configs with Nsight Compute (hardware counters; the Firecracker GPU machines).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats python3 benchmarks/scripts/gemv_ncu.py > ncu.txt

Each config is compiled and warmed outside the profiled range, then launched once inside it
(cudaProfilerStart/Stop), on 128256 x 4096 weights (M = 1 and 8). ``python3 benchmarks/scripts/gemv_ncu.py tc``
profiles the tensor-core kernel's variants instead of the defaults.
"""
import sys

import torch

from xelink.kernels.gemv import gemv, pack_w4a16, pack_w8a16

N, K = 128256, 4096
CASES = [
    ("bf16", 1, None),
    ("w8a16", 1, None),
    ("w4a16", 1, None),
    ("w4a16", 1, dict(KERNEL="fma4", BLOCK_N=32, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=1)),
    ("w8a16", 8, None),
    ("w4a16", 8, None),
]
TC_CASES = [
    ("w4a16", 8, dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=1)),
    ("w4a16", 8, dict(KERNEL="tc", ROW_TILES=2, num_warps=4, UNROLL=2)),
    ("w4a16", 1, dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=1)),
    ("w4a16", 1, None),
    ("w8a16", 8, dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=1)),
    ("bf16", 8, dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=1)),
]


def main():
    cases = TC_CASES if sys.argv[1:] == ["tc"] else CASES
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
    packs = {"bf16": (w, None), "w8a16": pack_w8a16(w), "w4a16": pack_w4a16(w)}
    calls = []
    for fmt, m, cfg in cases:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        wq, s = packs[fmt]
        calls.append(lambda wq=wq, x=x, s=s, fmt=fmt, cfg=cfg: gemv(wq, x, s, fmt, "cuda", config=cfg))
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for fmt, m, cfg in cases:
        print(f"case: {fmt} M={m} config={cfg or 'default'}")


if __name__ == "__main__":
    main()
