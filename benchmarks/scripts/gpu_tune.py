"""Kernel configurations of the GPU collectives, side by side (grid size, tile, warps), one rank per GPU.

mpirun -n 2 python3 benchmarks/scripts/gpu_tune.py   — prints one line per (config, case): µs per op (max over ranks).
"""
import os
import sys

import torch

import xelink
from xelink.collectives.gpu import launch

CONFIGS = [(int(b), int(t), int(w)) for b, t, w in (c.split("/") for c in
           (sys.argv[1:] or ["132/4096/8", "132/2048/4", "264/4096/8"]))]


def timed(world, fn, reps, graph):
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run, per = g.replay, reps
    else:
        run, per = (lambda: [fn() for _ in range(reps)]), reps
    best = []
    for _ in range(5):
        torch.cuda.synchronize()
        world.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        best.append(max(world.allgather_object(a.elapsed_time(b) * 1e3 / per)))
    return sorted(best)[2]


world = xelink.init()
dev = torch.device(world.device)
for blocks, tile, warps in CONFIGS:
    os.environ["XELINK_GPU_BLOCKS"] = str(blocks)
    launch.BLOCK[2] = tile
    launch.NUM_WARPS = warps
    comm = world.split(0)
    res = []
    for nbytes in (32 << 10, 256 << 10, 1 << 20):
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
        res.append((f"direct/user {nbytes >> 10}K graph", timed(comm, lambda: xelink.all_reduce(x, op="avg", group=comm, algo="direct"), 20, True)))
    s = xelink.empty(8 << 20, dtype=torch.bfloat16, group=comm)
    s.fill_(1)
    res.append(("two_shot/symm 16M graph", timed(comm, lambda: xelink.all_reduce(s, op="avg", group=comm, algo="two_shot"), 20, True)))
    u = torch.ones(8 << 20, dtype=torch.bfloat16, device=dev)
    res.append(("direct/user 16M graph", timed(comm, lambda: xelink.all_reduce(u, op="avg", group=comm, algo="direct"), 20, True)))
    big = xelink.empty(128 << 20, dtype=torch.bfloat16, group=comm)
    big.fill_(1)
    t = timed(comm, lambda: xelink.all_reduce(big, op="avg", group=comm, algo="two_shot"), 5, False)
    res.append((f"two_shot/symm 256M eager (busbw {2 * (256 << 20) / 2 / t / 1e3:.0f} GB/s)", t))
    shard = xelink.empty(128 << 20, dtype=torch.bfloat16, group=comm)
    shard.fill_(1)
    out = torch.empty(256 << 20, dtype=torch.bfloat16, device=dev)
    for algo in ("direct", "copy_engine"):
        t = timed(comm, lambda: xelink.all_gather_into_tensor(out, shard, group=comm, algo=algo), 5, False)
        res.append((f"all_gather {algo}/symm 512M eager (busbw {(256 << 20) / t / 1e3:.0f} GB/s)", t))
    if world.rank == 0:
        for name, t in res:
            print(f"{blocks}/{tile}/{warps}  {name:55s} {t:9.2f} us", flush=True)
    s = u = big = shard = out = None
    comm.free()
    torch.cuda.empty_cache()
xelink.finalize()
