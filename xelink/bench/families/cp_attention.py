"""``xelink bench cp-attention``: context-parallel attention (``xelink.cp_attention``, issue 24) against one
device's attention over the whole sequence and the unoverlapped and unfused baselines, in one run.

Run under a launcher: ``mpiexec -n 2 xelink bench cp-attention`` (CPU ranks), ``mpirun -n 2 xelink bench
cp-attention`` (one GPU per rank, or ranks sharing one with ``XELINK_RANKS_PER_DEVICE``). Per shape (B=1,
H heads, total length N, head dim D; MHA; q, k, v drawn in full on every rank, each rank keeping its
``cp_shard``), non-causal (op ``cp_attention``) and causal (op ``cp_attention:causal``), both in the
``--layout`` (default zigzag):

- ``xelink:<algo>`` for ``ring`` and ``all_gather`` (the algorithm named, never auto);
- ``single:flash_attention``: one ``xelink.kernels.flash_attention`` call over the whole sequence on rank 0
  alone (the others idle; CPU: the reference path), the baseline of every row (``ratio`` = its time /
  time); on CUDA also ``single:sdpa_cudnn`` (SDPA's cuDNN backend, same work) beside it;
- ``blocking:ring``: a ring built in this module from the op's own local attention (``dist.cp_engine.attend``:
  the same ``flash_attention`` calls, merged by LSE with ``merge_attention``), then a blocking
  exchange of the KV block (``xelink.batch_isend_irecv``, both waited) before the next step: nothing
  overlaps, so ``extra["vs_blocking_ring"]`` of ``xelink:ring`` (blocking time / ring time) is the
  overlap alone;
- non-causal only, the launch's collective then SDPA: ``mpi:`` / ``gloo:all_gather+sdpa`` on CPU ranks,
  ``nccl:all_gather+sdpa_cudnn`` on CUDA with one GPU per rank (the KV gathered along the sequence into a
  (N, 2, B, H, D) buffer SDPA reads as strided views); ``extra["vs_gather_sdpa"]`` of ``xelink:all_gather``.
  Where ranks share a GPU NCCL cannot run: left out with a note; causal left out (SDPA's ``is_causal``
  cannot express the layout's positions without a dense mask).

``--window W`` (a sliding window of W positions, causal): instead, op ``cp_attention:window`` with
``xelink:halo`` (``cp_attention(..., window=W)``: each rank receives only the keys its windows reach), the
single-device ``flash_attention(..., window=W)`` baseline, and ``gather:window``: the packed KV gathered whole
(``cp_unshard``) and each of the rank's pieces attending to its span (what ``Llama`` ran under CP before the halo
exchange; ``extra["vs_gather"]`` of ``xelink:halo``).

The outputs of the timed calls are checked (``#wrong``, summed over ranks) against single-process attention
over the gathered sequence (float64 SDPA on CPU, float32 SDPA's memory-efficient backend on CUDA), each
rank against its ``cp_shard`` of it: relative tolerance 1e-4 on CPU (float32), 2e-2 on CUDA (bf16), of the
value plus the reference's RMS. On CUDA (bf16, CUDA events) the note states issue 24's targets with their
ratios, or why they wait (two GPUs).
"""
from __future__ import annotations

import argparse
import functools

import torch

from ..harness import (at_least, co_measure, make_row, on_cuda, one_gpu_per_rank, rank_max, rank_sums, summarize,
                       time_cuda_events)
from ..kernel_timing import add_timing_arguments, timing

__all__ = ["ALGOS", "BLOCKING", "GPU_SHAPES", "QUICK_GPU_SHAPES", "QUICK_SHAPES", "SHAPES", "SINGLE", "add_arguments",
           "blocking_ring", "run", "run_shapes"]

ALGOS = ("ring", "all_gather")
SHAPES = ((1024, 4, 64),)  # CPU ranks: (N, H, D)
QUICK_SHAPES = ((256, 4, 64),)
GPU_SHAPES = ((16384, 32, 128), (65536, 32, 128), (131072, 32, 128))
QUICK_GPU_SHAPES = ((16384, 32, 128),)
SINGLE = "single:flash_attention"
CUDNN = "single:sdpa_cudnn"
BLOCKING = "blocking:ring"
TOL = {"cpu": 1e-4, "cuda": 2e-2}
# issue 24's targets (one GPU per rank): (op, path, what the ratio is taken against, minimum, longest N only)
TARGETS = (("cp_attention", "xelink:all_gather", "vs_gather_sdpa", 1.0, False),
           ("cp_attention", "xelink:ring", "vs_blocking_ring", 1.3, False),
           ("cp_attention:causal", "xelink:ring", "ratio", 1.85, True))


