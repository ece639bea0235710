"""Where the host time of an eager distributed GEMM call goes, on 2 ranks sharing one GPU (issue 21's
breakdown). First each piece the CUDA schedules are made of, in a loop of back-to-back calls (median of
rounds, the slowest rank's, the GPU kept busy so that no call waits for the device); then the whole calls, and for each the
time spent inside every function ``xelink.dist.device`` calls (each wrapped by a timer for that run; the
rest is the schedule's own Python and its inline torch calls: copies, events, stream waits): first with
every call enqueuing its schedule (``XELINK_DIST_GRAPHS=0``), then as a user calls it (the same tensors
again: replays of the remembered schedule), then with a new output tensor every call. Rank 0 prints.

XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 benchmarks/scripts/dist_host_profile.py [MxNxK, default 2048x4096x4096]
"""
import collections
import importlib
import os
import statistics
import sys
import time

import torch

from xelink.bench import kernel_timing

import xelink
from xelink import symm
from xelink.dist import device, gemm as front
from xelink.kernels import gemm

gemm_mod = importlib.import_module("xelink.kernels.gemm")  # the module (the package re-exports the function)

CALLS, ROUNDS, SLOT = 100, 5, 40  # SLOT: a semaphore slot no op uses
world = xelink.init()
n, r, dev = world.size, world.rank, world.device
peer = (r + 1) % n
M, N, K = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2048x4096x4096").split("x"))
a = torch.randn(M // n, K, dtype=torch.bfloat16, device=dev)
b = torch.randn(K, N, dtype=torch.bfloat16, device=dev)
c = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
stage = symm.empty((n, M // n, K), dtype=torch.bfloat16, group=world)
side = torch.cuda.Stream(dev)
main = torch.cuda.current_stream(dev)
ev = torch.cuda.Event()


def busy():
    kernel_timing.busy(5_000)  # 5 ms


def per_call_us(fn, calls=CALLS):
    got = []
    for _ in range(ROUNDS):
        busy()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        got.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
        world.barrier()
    return max(world.allgather_object(statistics.median(got)))  # the slowest rank's


def row(name, fn, calls=CALLS):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    world.barrier()
    us = per_call_us(fn, calls)
    if r == 0:
        print(f"{name:60s} {us:8.2f} us", flush=True)


def signal_wait():  # one signal to the peer and one wait for its signal: balanced on both ranks
    symm.signal(peer, SLOT, group=world, stream=main)
    symm.wait(peer, SLOT, group=world, stream=main)


if r == 0:
    print(f"{n} ranks on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {M}x{N}x{K} bf16",
          flush=True)
row("torch.empty(M, N) output", lambda: torch.empty((M, N), dtype=a.dtype, device=dev))
row("stage[r].copy_(a)", lambda: stage[r].copy_(a))
row("stage[r] (a view)", lambda: stage[r])
row("c.narrow(0, 0, rows)", lambda: c.narrow(0, 0, M // n))
row("gemm(a, b, out=c.narrow(...))", lambda: gemm(a, b, out=c.narrow(0, 0, M // n)))
blk = c.narrow(0, 0, M // n)
row("gemm(a, b, out=blk) (one view)", lambda: gemm(a, b, out=blk))
row("gemm(a, b)", lambda: gemm(a, b))
row("gemm(a, b, impl='triton', out=blk)", lambda: gemm(a, b, impl="triton", out=blk))
plan = gemm_mod._Launch(a, b, blk, "cuda", "off", gemm_mod._gemm_config(M // n, N, K), True)
row("gemm's remembered _Launch(a, b, blk) alone", lambda: plan(a, b, blk))
row("torch.matmul(a, b)", lambda: torch.matmul(a, b))
row("symm.signal + symm.wait", signal_wait)
row("symm.get(stage[peer], stage[peer], peer, copy engine)",
    lambda: symm.get(stage[peer], stage[peer], peer, group=world, engine="copy", stream=side))
row("torch.cuda.Event() + record(side)", lambda: torch.cuda.Event().record(side))
row("main.wait_event(ev)", lambda: main.wait_event(ev))
row("side.wait_stream(main)", lambda: side.wait_stream(main))
row("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
spent = collections.defaultdict(float)
counts = collections.Counter()


def timed(name, f):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
            counts[name] += 1
    return wrapper


# What the schedules call, by the names they call it by (module attributes, patched for the timed loops).
WRAPPED = [(device, n) for n in ("all_gather_matmul", "matmul_reduce_scatter", "_mm_into", "stage_buffer",
                                 "side_stream", "all_gather_into_tensor", "reduce_scatter_tensor", "gathered",
                                 "_fwd", "_order")]
WRAPPED += [(symm, n) for n in ("signal", "wait", "get", "put")]
WRAPPED += [(device.schedule, n) for n in ("topo_plan", "direct_plan", "serves")]


def breakdown(name, fn, calls=20):
    row(name, fn, calls)
    saved = [(mod, n, getattr(mod, n)) for mod, n in WRAPPED]
    for mod, n, f in saved:
        setattr(mod, n, timed(f"{mod.__name__.split('.')[-1]}.{n}", f))
    spent.clear()
    counts.clear()
    torch.cuda.synchronize()
    world.barrier()
    busy()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    total = time.perf_counter() - t0
    torch.cuda.synchronize()
    world.barrier()
    for mod, n, f in saved:
        setattr(mod, n, f)
    if r == 0:
        print(f"  instrumented: {total / calls * 1e6:8.2f} us a call, of which:")
        for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(f"    {k:40s} {v / calls * 1e6:8.2f} us a call ({counts[k] // calls} calls)")


assert front.all_gather_matmul is xelink.all_gather_matmul
ar = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
CASES = [(f"all_gather_matmul(algo={algo!r})", lambda algo=algo: xelink.all_gather_matmul(a, b, algo=algo))
         for algo in ("sequential", "pipelined", "topo", "fused")]
CASES += [(f"matmul_reduce_scatter(algo={algo!r})", lambda algo=algo: xelink.matmul_reduce_scatter(ar, b, algo=algo))
          for algo in ("sequential", "pipelined", "fused")]
CASES += [(f"matmul_all_reduce(algo={algo!r})", lambda algo=algo: xelink.matmul_all_reduce(a, b, algo=algo))
          for algo in ("pipelined",)]
# First every schedule enqueued call by call (XELINK_DIST_GRAPHS=0), then as users call it: the same
# tensors again, so the second call captures the schedule and later ones replay it (xelink.dist.graphs).
os.environ["XELINK_DIST_GRAPHS"] = "0"
for name, fn in CASES:
    breakdown(f"{name}, each call enqueues its schedule", fn)
del os.environ["XELINK_DIST_GRAPHS"]
WRAPPED += [(device.graphs, "key_of"), (device.graphs.symm, "team_of")]
WRAPPED += [(front, n) for n in ("group_of", "_tensor", "_weights", "_outputs", "_pick", "fingerprint_check")]
for name, fn in CASES:
    if "sequential" not in name:
        breakdown(f"{name}, replayed", fn)
if r == 0:
    gs = world.resource(("xelink.dist", "graphs", str(dev)))
    print(f"remembered schedules: {len(gs.graphs)} graphs, {gs.replays} replayed calls", flush=True)
outs = [torch.empty(M, N, dtype=a.dtype, device=dev) for _ in range(3 + ROUNDS * 20)]


def new_output():  # a new output address every call (out= from a pool): every call enqueues its schedule
    xelink.all_gather_matmul(a, b, algo="pipelined", out=outs.pop())


row("all_gather_matmul(algo='pipelined', out=a new tensor each call)", new_output, calls=20)
xelink.finalize()
