"""The distributed GEMM's host-time rows (issue 21) in one short run, two ways of calling: as the dist-gemm
family does (``kernel_timing.host_timing``: each call's output kept until the next one returns, so the output
address alternates between two) and discarding every output at once (one address); each round's time per
call of every variant (the slowest rank's) and how many calls replayed a remembered schedule.

XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 benchmarks/scripts/dist_host_rows.py [MxNxK, default 8192^3]
"""
import statistics
import sys

import torch

import xelink
from xelink.bench.kernel_timing import host_timing

world = xelink.init()
n, r, dev = world.size, world.rank, world.device
M, N, K = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8192x8192x8192").split("x"))
a = torch.randn(M // n, K, dtype=torch.bfloat16, device=dev)
ar = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
b = torch.randn(K, N, dtype=torch.bfloat16, device=dev)


def replays():
    gs = world.resource(("xelink.dist", "graphs", str(torch.device(dev))))
    return 0 if gs is None else gs.replays


def discard(fn):
    def call():
        fn()
    return call


variants = {"torch:matmul": lambda: torch.matmul(a, b)}
for algo in ("pipelined", "topo", "fused"):
    variants[f"all_gather_matmul {algo}"] = lambda algo=algo: xelink.all_gather_matmul(a, b, algo=algo)
    variants[f"matmul_reduce_scatter {algo}"] = lambda algo=algo: xelink.matmul_reduce_scatter(ar, b, algo=algo)
for name in [k for k in variants if k != "torch:matmul"]:
    variants[f"{name}, output discarded"] = discard(variants[name])
if r == 0:
    print(f"{n} ranks on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {M}x{N}x{K} bf16", flush=True)
before = replays()
samples, _ = host_timing(variants, {k: (lambda out: 0) for k in variants}, calls=20, rounds=7,
                         agree=lambda busy: all(world.allgather_object(busy)))
done = replays() - before
every = world.allgather_object(samples)
if r == 0:
    for name in variants:
        rounds = [max(s[name][i] for s in every) * 1e6 for i in range(len(samples[name]))]
        print(f"{name:55s} median {statistics.median(rounds):8.2f} us   rounds " +
              " ".join(f"{x:.0f}" for x in rounds), flush=True)
    print(f"calls that replayed a remembered schedule on rank 0: {done}", flush=True)
xelink.finalize()
