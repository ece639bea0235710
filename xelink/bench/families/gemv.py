"""``xelink bench gemv``: GEMV with bf16, W8A16 and W4A16 weights, xelink's paths next to torch's bf16 GEMV.

- CPU: ``gemv(w, x, scales, fmt, impl="reference")`` for the three weight formats (the row's dtype),
  1 and 8 rows, vs ``torch.matmul(x, W.T)`` on the bf16 weight, host clock, checked against float64;
  GB/s counts the bytes read.
- CUDA: W [N, K] at 4096x4096, 14336x4096, 4096x14336 and 128256x4096 (``--quick``: the first), M = 1
  and 8 rows: bf16 ``gemv(impl=...)`` vs ``torch.matmul(x, W.T)``, and W8A16 / W4A16 vs the same torch
  bf16 GEMV, each path with programmatic dependent launch (sm90 default) and without. Timed inside CUDA
  graphs (each graph replays every one of 8 rotating weight copies several times, so the weights come
  from HBM, not L2). ``--sweep`` adds tuning variants: ``gemv`` every kernel's tiles, ``gemv-tc`` the
  tensor-core kernel's, ``gemv-pdl`` the go for the next kernel early or late. Checked against float32
  (``#wrong``: elements off by more than 2% of the value plus 2% of the output's RMS).
- CUDA, host time (op ``gemv:host``): the host time of one eager call of each path (impl cuda and
  triton, every weight format) and of torch's bf16 ``x @ w.t()``, W 4096x4096, 1 and 8 rows, the GPU kept
  busy (``kernel_timing.host_timing``); issue 20's target is torch's + 10 us.

Rank 0 runs the family while the other ranks wait.
"""
from __future__ import annotations

import functools

import torch

from ..harness import CUDA_ONLY, co_measure, make_row, time_cuda_events
from ..kernel_timing import (KernelReport, add_timing_arguments, cpu_rows, cuda_graph, host_rows,
                             host_timing, measure_checked, run_single_device, timing, with_host_rows,
                             wrong_elements)

__all__ = ["COPIES", "GPU_ROWS", "GPU_SHAPES", "HOST_SHAPE", "QUICK_SHAPES", "ROWS", "SHAPES", "SWEEPS",
           "add_arguments", "gemv_sweep", "run", "run_cpu", "run_gpu", "run_host"]

SHAPES = ((1024, 1024), (4096, 4096))  # CPU: N, K (rows 1 and 8 each)
QUICK_SHAPES = ((1024, 1024),)
ROWS = (1, 8)
GPU_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))  # N, K
GPU_ROWS = (1, 8)
COPIES = 8  # rotating weight copies for GEMV
HOST_SHAPE = (4096, 4096)  # host-time rows: N, K (rows GPU_ROWS)
# --sweep NAME -> gemv_sweep's kind
SWEEPS = {"gemv": "all", "gemv-tc": "tc", "gemv-pdl": "pdl"}
_events = functools.partial(time_cuda_events, warmup=0)


def add_arguments(p) -> None:
    """The options of ``xelink bench gemv``."""
    add_timing_arguments(p, cpu="default 5, quick 3 (rounds 3, quick 2)", gpu="default 10 (rounds 3, quick or "
                                                                             "sweep 2)")
    g = p.add_argument_group(CUDA_ONLY)
    g.add_argument("--sweep", nargs="?", const="gemv", default=None, choices=tuple(SWEEPS),
                   help="also time tuning variants: gemv (every kernel's tiles, the default), gemv-tc (the "
                        "tensor-core kernel's), gemv-pdl (programmatic dependent launch: the next kernel's go "
                        "early or late)")


