"""``xelink bench dist-gemm``: the distributed GEMM ops against the GEMM alone and the unfused baselines, in
one run (issue 21).

Run under a launcher: ``mpiexec -n 4 xelink bench dist-gemm`` (CPU ranks), ``mpirun -n 2 xelink bench
dist-gemm`` (one GPU per rank, or ranks sharing one with ``XELINK_RANKS_PER_DEVICE``). Per shape
M x N x K (c = a @ b, ``[M, K] @ [K, N]``; M rounded down to a multiple of the rank count), per op:

- ``all_gather_matmul``: every rank holds ``M/n`` rows of a; ``matmul_reduce_scatter``: every rank
  holds an ``[M, K]`` a and keeps ``M/n`` rows of the sum of the ``a @ b`` over ranks;
- ``xelink:<algo>`` for ``sequential``, ``pipelined``, ``topo`` and, for ``all_gather_matmul`` on CUDA,
  ``fused`` (the path named, never auto);
- ``torch:matmul``: the GEMM alone, the full-size local GEMM every rank computes (the baseline of
  every row: ``ratio`` = GEMM-alone time / time, the share of GEMM-alone speed);
- the unfused baseline, the launch's own collective and ``torch.matmul`` (``mpi:`` under mpirun and
  ``gloo:`` under torchrun on CPU ranks, as the collectives family; ``nccl:`` on CUDA with one GPU
  per rank), its time in ``extra["vs_unfused"]`` of each row (unfused time / time);
- on CUDA with one GPU per rank, torch's fused ops (``torch-symm:fused_all_gather_matmul``,
  ``torch-symm:fused_matmul_reduce_scatter``). Where ranks share a GPU, NCCL and torch's fused ops
  cannot run: their rows are left out and a note says so.

Every row carries the cost model's prediction (``predicted_us``, ``cost.predict_dist_gemm`` on the job's
topology with the GEMM rate measured by the GEMM-alone row). CPU ranks: float32 integer-valued data,
host clock, checked exactly; CUDA: bf16, CUDA events, eager and (op ``<op>:graph``) replays of a CUDA
graph of back-to-back calls, and at the largest shape the host time of one eager call of
``pipelined``, ``topo`` and ``fused`` next to ``torch.matmul``'s (op ``<op>:host``; issue 21's target: 80 us).
The outputs of the timed calls are checked (``#wrong``: exact on CPU, ``kernel_timing.wrong_elements``
against float32 on CUDA), summed over ranks.

The ops (``xelink.all_gather_matmul``, ``xelink.matmul_reduce_scatter``) are looked up when the family
runs; without them it says so and measures nothing.
"""
from __future__ import annotations

import functools

import torch

from ..harness import (CUDA_ONLY, at_least, co_measure, make_row, on_cuda, one_gpu_per_rank, pred_over_meas, rank_max,
                       rank_sums, summarize, time_cuda_events)
from ..kernel_timing import add_timing_arguments, cuda_graph, host_rows, host_timing, timing, wrong_elements
from .collectives import transport_baseline

__all__ = ["ALGOS", "GPU_SHAPES", "OPS", "QUICK_GPU_SHAPES", "QUICK_SHAPES", "SHAPES", "add_arguments", "run",
           "run_shapes"]

OPS = ("all_gather_matmul", "matmul_reduce_scatter")
ALGOS = ("sequential", "pipelined", "topo", "fused")  # fused: CUDA only
SHAPES = ((512, 512, 512), (1024, 1024, 1024))  # CPU ranks, M x N x K
QUICK_SHAPES = ((256, 256, 256),)
GPU_SHAPES = ((8192, 8192, 8192), (16384, 8192, 4096), (2048, 4096, 4096))
QUICK_GPU_SHAPES = ((2048, 4096, 4096),)
GEMM = "torch:matmul"
HOST_TARGET_US = 80.0  # issue 21: host time per eager call of pipelined / topo at 8192^3


def _inputs(op, n, M, N, K, dtype, dev):
    """(this rank's a, b, the expected output of this rank, the full-size a of the GEMM alone), every
    rank's a drawn from a seed of its own so that each rank knows them all."""
    cuda = dev.type == "cuda"

    def draw(shape, seed):
        g = torch.Generator().manual_seed(seed)
        if cuda:
            return torch.randn(shape, generator=g).to(dtype)
        return torch.randint(-2, 3, shape, generator=g).to(dtype)  # small integers: exact sums

    m = M // n
    b = draw((K, N), 1).to(dev)
    if op == "all_gather_matmul":
        shards = [draw((m, K), 100 + r) for r in range(n)]
        full = torch.cat(shards).to(dev)
        want = full.float() @ b.float() if cuda else full.double() @ b.double()
        return lambda r: shards[r].to(dev), b, lambda r: want, full
    parts = [draw((M, K), 100 + r) for r in range(n)]
    total = sum(p.double() for p in parts).to(dev)
    want = (total.float() @ b.float()) if cuda else total @ b.double()
    return lambda r: parts[r].to(dev), b, lambda r: want[r * m:(r + 1) * m], parts[0].to(dev)


