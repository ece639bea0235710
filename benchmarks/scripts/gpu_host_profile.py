"""Where the host time of one eager GPU collective goes (cProfile of rank 0), one rank per GPU.

mpirun -n 2 python3 benchmarks/scripts/gpu_host_profile.py
"""
import cProfile
import pstats
import time

import torch

import xelink

world = xelink.init()
x = torch.ones(16384, dtype=torch.bfloat16, device=world.device)
for algo in ("direct", "nccl"):
    for _ in range(20):
        xelink.all_reduce(x, op="avg", algo=algo)
    torch.cuda.synchronize()
    world.barrier()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(500):
        xelink.all_reduce(x, op="avg", algo=algo)
    prof.disable()
    dt = (time.perf_counter() - t) / 500 * 1e6
    torch.cuda.synchronize()
    if world.rank == 0:
        print(f"== algo={algo}: {dt:.1f} us per call under the profiler")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    world.barrier()
t = time.perf_counter()
for _ in range(500):
    torch.cuda.current_stream()
if world.rank == 0:
    print(f"torch.cuda.current_stream(): {(time.perf_counter() - t) / 500 * 1e6:.2f} us")
xelink.finalize()
