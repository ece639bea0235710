"""Where the host time of one eager distributed GEMM call goes: rank 0's cProfile of back-to-back calls
of each algorithm, and the unprofiled host time per call (no synchronization inside the timed loop).

XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 benchmarks/scripts/dist_host_profile.py
"""
import cProfile
import pstats
import time

import torch

import xelink

world = xelink.init()
n = world.size
M, N, K = 2048, 4096, 4096
a = torch.randn(M // n, K, dtype=torch.bfloat16, device=world.device)
b = torch.randn(K, N, dtype=torch.bfloat16, device=world.device)
ar = torch.randn(M, K, dtype=torch.bfloat16, device=world.device)
calls = {f"all_gather_matmul {algo}": (lambda algo=algo: xelink.all_gather_matmul(a, b, algo=algo))
         for algo in ("sequential", "pipelined", "topo")}
calls["matmul_reduce_scatter pipelined"] = lambda: xelink.matmul_reduce_scatter(ar, b, algo="pipelined")
for name, fn in calls.items():
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    world.barrier()
    t = time.perf_counter()
    for _ in range(20):
        fn()
    plain = (time.perf_counter() - t) / 20 * 1e6
    torch.cuda.synchronize()
    world.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    world.barrier()
    if world.rank == 0:
        print(f"== {name}: {plain:.1f} us host time per call (unprofiled, {n} ranks)", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    world.barrier()
xelink.finalize()
