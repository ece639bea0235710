"""CPU ranks: every all-reduce algorithm at a few sizes, interleaved rounds (the best of 3), and what ``algo="auto"``
picks there, on this host as launched (oversubscribed or not: ``cost.oversubscribed``'s fit).

mpiexec -n 4 python benchmarks/scripts/cpu_all_reduce_algos.py [SIZE ...]     (sizes in bytes; default 256 KiB-16 MiB)
"""
import sys
import time

import torch

import xelink
from xelink import cost
from xelink.collectives import dispatch

ALGOS = ("direct", "two_shot", "ring")


def main():
    world = xelink.init()
    sizes = [int(s) for s in sys.argv[1:]] or [1 << 18, 1 << 20, 1 << 22, 1 << 24]
    if world.rank == 0:
        print(f"{world.size} ranks, {cost.active_oversubscription():g} ranks per core; us a call", flush=True)
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        best = {}
        for _ in range(3):
            for algo in ALGOS:
                xelink.all_reduce(x, algo=algo)
                xelink.barrier()
                iters = max(3, min(50, (8 << 20) // nbytes * 3))
                t = time.perf_counter()
                for _ in range(iters):
                    xelink.all_reduce(x, algo=algo)
                xelink.barrier()
                us = (time.perf_counter() - t) / iters * 1e6
                best[algo] = min(best.get(algo, us), us)
        if world.rank == 0:
            auto = dispatch.choose(world, "all_reduce", nbytes, torch.float32)
            fastest = min(best, key=best.get)
            print(f"{nbytes:>9} B " + " ".join(f"{a} {best[a]:9.1f}" for a in ALGOS)
                  + f"  auto: {auto} ({best[auto] / best[fastest]:.2f}x the fastest, {fastest})", flush=True)
    xelink.finalize()


if __name__ == "__main__":
    main()