def _variants(world, op, a, b, full, algos, fused_group):
    """name -> a call returning its output; and notes on the rows left out."""
    import xelink

    fn = getattr(xelink, op)
    fused_ok = on_cuda(world)
    out = {f"xelink:{algo}": functools.partial(fn, a, b, algo=algo) for algo in algos if algo != "fused" or fused_ok}
    out[GEMM] = functools.partial(torch.matmul, full, b)
    notes = [] if fused_ok or "fused" not in algos else \
        [f"{op}: xelink:fused left out: it is a GPU kernel (CUDA tensors)"]
    n = world.size
    if not on_cuda(world) or one_gpu_per_rank(world):
        base = transport_baseline(world)
        if op == "all_gather_matmul":
            gathered = torch.empty(a.shape[0] * n, a.shape[1], dtype=a.dtype, device=a.device)
            out[f"{base.name}:all_gather+matmul"] = lambda: (base.all_gather(gathered, a), gathered @ b)[1]
        else:
            block = torch.empty(a.shape[0] // n, b.shape[1], dtype=a.dtype, device=a.device)
            out[f"{base.name}:matmul+reduce_scatter"] = lambda: (base.reduce_scatter(block, a @ b), block)[1]
    else:
        unfused = "all-gather then matmul" if op == "all_gather_matmul" else "matmul then reduce-scatter"
        notes.append(f"{op}: the NCCL baseline ({unfused}) skipped: {n} ranks share a GPU, and NCCL needs one GPU "
                     f"per rank")
    if one_gpu_per_rank(world) and fused_group is not None:
        if op == "all_gather_matmul":
            out["torch-symm:fused_all_gather_matmul"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                a, [b], 0, fused_group)[1][0]
        else:
            out["torch-symm:fused_matmul_reduce_scatter"] = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                a, b, "sum", 0, fused_group)
    elif on_cuda(world):
        notes.append(f"{op}: torch's fused op skipped: "
                     + ("symmetric memory unavailable" if one_gpu_per_rank(world) else
                        f"{n} ranks share a GPU, and torch's symmetric memory needs one GPU per rank"))
    return out, notes


def _fused_group(world, notes):
    """The group name torch's fused ops take, with symmetric memory enabled; None where they cannot run."""
    if not one_gpu_per_rank(world):
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = world.process_group().group_name
        symm_mem.enable_symm_mem_for_group(name)
        return name
    except Exception as e:  # noqa: BLE001 - a missing baseline is reported, not fatal
        notes.append(f"torch symmetric memory unavailable, its fused-op rows are left out: {e}")
        return None


def _model(world):
    """(topology, placement) the cost model prices the rows with, or (None, None)."""
    from ...topology import from_env_or_discover
    from ..probe import job_placement

    try:
        return job_placement(world, world.topology or from_env_or_discover(world), None)
    except Exception:  # noqa: BLE001 - no prediction rather than no benchmark
        return None, None


def _predict(model, op, algo, M, N, K, item, gemm_s):
    from ... import cost

    topo, placement = model
    if topo is None or gemm_s <= 0:
        return None
    try:
        p = cost.predict_dist_gemm(topo, placement, op, algo, M, N, K, item,
                                   gemm_tflops=2.0 * M * N * K / gemm_s / 1e12 * placement.devices.count(
                                       placement.devices[0]))
    except ValueError:
        return None
    return p.time_s * 1e6


