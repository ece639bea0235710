"""``xelink bench gpu-collectives``: GPU collectives against NCCL and torch's symmetric-memory ops, in the same
run (CUDA only; the suite skips it elsewhere with the reason).

Launch one rank per GPU: ``mpirun -n 2 xelink bench gpu-collectives --out DIR``.

Every timed variant goes through a public API on tensors the caller allocated, its path named
(``xelink:<algo>`` with ``algo=`` set, never auto): ``user`` tensors come from ``torch.empty`` (the copy
into peer memory is timed), ``symm`` tensors from ``xelink.empty`` (zero-copy). Baselines: NCCL through
torch.distributed, and torch's symmetric-memory one-shot/two-shot all-reduce on torch's own symmetric
buffers. Data: every rank holds the same small integers and the op is ``avg``, so an in-place
all-reduce leaves the buffer unchanged call after call; after timing, every buffer is compared with
that value (``wrong`` counts the elements that differ), which checks the timed calls themselves.
torch's symmetric-memory ops reduce with sum only: its in-place two-shot doubles the data each call,
so its row is timed on that data and not checked (``wrong`` = -1); its out-of-place one-shot is, on shares
x / n of the data (exact, and checked, where the world size n is a power of two).

Latency sizes are timed eagerly (CUDA events around back-to-back calls) and inside a CUDA graph
(``graph_calls`` calls captured once, replayed); large sizes eagerly with events. Variants are
interleaved in rounds and the median over rounds, max over ranks, is reported.

With ``--tune PATH`` its ``cuda:<op>`` entries are merged into a table already at PATH for the same
machine layout (the collectives family's, in ``xelink bench all``; ``tuning.save_merged``), so one file
holds both.
"""
from __future__ import annotations

import torch

from ...kernels.common import gc_paused
from ..harness import at_least

__all__ = ["LATENCY_SIZES", "add_arguments", "run", "tuning_table"]

