"""``xelink bench gemm``: bf16 GEMM, xelink's paths next to ``torch.matmul``, co-measured in one run.

- CPU: ``gemm(a, b, impl="reference")`` (the pure-torch twin the GPU kernels are tested against) vs
  ``torch.matmul`` at small shapes, host clock, checked against float64.
- CUDA: ``gemm(impl="cuda")`` (the TMA kernel) and ``gemm(impl="triton")`` vs ``torch.matmul`` at 8192^3, 4096^3 and
  M x N x K = 16384 x 8192 x 1024 (``--quick``: 4096^3), CUDA events around back-to-back launches;
  ``--sweep`` adds tile configurations (tuning). Checked against float32 (``#wrong``: elements off by
  more than 2% of the value plus 2% of the output's RMS).
- CUDA, row blocks (op ``gemm:row-blocks``): ``gemm(a[r0:r1], b, out=c[r0:r1])`` for 2, 4 and 8 row blocks
  of one output back to back in a CUDA graph against one ``torch.matmul`` (the GEMMs of the pipelined
  distributed GEMM, issue 21) at 8192^3, 16384x8192x4096 and 2048x4096x4096 (``--quick``: the last).
- CUDA, gated (op ``gemm:gated``, issue 22): ``gated_gemm`` (the fused distributed GEMM's kernel) over 8
  chunks of rows against one ``torch.matmul``, in CUDA graphs, at the row-block shapes: every flag already
  set (targets >= 0.97x at 8192^3 and 16384x8192x4096, >= 0.9x at 2048x4096x4096), and the chunks copied
  in from another buffer by a copy-engine stream that sets each flag after its chunk (target: within 5%
  of the flags-set row, ``extra["vs_flags_set"]``); ``cuda`` and ``triton``; and ``cuda, 8 column slices``:
  the same copies as 8 column slices of all the rows (strided copy-engine copies, ``k_slices=8``), so every
  tile can start on the first slice. The arrival rows' flags are a ring of one set a call of the graph, the
  next call's zeroed on the copy stream after this call's copies (off the GEMM's path, as a pipeline resets
  its flags: the epochs of the fused distributed GEMM); checked after the measurement.
- CUDA, host time (op ``gemm:host``): the host time of one eager call of each path and of
  ``torch.matmul`` at 2048^3, b row-major and column-major (an ``nn.Linear`` weight's ``.t()``), the
  GPU kept busy (``kernel_timing.host_timing``); issue 20's target is torch's + 10 us. With b row-major
  also ``gated_gemm`` (flags set) and the ``scatter_gemm`` + ``scatter_reduce`` pair on one rank (two
  launches where torch has one).

Rank 0 runs the family while the other ranks wait.
"""
from __future__ import annotations

import functools

import torch

from ..harness import CUDA_ONLY, co_measure, make_row, summarize, time_cuda_events
from ..kernel_timing import (KernelReport, add_timing_arguments, cpu_rows, host_rows, host_timing,
                             measure_checked, run_single_device, timing, with_host_rows,
                             wrong_elements)

__all__ = ["GPU_SHAPES", "HOST_SHAPE", "QUICK_SHAPES", "ROW_BLOCK_SHAPES", "SHAPES", "add_arguments", "run", "run_cpu",
           "run_gated", "run_gpu", "run_host", "run_row_blocks"]

# CPU shapes, M, N, K: torch.matmul in bf16 is slow on CPUs without bf16 instructions (0.7 s at 512^3 here).
SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512))
QUICK_SHAPES = ((128, 128, 128), (256, 256, 256))
GPU_SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 1024))  # M, N, K
HOST_SHAPE = (2048, 2048, 2048)  # host-time rows: M, N, K
ROW_BLOCK_SHAPES = ((8192, 8192, 8192), (16384, 8192, 4096), (2048, 4096, 4096))  # gemm:row-blocks rows
_events = functools.partial(time_cuda_events, warmup=0)


def add_arguments(p) -> None:
    """The options of ``xelink bench gemm``."""
    add_timing_arguments(p, cpu="default 5, quick 3 (rounds 3, quick 2)", gpu="default 10 (rounds 3, quick or "
                                                                             "sweep 2)")
    g = p.add_argument_group(CUDA_ONLY)
    g.add_argument("--sweep", nargs="?", const="gemm", default=None, choices=("gemm",),
                   help="also time tile configurations of the cuda (TMA) and triton kernels (tuning)")


