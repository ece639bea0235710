"""One W4A16 / bf16 GEMV of a Llama-3.1-8B projection shape, called a few times, for a profiler (ncu) to read
its counters: where the kernel's time goes (issue 26: the W4A16 kernels read their weights at 1.4-2.7 TB/s).

ncu --clock-control none --launch-skip 4 --launch-count 1 -k regex:gemv --section SpeedOfLight \\
    --section WarpStateStats --section Occupancy python3 benchmarks/scripts/gemv_profile.py w4a16 gate_up
"""
import sys

import torch

from xelink.kernels import gemv
from xelink.kernels.gemv import pack_w4a16

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main():
    fmt, name = sys.argv[1], sys.argv[2]
    n, k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w, s = (w.to(torch.bfloat16), None) if fmt == "bf16" else pack_w4a16(w, torch.bfloat16)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    for _ in range(6):
        y = gemv(w, x, s, fmt, "cuda")
    torch.cuda.synchronize()
    print(fmt, name, tuple(y.shape), float(y.float().norm()))


if __name__ == "__main__":
    main()