LATENCY_SIZES = (1 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _pattern(world, n, dtype, dev):
    """(this rank's start, the value every buffer must hold after any number of in-place avg calls)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-8, 9, (n,), generator=g).to(dtype)
    return x.to(dev), x


class _Variant:
    """A named call on its own buffers; ``check()`` counts wrong elements against the expected value."""

    def __init__(self, name, call, check, baseline=False):
        self.name, self.call, self.check, self.baseline = name, call, check, baseline


def _all_reduce_variants(world, n, dtype, dev, group_name, with_torch_symm):
    import xelink

    variants = []

    def make(name, buf, call, out=None, checked=True):
        start, want = _pattern(world, n, dtype, dev)
        buf.copy_(start)
        target = buf if out is None else out
        check = (lambda: int((target.cpu() != want).sum())) if checked else (lambda: -1)
        return _Variant(name, call, check, baseline=name.startswith("nccl"))

    x1 = torch.empty(n, dtype=dtype, device=dev)
    variants.append(make("nccl", x1, lambda: xelink.all_reduce(x1, op="avg", algo="nccl")))
    for algo in ("direct", "two_shot"):
        xu = torch.empty(n, dtype=dtype, device=dev)
        variants.append(make(f"xelink:{algo}/user", xu,
                             lambda xu=xu, algo=algo: xelink.all_reduce(xu, op="avg", algo=algo)))
    xs = xelink.empty(n, dtype=dtype)
    variants.append(make("xelink:two_shot/symm", xs, lambda: xelink.all_reduce(xs, op="avg", algo="two_shot")))
    xc = xelink.empty(n, dtype=dtype)
    variants.append(make("xelink:copy_engine/symm", xc, lambda: xelink.all_reduce(xc, op="avg", algo="copy_engine")))
    if with_torch_symm:
        import torch.distributed._symmetric_memory as symm_mem

        t2 = symm_mem.empty(n, dtype=dtype, device=dev)
        symm_mem.rendezvous(t2, group_name)
        variants.append(make("torch-symm:two_shot", t2,
                             lambda: torch.ops.symm_mem.two_shot_all_reduce_(t2, "sum", group_name), checked=False))
        t1 = symm_mem.empty(n, dtype=dtype, device=dev)
        symm_mem.rendezvous(t1, group_name)
        out1 = torch.empty(n, dtype=dtype, device=dev)

        def one_shot():
            torch.ops.symm_mem.one_shot_all_reduce_out(t1, "sum", group_name, out1)

        # Each rank holds x / n, so the sum is x: exact where n is a power of two (a scale of the exponent); at
        # other world sizes the rounded shares need not sum back to x, and the row is not checked.
        exact = world.size & (world.size - 1) == 0
        variants.append(make("torch-symm:one_shot", t1, one_shot, out=out1, checked=exact))
        t1.mul_(1.0 / world.size)
    return variants


def _time(world, fn, calls, per=1):
    """Seconds per op of ``calls`` back-to-back ``fn()`` (each doing ``per`` ops), max over ranks."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    world.barrier()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return max(world.allgather_object(start.elapsed_time(end) / 1e3 / calls / per))


def _host_us(fn, calls=200):
    """Host time of one call (launch cost; the GPU runs behind), median of 3 batches, this rank."""
    import time

    out = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(out)[1]


def _graph(fn, calls):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return g.replay


def _measure(world, op, nbytes, count, dtype, variants, *, calls, rounds, graph, rows):
    from ..harness import make_row

    timed = {}
    for v in variants:
        v.call()  # warm-up: peer memory, compilation
    fns = {v.name: v.call for v in variants}
    modes = [("eager", fns, 1)]
    if graph:
        modes.append(("graph", {name: _graph(fn, calls) for name, fn in fns.items()}, calls))
    for mode, table, per in modes:
        samples = {name: [] for name in table}
        for _ in range(rounds):
            for name, fn in table.items():
                samples[name].append(_time(world, fn, calls if mode == "eager" else 5, per))
        timed[mode] = samples
    host = {name: _host_us(fn) for name, fn in fns.items()}
    torch.cuda.synchronize()
    wrong = {v.name: sum(world.allgather_object(v.check())) for v in variants}
    base = next(v.name for v in variants if v.baseline)
    for mode, samples in timed.items():
        for name, s in samples.items():
            rows.append(make_row(op, name.split("/")[0], s, size_bytes=nbytes, count=count, dtype=dtype,
                                 nranks=world.size, wrong=wrong[name], baseline=None if name == base else base,
                                 baseline_samples=None if name == base else samples[base],
                                 extra={"mode": mode, "variant": name, "calls": calls,
                                        "host_us_per_call": host[name]}))


def _all_gather_variants(world, n, dtype, dev):
    import xelink

    w = world.size
    g = torch.Generator().manual_seed(n)
    shards = [torch.randint(-8, 9, (n,), generator=g).to(dtype) for _ in range(w)]
    want = torch.cat(shards)
    variants = []

    def make(name, inp, call_of):
        inp.copy_(shards[world.rank].to(dev))
        out = torch.empty(w * n, dtype=dtype, device=dev)
        return _Variant(name, lambda: call_of(out, inp), lambda: int((out.cpu() != want).sum()),
                        baseline=name == "nccl")

    variants.append(make("nccl", torch.empty(n, dtype=dtype, device=dev),
                         lambda o, i: xelink.all_gather_into_tensor(o, i, algo="nccl")))
    variants.append(make("xelink:direct/user", torch.empty(n, dtype=dtype, device=dev),
                         lambda o, i: xelink.all_gather_into_tensor(o, i, algo="direct")))
    for algo in ("direct", "copy_engine"):
        variants.append(make(f"xelink:{algo}/symm", xelink.empty(n, dtype=dtype),
                             lambda o, i, a=algo: xelink.all_gather_into_tensor(o, i, algo=a)))
    return variants


def tuning_table(rows, topology_name, hosts, manifest=None, placement=None):
    """The GPU tuning table of result rows: per size, the fastest path that takes any tensor.

    Rows of tensors from ``torch.empty`` ("/user") and NCCL's, timed eagerly, become entries of op
    ``cuda:<op>`` (what ``algo="auto"`` on CUDA tensors looks up); zero-copy rows are left out, since
    auto cannot assume its caller allocated with ``xelink.empty``.
    """
    import dataclasses

    from ...tuning import fingerprint
    from ..tune import build_table

    picked = []
    for row in rows:
        extra = row.extra if hasattr(row, "extra") else row["extra"]
        variant = extra["variant"]
        if extra["mode"] != "eager" or not (variant == "nccl" or variant.endswith("/user")):
            continue
        path = "nccl" if variant == "nccl" else variant.split("/")[0]
        picked.append(dataclasses.replace(row, op=f"cuda:{row.op}", path=path, baseline=None, baseline_us=None,
                                          ratio=None))
    return build_table(picked, fingerprint(topology_name, hosts, placement), manifest=manifest)


def add_arguments(p) -> None:
    """The options of ``xelink bench gpu-collectives``."""
    p.add_argument("--rounds", type=at_least(1), default=5, help="rounds, variants interleaved (default 5)")
    p.add_argument("--calls", type=int, default=50, help="back-to-back calls per timing (latency sizes; default 50)")
    p.add_argument("--large-calls", type=int, default=10, help="back-to-back calls per timing (large sizes; "
                                                                "default 10)")
    p.add_argument("--tune", metavar="PATH", default=None,
                   help="write the tuning table auto uses on CUDA tensors here (merged into a table already there "
                        "for this machine layout)")


def run(ctx) -> list:
    """The GPU collectives against NCCL (and torch symmetric memory where it works) on every rank; rows on
    rank 0 (path ``<variant> [<mode>]``), [] elsewhere; the tuning table with ``--tune``.

    Collective: every rank of the world must call this; each rank needs a CUDA GPU (the suite checks).
    """
    world, args = ctx.world, ctx.args
    dev = torch.device(world.device)
    pg = world.process_group()
    group_name = pg.group_name
    with_torch_symm = True
    try:
        import torch.distributed._symmetric_memory as symm_mem

        probe = symm_mem.empty(16, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(probe, group_name)
    except Exception as e:  # noqa: BLE001 - a missing baseline is reported, not fatal
        with_torch_symm = False
        if ctx.lead:
            ctx.notes.append(f"torch symmetric memory unavailable, its rows are left out: {e}")
    rows = []
    dtype = torch.bfloat16
    sizes = LATENCY_SIZES[1:4:2] if ctx.quick else LATENCY_SIZES
    big = (16 << 20) if ctx.quick else (256 << 20)
    out_bytes = (32 << 20) if ctx.quick else (512 << 20)
    progress = ctx.progress(len(sizes) + 4)
    for nbytes in sizes:
        n = nbytes // 2
        _measure(world, "all_reduce", nbytes, n, dtype,
                 _all_reduce_variants(world, n, dtype, dev, group_name, with_torch_symm),
                 calls=args.calls, rounds=args.rounds, graph=True, rows=rows)
        progress.step(f"all_reduce {nbytes} B, eager and CUDA graph")
    _measure(world, "all_reduce", big, big // 2, dtype,
             _all_reduce_variants(world, big // 2, dtype, dev, group_name, with_torch_symm),
             calls=args.large_calls, rounds=args.rounds, graph=False, rows=rows)
    progress.step(f"all_reduce {big} B, eager")
    n = out_bytes // 2 // world.size
    _measure(world, "all_gather", out_bytes, n, dtype, _all_gather_variants(world, n, dtype, dev),
             calls=args.large_calls, rounds=args.rounds, graph=False, rows=rows)
    progress.step(f"all_gather {out_bytes} B, eager")
    for nbytes in (32 << 10, 1 << 20):
        n = nbytes // 2 // world.size
        _measure(world, "all_gather", nbytes, n, dtype, _all_gather_variants(world, n, dtype, dev),
                 calls=args.calls, rounds=args.rounds, graph=True, rows=rows)
        progress.step(f"all_gather {nbytes} B, eager and CUDA graph")
    if not ctx.lead:
        return []
    if args.tune:
        from ...tuning import save_merged

        table = tuning_table(rows, world.topology.name if world.topology else None, world.hosts, ctx.manifest(),
                             world.world_placement)
        merged = save_merged(table, args.tune)
        ctx.notes.append(f"tuning table written to {args.tune}" + (" (cuda entries merged with the ones already "
                                                                   "there)" if merged else ""))
    for row in rows:
        row.path = f"{row.extra['variant']} [{row.extra['mode']}]"
    return rows