def run_cpu(shapes, *, iters: int, rounds: int, progress=None) -> list:
    """bf16 GEMM: xelink's reference path vs torch.matmul, checked against float64. Returns rows."""
    from ...kernels.gemm import gemm

    rows = []
    for M, N, K in shapes:
        g = torch.Generator().manual_seed(M * 7 + N * 3 + K)
        a = torch.randn(M, K, generator=g).to(torch.bfloat16)
        b = torch.randn(K, N, generator=g).to(torch.bfloat16)
        ref = (a.double() @ b.double()).float()
        variants = {"xelink:reference": lambda: gemm(a, b, impl="reference"), "torch:matmul": lambda: torch.matmul(a, b)}
        checks = {n: (lambda out: wrong_elements(out, ref)) for n in variants}
        samples, wrong = measure_checked(variants, checks, iters=iters, rounds=rounds)
        rows += cpu_rows("gemm", samples, wrong, "torch:matmul", size_bytes=2 * (M * K + K * N + M * N), count=M * N,
                         dtype=torch.bfloat16, flops=2.0 * M * N * K, extra={"shape": f"{M}x{N}x{K}"})
        if progress is not None:
            progress.step(f"gemm {M}x{N}x{K}")
    return rows


def run_gpu(report, shapes=GPU_SHAPES, iters: int = 10, rounds: int = 3, sweep: bool = False, progress=None) -> None:
    """Time ``gemm(impl="cuda"|"triton")`` (and with ``sweep`` tile configs) against torch.matmul on the
    current CUDA device, CUDA events; rows and notes into ``report`` (``kernel_timing.KernelReport``)."""
    from ...kernels.gemm import gemm

    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        outs = {}
        variants = {"torch:matmul": lambda: outs.__setitem__("torch:matmul", torch.matmul(a, b))}
        configs = {"xelink:cuda": ("cuda", None), "xelink:triton": ("triton", None)}
        if sweep:
            for bm, bn, bk, w, s in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                                     (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)):
                for impl in ("cuda", "triton"):
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s)
                    configs[f"xelink:{impl}[{bm}x{bn}x{bk},w{w},s{s}]"] = (impl, cfg)
        for name, (impl, cfg) in configs.items():
            def call(name=name, impl=impl, cfg=cfg):
                outs[name] = gemm(a, b, impl=impl, config=cfg)
            try:
                call()
            except Exception as e:  # noqa: BLE001 - a sweep config that does not fit is reported, not fatal
                if cfg is None:
                    raise
                report.notes.append(f"gemm {M}x{N}x{K} {name}: {type(e).__name__}: {str(e)[:120]}")
                continue
            variants[name] = call
        wrong = {}

        def check(name):
            wrong[name] = wrong.get(name, 0) + wrong_elements(outs[name], ref)

        ref = (a.float() @ b.float()) if M * N * K <= 4096 ** 3 else torch.matmul(a, b).float()
        samples = co_measure(variants, warmup=2, iters=iters, rounds=rounds, timing=_events, after_block=check)
        flops = 2.0 * M * N * K
        nbytes = 2 * (M * K + K * N + M * N)
        base = samples["torch:matmul"]
        for name, s in samples.items():
            t = summarize(s)["median"]
            report.add(make_row("gemm", name, s, size_bytes=nbytes, count=M * N, dtype=torch.bfloat16, nranks=1,
                                wrong=wrong.get(name, 0), baseline=None if name == "torch:matmul" else "torch:matmul",
                                baseline_samples=None if name == "torch:matmul" else base,
                                extra={"shape": f"{M}x{N}x{K}", "TFLOPs": flops / t / 1e12, "timing": "events"}))
        del a, b, outs, ref
        torch.cuda.empty_cache()
        if progress is not None:
            progress.step(f"gemm {M}x{N}x{K}: {len(variants)} variant(s)")