def wrong_count(out: torch.Tensor, ref: torch.Tensor, rel: float) -> int:
    """Elements of ``out`` farther from ``ref`` than ``rel`` of the value plus ``rel`` of the RMS of its row
    (one query's output: causal rows over few keys are far larger than rows over many, so one RMS for the
    whole tensor would hold the early rows to a bound below bf16's rounding of them; NaN: wrong)."""
    ref = ref.double() if ref.device.type == "cpu" else ref.float()
    tol = rel * (ref.abs() + ref.pow(2).mean(-1, keepdim=True).sqrt())
    return int((~((out.to(ref.dtype) - ref).abs() <= tol)).sum())


# -- the blocking ring ----------------------------------------------------------------------------

def blocking_ring(world, q, kv, seq_len, layout, causal, scale=None):
    """The blocking baseline: this rank's attention output (q's dtype) over the whole sequence, the packed
    KV blocks (``kv``: (2, B, H, S_local, D)) passed around the rank-ordered ring, each step attending to the
    block at hand with the op's own local attention (``dist.cp_engine.attend``: the same coalesced
    ``flash_attention`` calls, merged by LSE into a float32 accumulator) and only then exchanging it (``batch_isend_irecv``, both transfers waited: on CUDA
    the next kernel is queued behind the transfer). Collective: every rank of ``world``."""
    import xelink

    from ...dist.cp_engine import Accumulator, attend
    from ...dist.schedule import cp_lengths, cp_pieces, local_pieces

    n, r = world.size, world.rank
    lengths = cp_lengths(seq_len, n, layout)
    qpieces = local_pieces(cp_pieces(seq_len, n, layout, r))
    B, _, _, D = q.shape
    acc = Accumulator(q)
    cur, owner = kv, r
    for s in range(n):
        attend(acc, q, qpieces, local_pieces(cp_pieces(seq_len, n, layout, owner)), cur[0], cur[1], causal, scale)
        if s < n - 1:
            nxt_owner = (owner - 1) % n
            nxt = kv.new_empty((2, B, kv.shape[2], lengths[nxt_owner], D))
            ops = [xelink.P2POp(xelink.irecv, nxt, (r - 1) % n, tag=31), xelink.P2POp(xelink.isend, cur, (r + 1) % n,
                                                                                      tag=31)]
            for h in xelink.batch_isend_irecv(ops):
                h.wait()
            cur, owner = nxt, nxt_owner
    return acc.result(q.dtype)[0]


# -- the rows -------------------------------------------------------------------------------------

def _draw(N, H, D, dtype, dev):
    g = torch.Generator().manual_seed(N * 7 + H * 3 + D)
    return [torch.randn((1, H, N, D), generator=g).to(dtype).to(dev) for _ in range(3)]


def _reference(q, k, v, causal, cuda, window=None):
    import torch.nn.functional as F

    mask = None
    if window is not None:  # causal within the window, as a dense mask (SDPA has no window)
        p = torch.arange(q.shape[2], device=q.device)
        mask = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - window)
        causal = False
    if not cuda:
        return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal)