def _rows(world, op, mode, samples, wrong, M, N, K, dtype, model, per=1.0):
    n = world.size
    item = torch.tensor([], dtype=dtype).element_size()
    samples = {k: [t / per for t in v] for k, v in samples.items()}
    gemm_s = summarize(samples[GEMM])["median"]
    unfused = next((k for k in samples if "+" in k), None)
    rows = []
    for name, s in samples.items():
        t = summarize(s)["median"]
        algo = name.split(":", 1)[1] if name.startswith("xelink:") else None
        pred = _predict(model, op, algo, M, N, K, item, gemm_s) if algo else None
        extra = {"shape": f"{M}x{N}x{K}", "mode": mode, "TFLOPs": 2.0 * M * N * K / t / 1e12 if t > 0 else None,
                 "pct_of_gemm_alone": 100 * gemm_s / t if t > 0 else None}
        if unfused and name != unfused and t > 0:
            extra["vs_unfused"] = summarize(samples[unfused])["median"] / t
        row = make_row(f"{op}:{mode}" if mode != "eager" else op, name, s,
                       size_bytes=M * (K if op == "all_gather_matmul" else N) * item, count=M * N, dtype=dtype,
                       nranks=n, wrong=wrong.get(name, 0), baseline=None if name == GEMM else GEMM,
                       baseline_samples=None if name == GEMM else samples[GEMM], predicted_us=pred, extra=extra)
        if pred is not None:
            row.extra["pred_over_meas"] = pred_over_meas(row)
        rows.append(row)
    return rows


def _checked(world, variants, want, cuda):
    """Variants that keep their last output, and after_block checking it (wrong elements on this rank)."""
    outs, wrong = {}, {name: 0 for name in variants}

    def keep(name, fn):
        return lambda: outs.__setitem__(name, fn())

    def check(name):
        o = outs[name]
        wrong[name] += wrong_elements(o, want) if cuda else int((o.double() != want).sum())

    return {n: keep(n, f) for n, f in variants.items()}, check, wrong