def _graph_rows(report, op: str, shape, calls: dict, outs: dict, ref, *, repeats: int, rounds: int,
                extra=None) -> bool:
    """Each of ``calls`` (name -> the calls of one round) captured ``repeats`` times in a CUDA graph and
    co-measured against ``torch:matmul``'s graph; rows ``op`` into ``report``, outputs (``outs[name]``)
    checked against ``ref``. ``extra(name, medians)``: more fields for a row. False when torch's own
    graph could not be made (nothing measured)."""
    from ..kernel_timing import cuda_graph

    M, N, K = shape
    graphs = {}
    for name, fns in calls.items():
        try:
            graphs[name] = cuda_graph(fns, repeats)[0].replay
        except Exception as e:  # noqa: BLE001 - reported, the other rows still run
            report.notes.append(f"{op} {M}x{N}x{K} {name}: {type(e).__name__}: {str(e)[:200]}")
    if "torch:matmul" not in graphs:
        return False
    wrong = {name: 0 for name in graphs}

    def check(name):
        wrong[name] += wrong_elements(outs[name], ref)

    samples = co_measure(graphs, warmup=1, iters=1, rounds=rounds, timing=_events, after_block=check)
    samples = {k: [t / repeats for t in v] for k, v in samples.items()}
    base = samples["torch:matmul"]
    med = {k: summarize(v)["median"] for k, v in samples.items()}
    for name, smp in samples.items():
        fields = {"shape": f"{M}x{N}x{K}", "TFLOPs": 2.0 * M * N * K / med[name] / 1e12,
                  "timing": f"CUDA graph of {repeats} x the calls, events", **(extra(name, med) if extra else {})}
        report.add(make_row(op, name, smp, size_bytes=2 * (M * K + K * N + M * N), count=M * N,
                            dtype=torch.bfloat16, nranks=1, wrong=wrong[name],
                            baseline=None if name == "torch:matmul" else "torch:matmul",
                            baseline_samples=None if name == "torch:matmul" else base, extra=fields))
    return True