def _sdpa_cudnn(q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _cudnn_ok(world, dev, dtype) -> str | None:
    """None where SDPA's cuDNN backend runs on rank 0's GPU, else why not (the same answer on every rank)."""
    why = None
    if world.rank == 0:
        try:
            x = torch.randn((1, 2, 128, 128), device=dev, dtype=dtype)
            _sdpa_cudnn(x, x, x, False)
        except Exception as e:  # noqa: BLE001 - a missing baseline is reported, not fatal
            why = f"SDPA's cuDNN backend unavailable: {e}"
    return world.allgather_object(why)[0]


def _variants(world, cp, q, k, v, full, N, layout, causal, algos, cudnn_why):
    """name -> a call returning this rank's output (None on ranks that idle); and notes on rows left out."""
    import torch.nn.functional as F

    from .collectives import transport_baseline

    n, lead, cuda = world.size, world.rank == 0, on_cuda(world)
    out = {f"xelink:{a}": functools.partial(cp, q, k, v, causal=causal, layout=layout, algo=a, seq_len=N)
           for a in algos}
    qf, kf, vf = full
    from ...kernels import flash_attention

    out[SINGLE] = (lambda: flash_attention(qf, kf, vf, causal=causal)) if lead else (lambda: None)
    notes = []
    if cuda:
        if cudnn_why is None:
            out[CUDNN] = (lambda: _sdpa_cudnn(qf, kf, vf, causal)) if lead else (lambda: None)
        else:
            notes.append(f"{CUDNN} left out: {cudnn_why}")
    # the KV packed inside the timed call, as the op packs it
    out[BLOCKING] = lambda: blocking_ring(world, q, torch.stack((k, v)), N, layout, causal)
    if causal:
        notes.append("causal: the all-gather + SDPA baseline left out (SDPA's is_causal cannot express the "
                     f"{layout} layout's positions without a dense mask)")
    elif cuda and not one_gpu_per_rank(world):
        notes.append(f"the NCCL all-gather + cuDNN SDPA baseline left out: {n} ranks share a GPU, and NCCL needs "
                     f"one GPU per rank")
    elif N % (2 * n if layout == "zigzag" else n):
        notes.append(f"N={N}: the all-gather + SDPA baseline left out (ranks' lengths differ)")
    else:
        base = transport_baseline(world)
        L, B, H, D = q.shape[2], q.shape[0], q.shape[1], q.shape[3]
        src = torch.stack((k, v)).permute(3, 0, 1, 2, 4).contiguous()  # (L, 2, B, H, D): the seq dim outermost
        gathered = torch.empty((n * L, 2, B, H, D), dtype=q.dtype, device=q.device)
        view = lambda i: gathered[:, i].permute(1, 2, 0, 3)  # noqa: E731 - (B, H, nL, D), strided
        if cuda:
            name = f"{base.name}:all_gather+sdpa_cudnn"
            attend = lambda: _sdpa_cudnn(q, view(0), view(1), False)  # noqa: E731
        else:
            name = f"{base.name}:all_gather+sdpa"
            attend = lambda: F.scaled_dot_product_attention(q, view(0), view(1))  # noqa: E731
        out[name] = lambda: (base.all_gather(gathered, src), attend())[1]
    return out, notes


def _window_variants(world, cp, q, k, v, full, N, layout, window):
    """--window's calls: name -> a call returning this rank's output (None on ranks that idle)."""
    import xelink

    from ...dist.schedule import rank_pieces, window_spans
    from ...kernels import flash_attention

    spans = window_spans(N, window, True, rank_pieces(N, world.size, layout, world.rank))

    def gathered():
        kv = xelink.cp_unshard(torch.stack((k, v)), seq_len=N, layout=layout, dim=3)
        out = torch.empty_like(q)
        for lo, hi, first, end in spans:
            out[:, :, lo:hi] = flash_attention(q[:, :, lo:hi], kv[0][:, :, first:end], kv[1][:, :, first:end],
                                               causal=True, window=window)
        return out

    qf, kf, vf = full
    single = (lambda: flash_attention(qf, kf, vf, causal=True, window=window)) if world.rank == 0 else (lambda: None)
    return {"xelink:halo": functools.partial(cp, q, k, v, causal=True, layout=layout, seq_len=N, window=window),
            SINGLE: single, "gather:window": gathered}


def _checked(variants, want, want_full, rel):
    outs, wrong = {}, {name: 0 for name in variants}

    def keep(name, fn):
        return lambda: outs.__setitem__(name, fn())

    def check(name):
        o = outs[name]
        if o is not None:
            wrong[name] += wrong_count(o, want_full if name.startswith("single:") else want, rel)

    return {name: keep(name, fn) for name, fn in variants.items()}, check, wrong


def _rows(world, op, samples, wrong, N, H, D, dtype, causal, layout, window=None):
    item = torch.tensor([], dtype=dtype).element_size()
    flops = 4.0 * H * N * N * D * (0.5 if causal else 1.0)
    if window is not None:  # the pairs a window keeps: W a row, less the first rows' missing ones
        w = min(window, N)
        flops = 4.0 * H * D * (N * w - w * (w - 1) / 2)
    med = {k: summarize(v)["median"] for k, v in samples.items()}
    unfused = next((k for k in samples if "all_gather+" in k), None)
    rows = []
    for name, s in samples.items():
        t = med[name]
        extra = {"shape": f"N={N} H={H} D={D}", "causal": causal, "layout": layout,
                 "TFLOPs": flops / t / 1e12 if t > 0 else None}
        if name == "xelink:ring" and BLOCKING in med and t > 0:
            extra["vs_blocking_ring"] = med[BLOCKING] / t
        if name == "xelink:all_gather" and unfused and t > 0:
            extra["vs_gather_sdpa"] = med[unfused] / t
        if window is not None:
            extra["window"] = window
            if name == "xelink:halo" and t > 0:
                extra["vs_gather"] = med["gather:window"] / t
        rows.append(make_row(op, name, s, size_bytes=2 * H * N * D * item, count=H * N * D, dtype=dtype,
                             nranks=world.size, wrong=wrong.get(name, 0), baseline=None if name == SINGLE else SINGLE,
                             baseline_samples=None if name == SINGLE else samples[SINGLE], extra=extra))
    return rows


def run_shapes(world, shapes, *, algos=ALGOS, causals=(False, True), layout="zigzag", iters=3, rounds=2,
               progress=None, window=None) -> tuple[list, list]:
    """Time both algorithms at every (N, H, D) shape and causal mode next to the baselines (``window``: the
    windowed rows instead, causal): (rows, notes), on every rank. Collective: every rank must call this with the
    same arguments."""
    import xelink

    cp = getattr(xelink, "cp_attention", None)  # looked up now: a test may wrap it
    if cp is None:
        return [], ["cp-attention: skipped: xelink.cp_attention does not exist in this tree (issue 24's op)"]
    cuda = on_cuda(world)
    dev = torch.device(world.device) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rel = TOL["cuda" if cuda else "cpu"]
    timer = functools.partial(time_cuda_events, warmup=0) if cuda else None
    cudnn_why = _cudnn_ok(world, dev, dtype) if cuda else None
    notes, rows = [], []
    for N, H, D in shapes:
        if N < 2 * world.size:
            raise ValueError(f"cp-attention: N={N} is shorter than the {2 * world.size} blocks of {world.size} ranks")
        full = _draw(N, H, D, dtype, dev)
        local = [xelink.cp_shard(x, layout=layout) for x in full]
        for causal in causals if window is None else (True,):
            ref = _reference(*full, causal, cuda, window)
            want = xelink.cp_shard(ref, layout=layout)
            if window is None:
                variants, why = _variants(world, cp, *local, full, N, layout, causal, algos, cudnn_why)
                notes += [w for w in why if w not in notes]
            else:
                variants = _window_variants(world, cp, *local, full, N, layout, window)
            calls, check, wrong = _checked(variants, want, ref if world.rank == 0 else None, rel)
            samples = co_measure(calls, warmup=2 if cuda else 1, iters=iters, rounds=rounds, barrier=world.barrier,
                                 reduce_max=rank_max(world), timing=timer, after_block=check)
            op = "cp_attention:window" if window is not None else "cp_attention:causal" if causal else "cp_attention"
            rows += _rows(world, op, samples, rank_sums(world, wrong), N, H, D, dtype, causal, layout, window)
            del ref, want
            if progress is not None:
                progress.step(f"{op} N={N} H={H} D={D}: {', '.join(variants)}")
    return rows, notes


def _targets(world, rows) -> list[str]:
    """Issue 24's targets, each with its ratio, or why it waits."""
    if not on_cuda(world):
        return ["targets (issue 24): CUDA only; these are CPU ranks (correctness and the code paths)"]
    longest = max((int(r.extra["shape"].split()[0][2:]) for r in rows), default=0)
    lines = []
    for op, path, key, need, at_longest in TARGETS:
        got = [r for r in rows if r.op == op and r.path == path
               and (not at_longest or int(r.extra["shape"].split()[0][2:]) == longest)]
        what = f"{op} {path} {key} >= {need}" + (" at the longest N" if at_longest else "")
        if not one_gpu_per_rank(world):
            lines.append(f"target {what}: waits for two GPUs ({world.size} ranks share a GPU here)")
            continue
        if not got or all(key not in r.extra and key != "ratio" for r in got):
            lines.append(f"target {what}: not measured in this run")
            continue
        for r in got:
            value = r.ratio if key == "ratio" else r.extra.get(key)
            if value is None:
                continue
            r.extra.update(target=need, target_ok=value >= need)
            lines.append(f"target {what}: {r.extra['shape']}: {value:.2f}x, {'met' if value >= need else 'MISSED'}")
    return lines


def _shape(text: str):
    """N, NxH or NxHxD (K/M suffixes on N); H defaults to 32 (CPU 4), D to 128 (CPU 64)."""
    parts = text.lower().split("x")
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"cp-attention: bad shape {text!r} (N, NxH or NxHxD)")
    mult = {"k": 1024, "m": 1 << 20}
    n = parts[0]
    N = int(n[:-1]) * mult[n[-1]] if n and n[-1] in mult else int(n)
    shape = (N, *(int(p) for p in parts[1:]))
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: N, H and D must be >= 1")
    return shape