def run_cpu(shapes, *, iters: int, rounds: int, rows_per=ROWS, progress=None) -> list:
    """GEMV with bf16, W8A16 and W4A16 weights (reference path) vs torch.matmul on the bf16 weight."""
    from ...kernels.gemv import gemv, pack_w4a16, pack_w8a16, unpack_w4a16, unpack_w8a16

    out_rows = []
    for N, K in shapes:
        g = torch.Generator().manual_seed(N + K)
        w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
        q8, s8 = pack_w8a16(w)
        q4, s4 = pack_w4a16(w)
        packs = {"bf16": (w, None, w.double()), "w8a16": (q8, s8, unpack_w8a16(q8, s8).double()),
                 "w4a16": (q4, s4, unpack_w4a16(q4, s4).double())}
        wbytes = {"bf16": 2 * N * K, "w8a16": N * K + 2 * N, "w4a16": N * K // 2 + 2 * N * (K // 128)}
        for M in rows_per:
            x = torch.randn(M, K, generator=g).to(torch.bfloat16)
            for fmt, (wq, scales, exact) in packs.items():
                ref = (x.double() @ exact.T).float()
                variants = {"xelink:reference": lambda wq=wq, s=scales, f=fmt: gemv(wq, x, s, f, impl="reference"),
                            "torch:matmul(bf16)": lambda: torch.matmul(x, w.T)}
                dense = (x.double() @ w.double().T).float()
                checks = {"xelink:reference": lambda out, r=ref: wrong_elements(out, r),
                          "torch:matmul(bf16)": lambda out: wrong_elements(out, dense)}
                samples, wrong = measure_checked(variants, checks, iters=iters, rounds=rounds)
                out_rows += cpu_rows("gemv", samples, wrong, "torch:matmul(bf16)",
                                     size_bytes=wbytes[fmt] + 2 * M * K + 2 * M * N, count=M * N, dtype=fmt,
                                     flops=None, extra={"shape": f"N={N},K={K},M={M}"})
            if progress is not None:
                progress.step(f"gemv N={N} K={K} M={M}: bf16, w8a16, w4a16")
    return out_rows


def run_gpu(report, shapes=GPU_SHAPES, rows=GPU_ROWS, copies: int = COPIES, repeats: int = 4,
            iters: int = 10, rounds: int = 3, sweep: str = "", progress=None) -> None:
    """Time gemv against torch's bf16 GEMV in CUDA graphs; rows and notes into ``report``. ``sweep``: ""
    (defaults only), "all" (every kernel's tuning variants), "tc" (the tensor-core kernel's) or "pdl"
    (``gemv_sweep``)."""
    from ...kernels.gemv import (gemv, pack_w4a16, pack_w8a16, tile_w4a16, tiled_w4a16_native, unpack_w4a16,
                                 unpack_w8a16)

    for N, K in shapes:
        gen = torch.Generator(device="cuda").manual_seed(N + K)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05 for _ in range(copies)]
        w8 = [pack_w8a16(w) for w in ws]
        w4 = [pack_w4a16(w) for w in ws]
        # the W4A16 weights in tiles (what Llama loads on CUDA), where the tensor-core kernel reads them in place
        w4t = [(tile_w4a16(p), s) for p, s in w4] if N % 16 == 0 and tiled_w4a16_native(ws[0].device) else None
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            refs = {"bf16": [x.float() @ w.float().T for w in ws],
                    "w8a16": [x.float() @ unpack_w8a16(q, s).T for q, s in w8],
                    "w4a16": [x.float() @ unpack_w4a16(p, s).T for p, s in w4]}
            refs["w4a16t"] = refs["w4a16"]
            plans = {"torch:matmul": ("bf16", None, None)}
            for impl in ("cuda", "triton"):
                for fmt in ("bf16", "w8a16", "w4a16"):
                    if fmt == "bf16" and impl == "triton":
                        continue  # the same kernel as "cuda" for dense weights
                    plans[f"xelink:{impl}:{fmt}"] = (fmt, impl, None)
            if w4t is not None:
                plans["xelink:cuda:w4a16t"] = ("w4a16t", "cuda", None)
            if torch.cuda.get_device_capability() >= (9, 0):
                for fmt in ("bf16", "w8a16", "w4a16"):  # the default tiles without programmatic dependent launch
                    plans[f"xelink:cuda:{fmt}[PDL=False]"] = (fmt, "cuda", dict(PDL=False))
            if sweep:
                for fmt in ("bf16", "w8a16", "w4a16"):
                    for cfg in gemv_sweep(N, K, fmt, M, sweep):
                        tag = ",".join(f"{k}={v}" for k, v in cfg.items())
                        plans[f"xelink:cuda:{fmt}[{tag}]"] = (fmt, "cuda", cfg)
            graphs, outs, launches = {}, {}, {}
            for name, (fmt, impl, cfg) in plans.items():
                if impl is None:
                    calls = [functools.partial(torch.matmul, x, w.T) for w in ws]
                else:
                    packs = {"bf16": [(w, None) for w in ws], "w8a16": w8, "w4a16": w4, "w4a16t": w4t}[fmt]
                    calls = [functools.partial(gemv, wq, x, s, fmt, impl, config=cfg) for wq, s in packs]
                try:
                    graphs[name], outs[name], launches[name] = cuda_graph(calls, repeats)
                except Exception as e:  # noqa: BLE001 - a sweep config that does not fit is reported, not fatal
                    if cfg is None:
                        raise
                    report.notes.append(f"gemv {N}x{K} M={M} {name}: {type(e).__name__}: {str(e)[:120]}")
            wrong = {}

            def check(name):
                fmt = plans[name][0]
                wrong[name] = wrong.get(name, 0) + sum(wrong_elements(o, r) for o, r in zip(outs[name], refs[fmt]))

            samples = co_measure({n: g.replay for n, g in graphs.items()}, warmup=1, iters=iters, rounds=rounds,
                                 timing=_events, after_block=check)
            base = [t / launches["torch:matmul"] for t in samples["torch:matmul"]]
            for name, s in samples.items():
                fmt, impl, cfg = plans[name]
                per_call = [t / launches[name] for t in s]
                wbytes = {"bf16": 2 * N * K, "w8a16": N * K + 2 * N}.get(fmt, N * K // 2 + 2 * N * (K // 128))
                nbytes = wbytes + 2 * M * K + 2 * M * N
                is_base = name == "torch:matmul"
                report.add(make_row("gemv", name, per_call, size_bytes=nbytes, count=M * N, dtype=fmt, nranks=1,
                                    wrong=wrong.get(name, 0), baseline=None if is_base else "torch:matmul(bf16)",
                                    baseline_samples=None if is_base else base,
                                    extra={"shape": f"N={N},K={K},M={M}", "timing": "cuda-graph",
                                           "copies": copies, "config": cfg}))
            del graphs, outs, refs, x
            if progress is not None:
                progress.step(f"gemv N={N} K={K} M={M}: {len(plans)} path(s)")
        del ws, w8, w4, w4t
        torch.cuda.empty_cache()


def run_host(report, shape=HOST_SHAPE, rows=GPU_ROWS, *, calls: int = 100, rounds: int = 10, progress=None) -> None:
    """Host time of one eager ``gemv`` (impl cuda and triton, each weight format) and torch's bf16
    ``x @ w.t()``; rows ``gemv:host`` into ``report``."""
    from ...kernels.gemv import gemv, pack_w4a16, pack_w8a16, tile_w4a16, tiled_w4a16_native, unpack_w4a16, unpack_w8a16

    N, K = shape
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
    (q8, s8), (q4, s4) = pack_w8a16(w), pack_w4a16(w)
    packs = {"bf16": (w, None, w.float()), "w8a16": (q8, s8, unpack_w8a16(q8, s8)),
             "w4a16": (q4, s4, unpack_w4a16(q4, s4))}  # fmt -> (weight, scales, the exact float32 weight)
    if N % 16 == 0 and tiled_w4a16_native(w.device):  # the tiles Llama loads on CUDA (impl cuda: read in place)
        packs["w4a16t"] = (tile_w4a16(q4), s4, packs["w4a16"][2])
    for M in rows:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        refs = {fmt: x.float() @ exact.T for fmt, (_, _, exact) in packs.items()}
        variants = {"torch:matmul(bf16)": lambda: x @ w.t()}
        checks = {"torch:matmul(bf16)": lambda out: wrong_elements(out, refs["bf16"])}
        for impl in ("cuda", "triton"):
            for fmt, (wq, scales, _) in packs.items():
                if fmt == "w4a16t" and impl == "triton":
                    continue  # (the Triton path reads a row-layout copy of tiles)
                name = f"xelink:{impl}:{fmt}"
                variants[name] = functools.partial(gemv, wq, x, scales, fmt, impl)
                checks[name] = functools.partial(lambda out, f: wrong_elements(out, refs[f]), f=fmt)
        samples, wrong = host_timing(variants, checks, calls=calls, rounds=rounds)
        for row in host_rows("gemv:host", samples, wrong, "torch:matmul(bf16)", size_bytes=2 * (N * K + M * K + M * N),
                             count=M * N, dtype=torch.bfloat16, extra={"shape": f"N={N},K={K},M={M}"}):
            report.add(row)
        if progress is not None:
            progress.step(f"gemv host time N={N} K={K} M={M}")


def gemv_sweep(N: int, K: int, fmt: str, M: int, sweep: str = "all"):
    """Tuning variants of gemv's config: CUDA-core (``fma``) and tensor-core (``mma``) tiles
    (BLOCK_N, BLOCK_K, num_warps, num_stages), each with the K split of ``gemv.split_k``; ``sweep="tc"``:
    the tensor-core kernel's only; ``"pdl"``: the default tiles with the go for the next kernel early or late."""
    from ...kernels.gemv import split_k
    from ...kernels.gemv_tc import tc_config

    if sweep == "pdl":
        yield from (dict(PDL="early"), dict(PDL="late"))
        return
    tc_only = sweep == "tc"

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fma = {"bf16": [(2, 1024, 4, 1), (2, 1024, 4, 3), (4, 1024, 4, 2), (4, 512, 4, 3), (8, 512, 4, 3),
                    (8, 1024, 8, 2)],
           "w8a16": [(8, 2048, 4, 1), (4, 1024, 4, 3), (8, 1024, 4, 2), (16, 512, 4, 3)],
           "w4a16": []}[fmt]
    mma = {"bf16": [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3),
                    (64, 256, 4, 3), (64, 128, 4, 4)],
           "w8a16": [(16, 256, 4, 3), (32, 256, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3)],
           "w4a16": [(16, 512, 4, 3), (32, 512, 4, 3), (64, 512, 4, 3), (64, 512, 4, 1), (32, 512, 4, 1)]}[fmt]
    words = [(8, 512, 1, 1), (16, 512, 1, 1), (32, 512, 1, 1), (16, 1024, 1, 1), (32, 1024, 1, 1),
             (16, 1024, 2, 1), (32, 1024, 4, 1), (16, 2048, 4, 1)] if fmt != "bf16" and M <= 4 else []
    if M > 4 and fmt != "bf16":
        fma = []  # 8 FMAs a weight: the CUDA cores cannot keep up with quantized weights
    fold = [(32, 512, 4, 3), (64, 256, 4, 3), (64, 512, 4, 3), (128, 256, 4, 3)] if fmt == "w4a16" else []
    if tc_only:
        fma = words = mma = fold = []
    tc = [dict(), dict(UNROLL=1), dict(UNROLL=2), dict(num_warps=4), dict(num_warps=8), dict(num_warps=16),
          dict(ROW_TILES=1), dict(ROW_TILES=2, UNROLL=2), dict(ROW_TILES=4, UNROLL=1)]
    if fmt == "w4a16":
        tc += [dict(ROW_TILES=4, UNROLL=1, BIASED=False), dict(ROW_TILES=1, BIASED=True)]
    for extra in tc:
        cfg = dict(KERNEL="tc", **tc_config(M, N, K, fmt, sms, extra.get("ROW_TILES"), extra.get("num_warps"),
                                            extra.get("UNROLL")))
        yield dict(cfg, **{k: v for k, v in extra.items() if k == "BIASED"})
    for kernel, tiles in (("fma", fma), ("words", words), ("mma", mma), ("mma-fold", fold)):
        for bn, bk, warps, stages in tiles:
            cfg = dict(KERNEL=kernel.split("-")[0], BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                       SPLIT_K=split_k(N, K, bn, bk, sms, warps))
            if kernel == "mma-fold":
                cfg["FOLD"] = True
            yield cfg