def run_row_blocks(report, shapes=ROW_BLOCK_SHAPES, blocks=(2, 4, 8), *, repeats: int = 5, rounds: int = 3,
                   progress=None) -> None:
    """``gemm(a[r0:r1], b, out=c[r0:r1])`` for ``n`` row blocks of one output, launched back to back in a
    CUDA graph, against one ``torch.matmul`` in a graph (the GEMMs of the pipelined distributed GEMM,
    issue 21: >= 0.97x at 8192^3 and 16384x8192x4096); rows ``gemm:row-blocks`` into ``report``."""
    from ...kernels.gemm import gemm

    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.matmul(a, b).float()
        outs = {"torch:matmul": torch.empty(M, N, device="cuda", dtype=torch.bfloat16)}
        calls = {"torch:matmul": [lambda: torch.matmul(a, b, out=outs["torch:matmul"])]}
        for n in blocks:
            c = outs[f"xelink:gemm x{n} row blocks"] = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            edges = [M * i // n for i in range(n + 1)]
            calls[f"xelink:gemm x{n} row blocks"] = [
                (lambda r0=r0, r1=r1, c=c: gemm(a[r0:r1], b, out=c[r0:r1])) for r0, r1 in zip(edges, edges[1:])]
        _graph_rows(report, "gemm:row-blocks", (M, N, K), calls, outs, ref, repeats=repeats, rounds=rounds)
        del a, b, outs, ref
        torch.cuda.empty_cache()
        if progress is not None:
            progress.step(f"gemm row blocks {M}x{N}x{K}")


def run_gated(report, shapes=ROW_BLOCK_SHAPES, chunks: int = 8, *, repeats: int = 5, rounds: int = 3,
              progress=None, tiles=()) -> None:
    """``gated_gemm`` with every flag set and with copy-engine arrivals, against ``torch.matmul``, in CUDA
    graphs of ``repeats`` calls; rows ``gemm:gated`` into ``report`` (module docstring). Two ways the copy
    lands: ``chunks`` chunks of rows, and (the TMA kernel, tagged ``cuda, N column slices``) all rows in
    ``chunks`` column slices (``gated_gemm(k_slices=...)``: each a strided copy-engine copy, the same bytes a
    copy as a chunk of rows). ``tiles``: more TMA variants, each a ``gated_gemm(config=...)`` tile (tagged
    ``cuda BMxBN``)."""
    from ... import symm
    from ...kernels.gated_gemm import column_slices, gated_gemm

    # tag: (impl, tile, column slices)
    variants = {"cuda": ("cuda", None, 1), f"cuda, {chunks} column slices": ("cuda", None, chunks),
                "triton": ("triton", None, 1)}
    if torch.cuda.get_device_capability()[0] == 9:
        variants.update({f"cuda {t['BLOCK_M']}x{t['BLOCK_N']}": ("cuda", t, 1) for t in tiles})
    else:
        variants = {k: v for k, v in variants.items() if v[0] != "cuda"}
    for M, N, K in shapes:
        src = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        a = src.clone()
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.matmul(a, b).float()
        err = torch.zeros(1 + chunks, dtype=torch.int32, device="cuda")
        counts = torch.arange(1, chunks + 1, dtype=torch.int32, device="cuda")  # a flag's values, copied in
        side = torch.cuda.Stream()
        outs, rings = {"torch:matmul": torch.empty(M, N, device="cuda", dtype=torch.bfloat16)}, {}
        calls = {"torch:matmul": [lambda: torch.matmul(a, b, out=outs["torch:matmul"])]}
        for tag, (impl, tile, slices) in variants.items():
            # rows: `chunks` chunks of rows, a flag each (0 or 1); slices: one chunk of every row, its flag
            # counting the column slices landed
            rows, n_flags = (-(-M // chunks), chunks) if slices == 1 else (M, 1)
            opts = dict(chunk_rows=rows, k_slices=slices, error=err, impl=impl, timeout_ns=10**10, config=tile)
            set_flags = torch.full((n_flags,), slices, dtype=torch.int32, device="cuda")
            c = outs[f"xelink:gated({tag}) flags set"] = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            calls[f"xelink:gated({tag}) flags set"] = [
                lambda c=c, f=set_flags, o=opts: gated_gemm(a, b, f, out=c, **o)]
            # the flags of call i of the graph: ring[i % repeats] (the warm-up call is call 0); call i zeroes
            # call i + 1's after its copies, so the last call of a replay zeroes the first's of the next; each
            # set 16-byte aligned alike (gated_gemm's plan, made outside the capture, is keyed by the alignment)
            ring = rings[tag] = torch.zeros(repeats, -(-n_flags // 4) * 4, dtype=torch.int32,
                                            device="cuda")[:, :n_flags]
            c2 = outs[f"xelink:gated({tag}) copy-engine arrivals"] = torch.empty(M, N, device="cuda",
                                                                                 dtype=torch.bfloat16)

            def arrive(c=c2, ring=ring, o=opts, rows=rows, slices=slices, calls_made=[0]):
                i = calls_made[0]
                calls_made[0] += 1
                f, nxt = ring[i % repeats], ring[(i + 1) % repeats]
                main = torch.cuda.current_stream()  # the capture's stream inside a graph
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    if slices == 1:
                        for q in range(chunks):
                            a[q * rows:(q + 1) * rows].copy_(src[q * rows:(q + 1) * rows], non_blocking=True)
                            f[q:q + 1].copy_(counts[:1], non_blocking=True)
                    else:
                        pitch = a.stride(0) * a.element_size()
                        for s, (lo, hi) in enumerate(column_slices(K, slices)):
                            symm.copy_engine_2d(a[:, lo:].data_ptr(), pitch, src[:, lo:].data_ptr(), pitch,
                                                (hi - lo) * a.element_size(), M, side.cuda_stream)
                            f.copy_(counts[s:s + 1], non_blocking=True)
                    if repeats > 1:
                        nxt.zero_()
                gated_gemm(a, b, f, out=c, **o)
                main.wait_stream(side)
                if repeats == 1:
                    f.zero_()

            calls[f"xelink:gated({tag}) copy-engine arrivals"] = [arrive]

        def vs_flags_set(name, med):
            set_name = name.replace("copy-engine arrivals", "flags set")
            return {"chunks": chunks, **({"vs_flags_set": med[set_name] / med[name]}
                                         if set_name != name and set_name in med else {})}

        _graph_rows(report, "gemm:gated", (M, N, K), calls, outs, ref, repeats=repeats, rounds=rounds,
                    extra=vs_flags_set)
        for tag, ring in rings.items():  # after the replays: the first call's flags zeroed, the others' all set
            full = chunks if variants[tag][2] > 1 else 1
            want = torch.full_like(ring, full)
            want[1 % repeats] = 0
            if repeats > 1 and not torch.equal(ring, want):
                report.notes.append(f"gemm gated {M}x{N}x{K} {tag}: the flag ring is not as the calls leave it "
                                    f"(the arrival row's waits are not measured): {ring.tolist()}")
        if err.any():
            report.notes.append(f"gemm gated {M}x{N}x{K}: a wait ran past its deadline: {err.tolist()}")
        del a, b, src, outs, ref
        torch.cuda.empty_cache()
        if progress is not None:
            progress.step(f"gemm gated {M}x{N}x{K}")


def run_host(report, shape=HOST_SHAPE, *, calls: int = 100, rounds: int = 10, progress=None) -> None:
    """Host time of one eager ``gemm(impl=...)`` (each Triton path) and ``torch.matmul``, b row- and
    column-major; rows ``gemm:host`` into ``report``."""
    from ...kernels.gemm import gemm

    M, N, K = shape
    impls = ("cuda", "triton") if torch.cuda.get_device_capability()[0] == 9 else ("triton",)
    for layout in ("row-major b", "column-major b"):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        if layout == "column-major b":
            b = b.T.contiguous().T
        ref = a.float() @ b.float()
        variants = {"torch:matmul": lambda: torch.matmul(a, b)}
        variants.update({f"xelink:{impl}": functools.partial(gemm, a, b, impl=impl) for impl in impls})
        bases = {}
        if layout == "row-major b":
            # The fused reduce-scatter's two launches against torch's two (the product, then the reduction:
            # a copy into the output at world 1).
            dest = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            variants["torch:matmul+copy"] = lambda: dest.copy_(torch.matmul(a, b))
            fused = _fused_host_variants(a, b, impls)
            variants.update(fused)
            bases = {name: "torch:matmul+copy" for name in fused if name.startswith("xelink:scatter")}
        samples, wrong = host_timing(variants, {n: (lambda out: wrong_elements(out, ref)) for n in variants},
                                     calls=calls, rounds=rounds)
        for row in host_rows("gemm:host", samples, wrong, "torch:matmul", size_bytes=2 * (M * K + K * N + M * N),
                             count=M * N, dtype=torch.bfloat16, extra={"shape": f"{M}x{N}x{K}, {layout}"},
                             bases=bases):
            report.add(row)
        if progress is not None:
            progress.step(f"gemm host time {M}x{N}x{K}, {layout}")


def _fused_host_variants(a, b, impls, chunks: int = 8) -> dict:
    """Eager calls of the fused distributed GEMM's kernels on one device, for their host rows: ``gated_gemm``
    with every flag set, and ``scatter_gemm`` + ``scatter_reduce`` with this rank the only owner (two
    launches; world 1, so the inbox is local memory and the reduction a copy)."""
    from ...kernels.gated_gemm import gated_gemm
    from ...kernels.scatter_gemm import reduce_programs, scatter_gemm, scatter_geometry, scatter_reduce

    (M, K), N = a.shape, b.shape[1]
    dev = a.device
    flags = torch.ones(chunks, dtype=torch.int32, device=dev)
    err = torch.zeros(2 + chunks, dtype=torch.int32, device=dev)
    inbox = torch.empty(2, 1, M, N, dtype=a.dtype, device=dev)
    counters = torch.zeros(scatter_geometry(1, 1, M, N).chunks, dtype=torch.int32, device=dev)
    seen = torch.zeros(reduce_programs(dev), dtype=torch.int32, device=dev)
    out = torch.empty(M, N, dtype=a.dtype, device=dev)

    def pair(impl):
        scatter_gemm(a, b, [inbox], [counters], seen, rank=0, block_rows=M, block_stride=M, impl=impl)
        return scatter_reduce(inbox, counters, seen, out, error=err, block_rows=M, timeout_ns=10**10)

    variants = {}
    for impl in impls:
        variants[f"xelink:gated({impl})"] = functools.partial(gated_gemm, a, b, flags, chunk_rows=-(-M // chunks),
                                                              error=err, impl=impl, timeout_ns=10**10)
        variants[f"xelink:scatter+reduce({impl})"] = functools.partial(pair, impl)
    return variants


def _summary(rows) -> str:
    """One line per xelink path and shape: TFLOP/s and the ratio to torch."""
    return "\n".join(f"gemm {r.extra.get('shape', ''):>18} {r.path:<40} {r.extra['TFLOPs']:7.1f} TFLOP/s  vs torch "
                     f"{r.ratio:5.2f}x" for r in rows if r.path != "torch:matmul" and r.ratio is not None)


def _cpu(ctx) -> list:
    shapes = QUICK_SHAPES if ctx.quick else SHAPES
    return run_cpu(shapes, progress=ctx.progress(len(shapes)),
                   **timing(ctx, {"iters": 5, "rounds": 3}, {"iters": 3, "rounds": 2}))


def _gpu(ctx) -> list:
    sweep = bool(ctx.args.sweep)
    shapes = GPU_SHAPES[1:2] if ctx.quick else GPU_SHAPES
    report = KernelReport()
    ctx.extra["sweep"] = sweep
    blocks = ROW_BLOCK_SHAPES[2:] if ctx.quick else ROW_BLOCK_SHAPES
    progress = ctx.progress(len(shapes) + 2 * len(blocks) + 2)
    run_gpu(report, shapes, sweep=sweep, progress=progress,
            **timing(ctx, {"iters": 10, "rounds": 2 if ctx.quick or sweep else 3}))
    run_row_blocks(report, blocks, rounds=2 if ctx.quick else 3, progress=progress)
    run_gated(report, blocks, rounds=2 if ctx.quick else 3, progress=progress)
    return with_host_rows(ctx, report, _summary(report.rows), run_host, progress)


def run(ctx) -> list:
    """The gemm family (CPU reference run, or the GPU benchmark on CUDA); rows on rank 0. Collective."""
    return run_single_device(ctx, cpu=_cpu, gpu=_gpu)