def add_arguments(p) -> None:
    """The options of ``xelink bench cp-attention``."""
    p.add_argument("--shapes", nargs="+", type=_shape, default=None,
                   help="N, NxH or NxHxD (B=1, MHA), e.g. 16K 64Kx32x128 (default: CPU 1024x4x64, quick 256x4x64; "
                        "CUDA N = 16K 64K 128K at 32 heads, HD 128, quick 16K)")
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    p.add_argument("--causal", choices=("both", "on", "off"), default="both", help="causal modes (default both)")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--window", type=at_least(1), default=None,
                   help="a sliding window of this many positions (causal): the halo exchange against one device's "
                        "windowed attention and the whole KV gathered (instead of the algorithms' rows)")
    add_timing_arguments(p, cpu="default 3, quick 2 (rounds 3, quick 2)", gpu="default 5 (rounds 3, quick 2)")


def run(ctx) -> list:
    """The family with the options of ``add_arguments``; rows on rank 0, [] elsewhere. Collective."""
    world, args = ctx.world, ctx.args
    cuda = on_cuda(world)
    shapes = args.shapes or ((QUICK_GPU_SHAPES if ctx.quick else GPU_SHAPES) if cuda else
                             (QUICK_SHAPES if ctx.quick else SHAPES))
    dflt = (32, 128) if cuda else (4, 64)
    shapes = [(s[0], *(tuple(s[1:]) + dflt[len(s) - 1:])) for s in shapes]
    causals = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal] if args.window is None else (True,)
    knobs = timing(ctx, {"iters": 5 if cuda else 3, "rounds": 3}, {"iters": 5 if cuda else 2, "rounds": 2})
    rows, notes = run_shapes(world, shapes, algos=args.algos, causals=causals, layout=args.layout,
                             progress=ctx.progress(len(shapes) * len(causals)), window=args.window, **knobs)
    if not ctx.lead:
        return []
    where = "bf16 CUDA tensors, CUDA events" if cuda else "float32 host tensors, host clock"
    ctx.header = (f"# cp-attention: {world.size} rank(s), {world.launch.launcher}, {where}, layout {args.layout}; "
                  f"ratio = {SINGLE} (one device, the whole sequence) / time; vs_blocking_ring = {BLOCKING} / ring "
                  f"(the overlap alone); vs_gather_sdpa = all-gather then SDPA / all_gather")
    ctx.extra.update(layout=args.layout, causal=args.causal, window=args.window)
    if args.window is not None:
        ctx.header += f"; window {args.window}: vs_gather = the whole KV gathered, then the pieces' spans / halo"
    ctx.notes += notes + ([_summary(rows)] if rows else []) + (_targets(world, rows) if args.window is None else [])
    return rows


def _summary(rows) -> str:
    lines = []
    for r in rows:
        if r.path == SINGLE or r.ratio is None:
            continue
        more = "".join(f", {r.extra[k]:.2f}x {k[3:]}" for k in ("vs_blocking_ring", "vs_gather_sdpa", "vs_gather")
                       if k in r.extra)
        lines.append(f"{r.op:<20} {r.extra['shape']:>18} {r.path:<32} {r.ratio:6.2f}x single-device{more}")
    return "\n".join(lines)