def _summary(rows) -> str:
    """One line per xelink path and shape: time, GB/s and the ratio to torch's bf16 GEMV."""
    return "\n".join(f"gemv {r.extra.get('shape', ''):>24} {r.path:<52} {r.time_us:8.2f} us {r.algbw_GBps:7.0f} GB/s  "
                     f"vs torch bf16 {r.ratio:5.2f}x" for r in rows if r.path != "torch:matmul" and r.ratio is not None)


def _cpu(ctx) -> list:
    shapes = QUICK_SHAPES if ctx.quick else SHAPES
    return run_cpu(shapes, progress=ctx.progress(len(shapes) * len(ROWS)),
                   **timing(ctx, {"iters": 5, "rounds": 3}, {"iters": 3, "rounds": 2}))


def _gpu(ctx) -> list:
    sweep = SWEEPS.get(ctx.args.sweep or "", "")
    shapes = GPU_SHAPES[:1] if ctx.quick else GPU_SHAPES
    report = KernelReport()
    ctx.extra["sweep"] = ctx.args.sweep
    progress = ctx.progress((len(shapes) + 1) * len(GPU_ROWS))
    run_gpu(report, shapes, sweep=sweep, progress=progress,
            **timing(ctx, {"iters": 10, "rounds": 2 if ctx.quick or sweep else 3}))
    return with_host_rows(ctx, report, _summary(report.rows), run_host, progress)


def run(ctx) -> list:
    """The gemv family (CPU reference run, or the GPU benchmark on CUDA); rows on rank 0. Collective."""
    return run_single_device(ctx, cpu=_cpu, gpu=_gpu)