def run_shapes(world, shapes, *, ops=OPS, algos=ALGOS, iters=3, rounds=2, graph_calls=0, host_calls=0,
               progress=None) -> tuple[list, list]:
    """Time every op x algorithm at every shape next to the GEMM alone and the baselines: (rows, notes),
    on every rank. ``graph_calls``: on CUDA, also replays of a graph of that many calls; ``host_calls``:
    on CUDA, the host time of ``pipelined`` and ``topo`` at the last of the largest shapes.

    Collective: every rank must call this with the same arguments.
    """
    import xelink

    missing = [op for op in ops if not hasattr(xelink, op)]
    if missing:
        return [], [f"dist-gemm: skipped: xelink.{missing[0]} does not exist in this tree (issue 21's ops)"]
    cuda = on_cuda(world)
    dev = torch.device(world.device) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    n = world.size
    notes: list = []
    fused = _fused_group(world, notes) if cuda else None
    model = _model(world)
    timer = functools.partial(time_cuda_events, warmup=0) if cuda else None
    largest = max(shapes, key=lambda s: s[0] * s[1] * s[2])
    rows = []
    for M, N, K in shapes:
        M = max(n, M // n * n)
        for op in ops:
            a_of, b, want_of, full = _inputs(op, n, M, N, K, dtype, dev)
            a, want = a_of(world.rank), want_of(world.rank)
            variants, why = _variants(world, op, a, b, full, algos, fused)
            notes += [w for w in why if w not in notes]
            calls, check, wrong = _checked(world, variants, want, cuda)
            samples = co_measure(calls, warmup=2 if cuda else 1, iters=iters, rounds=rounds, barrier=world.barrier,
                                 reduce_max=rank_max(world), timing=timer,
                                 after_block=lambda name: (check(name) if name != GEMM else None))
            wrong[GEMM] = 0  # torch's own GEMM, the reference of the speed, not of the values
            rows += _rows(world, op, "eager", samples, rank_sums(world, wrong), M, N, K, dtype, model)
            if cuda and graph_calls:
                rows += _graph_rows(world, op, variants, want, M, N, K, dtype, model, graph_calls, rounds)
            if cuda and host_calls and (M, N, K) == (max(n, largest[0] // n * n), *largest[1:]):
                rows += _host(world, op, variants, want, M, N, K, dtype, host_calls, rounds)
            if progress is not None:
                progress.step(f"{op} {M}x{N}x{K}: {', '.join(variants)}")
    return rows, notes


def _graph_rows(world, op, variants, want, M, N, K, dtype, model, calls, rounds):
    """Replays of a CUDA graph of ``calls`` back-to-back calls of each xelink path and of the GEMM alone."""
    graphed, wrong, outs = {}, {}, {}
    for name, fn in variants.items():
        if not (name.startswith("xelink:") or name == GEMM):
            continue
        graph, last, _ = cuda_graph([fn], calls)
        graphed[name], outs[name] = graph.replay, last[0]
        wrong[name] = 0

    def check(name):
        if name != GEMM:
            wrong[name] += wrong_elements(outs[name], want)

    samples = co_measure(graphed, warmup=1, iters=1, rounds=rounds, barrier=world.barrier, reduce_max=rank_max(world),
                         timing=functools.partial(time_cuda_events, warmup=0), after_block=check)
    return _rows(world, op, "graph", samples, rank_sums(world, wrong), M, N, K, dtype, model, per=calls)


def _host(world, op, variants, want, M, N, K, dtype, calls, rounds):
    """Host time of one eager call of pipelined and topo next to torch.matmul's (every rank, max reported)."""
    picked = {k: v for k, v in variants.items() if k in ("xelink:pipelined", "xelink:topo", "xelink:fused", GEMM)}
    checks = {k: (lambda out: 0) if k == GEMM else (lambda out: wrong_elements(out, want)) for k in picked}
    # At least 5 rounds: the first may capture schedules for the output addresses the interleaved variants
    # settle on (a one-time cost of the remembered schedules, ``xelink.dist.graphs``), which a median of 2
    # would average in.
    samples, wrong = host_timing(picked, checks, calls=calls, rounds=max(rounds, 5),
                                 agree=lambda busy: all(world.allgather_object(busy)))
    samples = {k: [max(x) for x in zip(*world.allgather_object(v))] for k, v in samples.items()}
    rows = host_rows(f"{op}:host", samples, rank_sums(world, wrong), GEMM, size_bytes=M * K * 2, count=M * N,
                     dtype=dtype, extra={"shape": f"{M}x{N}x{K}"})
    for r in rows:
        r.nranks = world.size
        if r.path != GEMM:
            r.extra.update(target_us=HOST_TARGET_US, target_ok=r.time_us <= HOST_TARGET_US)
    return rows


def _shape(text: str):
    from ...cost import parse_shape

    return parse_shape(text)


def add_arguments(p) -> None:
    """The options of ``xelink bench dist-gemm``."""
    p.add_argument("--shapes", nargs="+", type=_shape, default=None,
                   help="M x N x K shapes, e.g. 8192 or 16384x8192x4096 (default: CPU 512^3 1024^3, quick 256^3; "
                        "CUDA 8192^3 16384x8192x4096 2048x4096x4096, quick the last)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    add_timing_arguments(p, cpu="default 3, quick 2 (rounds 3, quick 2)", gpu="default 10 (rounds 3, quick 2)")
    g = p.add_argument_group(CUDA_ONLY)
    g.add_argument("--graph-calls", type=at_least(0), default=None,
                   help="calls captured in each CUDA graph (default 10; 0: no graph rows)")
    g.add_argument("--host-calls", type=at_least(0), default=None,
                   help="calls per block of the host-time rows (default 20; 0: none)")


def run(ctx) -> list:
    """The family with the options of ``add_arguments``; rows on rank 0, [] elsewhere. Collective."""
    world, args = ctx.world, ctx.args
    cuda = on_cuda(world)
    shapes = args.shapes or ((QUICK_GPU_SHAPES if ctx.quick else GPU_SHAPES) if cuda else
                             (QUICK_SHAPES if ctx.quick else SHAPES))
    knobs = timing(ctx, {"iters": 10 if cuda else 3, "rounds": 3}, {"iters": 10 if cuda else 2, "rounds": 2})
    graph_calls = (10 if args.graph_calls is None else args.graph_calls) if cuda else 0
    host_calls = (20 if args.host_calls is None else args.host_calls) if cuda else 0
    rows, notes = run_shapes(world, shapes, ops=args.ops, algos=args.algos, graph_calls=graph_calls,
                             host_calls=host_calls, progress=ctx.progress(len(shapes) * len(args.ops)), **knobs)
    if not ctx.lead:
        return []
    where = "bf16 CUDA tensors, CUDA events" if cuda else "float32 host tensors, host clock"
    ctx.header = (f"# dist-gemm: {world.size} rank(s), {world.launch.launcher}, {where}; ratio = GEMM alone "
                  f"({GEMM} of the full-size local GEMM) / time: the share of GEMM-alone speed; vs_unfused = the "
                  f"launch's collective then matmul / time; pred = cost.predict_dist_gemm at the measured GEMM rate")
    ctx.notes += notes + [_summary(rows)]
    return rows


def _summary(rows) -> str:
    lines = []
    for r in rows:
        if r.path == GEMM or r.ratio is None or r.op.endswith(":host"):
            continue
        extra = f", {r.extra['vs_unfused']:.2f}x the unfused" if "vs_unfused" in r.extra else ""
        lines.append(f"{r.op:<28} {r.extra['shape']:>16} {r.path:<40} {100 * r.ratio:5.1f}% of GEMM-alone speed{extra}")
    return "\n".join(lines)
