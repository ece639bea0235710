"""Local-kernel benchmark: xelink's named Triton paths against torch, co-measured in one run.

``python -m xelink.bench.kernels [--only gemm,gemv,norm,decode] [--out DIR] [--quick] [--sweep]``

- GEMM bf16 at 8192^3, 4096^3 and M x N x K = 16384 x 8192 x 1024: ``gemm(impl="hopper")`` and
  ``gemm(impl="triton")`` vs ``torch.matmul``, CUDA events around back-to-back launches.
- GEMV W [N, K] at 4096x4096, 14336x4096, 4096x14336 and 128256x4096, M = 1 and 8 rows: bf16
  ``gemv(impl=...)`` vs ``torch.matmul(x, W.T)``, and W8A16 / W4A16 vs the same torch bf16 GEMV.
  Timed inside CUDA graphs (each graph replays every one of 8 rotating weight copies several times,
  so the weights come from HBM, not L2).
- RMSNorm on 8192x4096 bf16 (with and without the fused residual) and RoPE on q 1x32x8192x128,
  k 1x8x8192x128: vs torch eager and vs ``copy_`` of the same number of bytes (all reads + all
  writes), which gives the bandwidth the machine reaches in this run; eager and CUDA-graph timings.
- A decode layer's chain at one token (``xelink.models.decode_layers`` at ``LLAMA3_8B``: W4A16, the
  activation left out: residual RMSNorm, QKV GEMV, RoPE, decode attention over 4096 cached tokens, O GEMV,
  residual RMSNorm, gate/up GEMV, down GEMV), four layers in a CUDA graph, with programmatic dependent
  launch on every kernel, on the GEMVs only, and off (the baseline); checked against the layer's
  pure-torch twin (``reference_decode_layers``).

The outputs of the timed runs are checked against a float32 torch computation (``#wrong`` counts
elements off by more than 2% of the value plus 2% of the output's RMS). Rows go to a JSON Lines file
with the run manifest; a table is printed. Ratios are baseline time / xelink time (> 1: xelink faster);
``bw_vs_copy`` is xelink's bandwidth over copy_'s.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from .harness import JsonlWriter, co_measure, format_table, make_row, manifest, summarize, time_cuda_events

__all__ = ["main", "run_decode", "run_gemm", "run_gemv", "run_norm", "GEMM_SHAPES", "GEMV_SHAPES"]

GEMM_SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 1024))  # M, N, K
GEMV_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))  # N, K
GEMV_ROWS = (1, 8)
COPIES = 8  # rotating weight copies for GEMV
_events = functools.partial(time_cuda_events, warmup=0)


def _wrong(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements of ``out`` farther from ``ref`` (float32) than 2% of the value plus 2% of ref's RMS."""
    ref = ref.float()
    tol = 0.02 * ref.abs() + 0.02 * ref.pow(2).mean().sqrt()
    diff = (out.float() - ref).abs()
    return int((~(diff <= tol)).sum())  # NaN counts as wrong


def _graph(calls, repeats: int):
    """A CUDA graph that runs every call ``repeats`` times; returns (graph, last outputs, launches)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # compile and warm outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = None
        for _ in range(repeats):
            outs = [call() for call in calls]
    return graph, outs, repeats * len(calls)


class _Report:
    def __init__(self, writer: JsonlWriter | None):
        self.rows, self.writer, self.notes = [], writer, []

    def add(self, row):
        self.rows.append(row)
        if self.writer is not None:
            self.writer.write(row)


# -- GEMM -------------------------------------------------------------------------------------------

def run_gemm(report: _Report, shapes=GEMM_SHAPES, iters: int = 10, rounds: int = 3, sweep: bool = False) -> None:
    from ..kernels.gemm import gemm

    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        outs = {}
        variants = {"torch:matmul": lambda: outs.__setitem__("torch:matmul", torch.matmul(a, b))}
        configs = {"xelink:hopper": ("hopper", None), "xelink:triton": ("triton", None)}
        if sweep:
            for bm, bn, bk, w, s in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                                     (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)):
                for impl in ("hopper", "triton"):
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
            wrong[name] = wrong.get(name, 0) + _wrong(outs[name], ref)

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


# -- GEMV -------------------------------------------------------------------------------------------

def run_gemv(report: _Report, shapes=GEMV_SHAPES, rows=GEMV_ROWS, copies: int = COPIES, repeats: int = 4,
             iters: int = 10, rounds: int = 3, sweep: str = "") -> None:
    """Time gemv against torch's bf16 GEMV in CUDA graphs; ``sweep``: "" (defaults only), "all" (every
    kernel's tuning variants) or "tc" (the tensor-core kernel's)."""
    from ..kernels.gemv import gemv, pack_w4a16, pack_w8a16, unpack_w4a16, unpack_w8a16

    for N, K in shapes:
        gen = torch.Generator(device="cuda").manual_seed(N + K)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05 for _ in range(copies)]
        w8 = [pack_w8a16(w) for w in ws]
        w4 = [pack_w4a16(w) for w in ws]
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            refs = {"bf16": [x.float() @ w.float().T for w in ws],
                    "w8a16": [x.float() @ unpack_w8a16(q, s).T for q, s in w8],
                    "w4a16": [x.float() @ unpack_w4a16(p, s).T for p, s in w4]}
            plans = {"torch:matmul": ("bf16", None, None)}
            for impl in ("cuda", "triton"):
                for fmt in ("bf16", "w8a16", "w4a16"):
                    if fmt == "bf16" and impl == "triton":
                        continue  # the same kernel as "cuda" for dense weights
                    plans[f"xelink:{impl}:{fmt}"] = (fmt, impl, None)
            if torch.cuda.get_device_capability() >= (9, 0):
                for fmt in ("bf16", "w8a16", "w4a16"):  # the default tiles without programmatic dependent launch
                    plans[f"xelink:cuda:{fmt}[PDL=False]"] = (fmt, "cuda", dict(PDL=False))
            if sweep:
                for fmt in ("bf16", "w8a16", "w4a16"):
                    for cfg in _gemv_sweep(N, K, fmt, M, sweep):
                        tag = ",".join(f"{k}={v}" for k, v in cfg.items())
                        plans[f"xelink:cuda:{fmt}[{tag}]"] = (fmt, "cuda", cfg)
            graphs, outs, launches = {}, {}, {}
            for name, (fmt, impl, cfg) in plans.items():
                if impl is None:
                    calls = [functools.partial(torch.matmul, x, w.T) for w in ws]
                else:
                    packs = {"bf16": [(w, None) for w in ws], "w8a16": w8, "w4a16": w4}[fmt]
                    calls = [functools.partial(gemv, wq, x, s, fmt, impl, config=cfg) for wq, s in packs]
                try:
                    graphs[name], outs[name], launches[name] = _graph(calls, repeats)
                except Exception as e:  # noqa: BLE001 - a sweep config that does not fit is reported, not fatal
                    if cfg is None:
                        raise
                    report.notes.append(f"gemv {N}x{K} M={M} {name}: {type(e).__name__}: {str(e)[:120]}")
            wrong = {}

            def check(name):
                fmt = plans[name][0]
                wrong[name] = wrong.get(name, 0) + sum(_wrong(o, r) for o, r in zip(outs[name], refs[fmt]))

            samples = co_measure({n: g.replay for n, g in graphs.items()}, warmup=1, iters=iters, rounds=rounds,
                                 timing=_events, after_block=check)
            base = [t / launches["torch:matmul"] for t in samples["torch:matmul"]]
            for name, s in samples.items():
                fmt, impl, cfg = plans[name]
                per_call = [t / launches[name] for t in s]
                wbytes = {"bf16": 2 * N * K, "w8a16": N * K + 2 * N, "w4a16": N * K // 2 + 2 * N * (K // 128)}[fmt]
                nbytes = wbytes + 2 * M * K + 2 * M * N
                is_base = name == "torch:matmul"
                report.add(make_row("gemv", name, per_call, size_bytes=nbytes, count=M * N, dtype=fmt, nranks=1,
                                    wrong=wrong.get(name, 0), baseline=None if is_base else "torch:matmul(bf16)",
                                    baseline_samples=None if is_base else base,
                                    extra={"shape": f"N={N},K={K},M={M}", "timing": "cuda-graph",
                                           "copies": copies, "config": cfg}))
            del graphs, outs, refs, x
        del ws, w8, w4
        torch.cuda.empty_cache()


def _gemv_sweep(N: int, K: int, fmt: str, M: int, sweep: str = "all"):
    """Tuning variants of gemv's config: CUDA-core (``fma``) and tensor-core (``mma``) tiles
    (BLOCK_N, BLOCK_K, num_warps, num_stages), each with the K split of ``gemv.split_k``; ``sweep="tc"``:
    the tensor-core kernel's only; ``"pdl"``: the default tiles with the go for the next kernel early or late."""
    from ..kernels.gemv import split_k
    from ..kernels.gemv_tc import tc_config

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


# -- a decode layer's chain of kernels ------------------------------------------------------------------

def run_decode(report: _Report, layers: int = 4, iters: int = 10, rounds: int = 3, config=None) -> None:
    """Time a chain of decode layers (``xelink.models.decode_layers``: ``layers`` distinct weight and cache
    sets, more bytes than L2; default config ``LLAMA3_8B``) in a CUDA graph with programmatic dependent launch
    on every kernel (the sm90 default), on the GEMVs only, and on none, all in the same run; the baseline is
    the chain without it. Outputs checked against ``reference_decode_layers``."""
    from ..models import LLAMA3_8B, DecodeLayerWeights, decode_layers, reference_decode_layers

    cfg = config or LLAMA3_8B
    D = cfg.head_dim
    gen = torch.Generator(device="cuda").manual_seed(7)
    weights = [DecodeLayerWeights.random(cfg, device="cuda", generator=gen) for _ in range(layers)]
    lens = torch.tensor([cfg.context], device="cuda")
    x0 = torch.randn(1, cfg.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    angle = torch.rand(1, D // 2, device="cuda", generator=gen) * 6.28
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()

    def chain(norm_pdl, gemv_pdl):
        return decode_layers(x0, weights, cos, sin, lens, pdl=norm_pdl, gemv_pdl=gemv_pdl)[0]

    ref = reference_decode_layers(x0, weights, cos, sin, lens)[0].float()
    plans = {"xelink:pdl=off": (False, False), "xelink:pdl=gemv": (False, True),
             "xelink:pdl=all": (None, True)}
    graphs, outs, launches = {}, {}, {}
    for name, (norm_pdl, gemv_pdl) in plans.items():
        graphs[name], outs[name], launches[name] = _graph([functools.partial(chain, norm_pdl, gemv_pdl)], 4)
    wrong = {}

    def check(name):
        wrong[name] = wrong.get(name, 0) + _wrong(outs[name][0], ref)

    samples = co_measure({n: g.replay for n, g in graphs.items()}, warmup=1, iters=iters, rounds=rounds,
                         timing=_events, after_block=check)
    base = [t / (launches["xelink:pdl=off"] * layers) for t in samples["xelink:pdl=off"]]
    lw = weights[0]
    wbytes = sum(w[0].numel() + 2 * w[1].numel() for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
    wbytes += 2 * (lw.k_cache.numel() + lw.v_cache.numel())
    for name, s in samples.items():
        is_base = name == "xelink:pdl=off"
        report.add(make_row("decode-layer", name, [t / (launches[name] * layers) for t in s],
                            size_bytes=wbytes, count=1, dtype="w4a16", nranks=1, wrong=wrong.get(name, 0),
                            baseline=None if is_base else "xelink:pdl=off", baseline_samples=None if is_base else base,
                            extra={"shape": f"H={cfg.hidden},heads={cfg.heads}/{cfg.kv_heads},ffn={cfg.ffn},"
                                            f"context={cfg.context},M=1",
                                   "timing": "cuda-graph", "layers": layers, "per": "layer"}))
    del graphs, outs, weights
    torch.cuda.empty_cache()


# -- RMSNorm / RoPE -----------------------------------------------------------------------------------

def _torch_rmsnorm(x, w, eps, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
    return out if residual is None else (out, x)


def _torch_rope(q, k, cos, sin):
    c, s = cos[None, None], sin[None, None]

    def rot(t):
        t1, t2 = t.chunk(2, dim=-1)
        return t * c + torch.cat((-t2, t1), dim=-1) * s

    return rot(q), rot(k)


def _bandwidth_case(report: _Report, op: str, label: str, nbytes: int, variants: dict, checks: dict,
                    iters: int, rounds: int) -> None:
    """Time ``variants`` (eager and in CUDA graphs) next to copy_ of ``nbytes``.

    ``variants``: name -> fn(i) running on rotating input set i and returning its output;
    ``checks``: name -> fn(i, output) -> wrong elements, applied to the outputs of the timed runs.
    """
    sets = 3  # rotating input sets, each larger than L2 at these sizes
    half = nbytes // 2 // 2  # bf16 elements read (= written) by the copy
    src = [torch.randn(half, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    dst = [torch.empty_like(t) for t in src]
    state, latest, captured = {"i": 0}, {}, {}

    def rotate(name, fn):
        def call():
            state["i"] = (state["i"] + 1) % sets
            latest[name] = (state["i"], fn(state["i"]))
            return latest[name][1]
        return call

    eager = {"torch:copy_": rotate("torch:copy_", lambda i: dst[i].copy_(src[i]))}
    eager.update({name: rotate(name, fn) for name, fn in variants.items()})
    graphs, launches = {}, {}
    for name, fn in eager.items():
        graphs[name], _, launches[name] = _graph([fn] * sets, 4)
        captured[name] = latest[name]  # the graph's own output buffers, refilled by every replay
    wrong = {}

    def check(key):
        name, mode = key.split("@")
        if name in checks:
            i, out = (captured if mode == "graph" else latest)[name]
            wrong[key] = wrong.get(key, 0) + checks[name](i, out)

    timed = {f"{n}@eager": f for n, f in eager.items()}
    timed.update({f"{n}@graph": g.replay for n, g in graphs.items()})
    samples = co_measure(timed, warmup=2, iters=iters, rounds=rounds, timing=_events, after_block=check)
    torch_names = [n for n in eager if n.startswith("torch:") and n != "torch:copy_"]
    for mode in ("eager", "graph"):
        per = {n: [t / (launches[n] if mode == "graph" else 1) for t in samples[f"{n}@{mode}"]] for n in eager}
        copy_t = summarize(per["torch:copy_"])["median"]
        for name, s in per.items():
            t = summarize(s)["median"]
            base = None if name.startswith("torch:") else torch_names[0]
            report.add(make_row(op, name, s, size_bytes=nbytes, count=nbytes // 2, dtype=torch.bfloat16, nranks=1,
                                wrong=wrong.get(f"{name}@{mode}", 0), baseline=base,
                                baseline_samples=None if base is None else per[base],
                                extra={"shape": label, "timing": mode, "bw_vs_copy": copy_t / t,
                                       "speedup_vs": {n: summarize(per[n])["median"] / t for n in torch_names}}))
    del src, dst


def run_norm(report: _Report, iters: int = 10, rounds: int = 3) -> None:
    from ..kernels.norm import rmsnorm, rope

    rows, H, eps = 8192, 4096, 1e-6
    xs = [torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    rs = [torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    def checker(residual: bool):
        def check(i, out):
            if residual:
                h = (xs[i].float() + rs[i].float()).to(torch.bfloat16).float()
                ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()
                return _wrong(out[0], ref) + _wrong(out[1], h)
            xf = xs[i].float()
            return _wrong(out, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float())
        return check

    act = rows * H * 2
    _bandwidth_case(report, "rmsnorm", f"{rows}x{H}", 2 * act + 2 * H, {
        "xelink:triton": lambda i: rmsnorm(xs[i], w, eps, impl="triton"),
        "torch:eager": lambda i: _torch_rmsnorm(xs[i], w, eps),
        "torch:F.rms_norm": lambda i: torch.nn.functional.rms_norm(xs[i], (H,), w, eps),
    }, {"xelink:triton": checker(False)}, iters, rounds)

    def add_norm(i):
        h = xs[i] + rs[i]
        return torch.nn.functional.rms_norm(h, (H,), w, eps), h

    _bandwidth_case(report, "rmsnorm+residual", f"{rows}x{H}", 4 * act + 2 * H, {
        "xelink:triton": lambda i: rmsnorm(xs[i], w, eps, residual=rs[i], impl="triton"),
        "torch:eager": lambda i: _torch_rmsnorm(xs[i], w, eps, rs[i]),
        "torch:add+F.rms_norm": add_norm,
    }, {"xelink:triton": checker(True)}, iters, rounds)
    del xs, rs

    B, HQ, HK, S, D = 1, 32, 8, 8192, 128
    qs = [torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ks = [torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.outer(torch.arange(S, device="cuda").float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)

    def rope_check(i, out):
        qo, ko = out
        c, s = cos.float(), sin.float()

        def rot(t):
            t = t.float()
            t1, t2 = t.chunk(2, dim=-1)
            return t * c + torch.cat((-t2, t1), dim=-1) * s

        return _wrong(qo, rot(qs[i])) + _wrong(ko, rot(ks[i]))

    nbytes = 2 * 2 * (qs[0].numel() + ks[0].numel()) + 2 * 2 * S * D
    _bandwidth_case(report, "rope", f"q {B}x{HQ}x{S}x{D}, k {B}x{HK}x{S}x{D}", nbytes, {
        "xelink:triton": lambda i: rope(qs[i], ks[i], cos, sin, impl="triton"),
        "torch:eager": lambda i: _torch_rope(qs[i], ks[i], cos, sin),
    }, {"xelink:triton": rope_check}, iters, rounds)


# -- summary ----------------------------------------------------------------------------------------------

def _summary(rows) -> str:
    """One line per measured case: ratios and targets (issue 7)."""
    lines = []
    for r in rows:
        shape = r.extra.get("shape", "")
        if r.op == "gemm" and r.path != "torch:matmul":
            lines.append(f"gemm {shape:>18} {r.path:<40} {r.extra['TFLOPs']:7.1f} TFLOP/s  vs torch {r.ratio:5.2f}x")
        elif r.op == "gemv" and r.path != "torch:matmul":
            lines.append(f"gemv {shape:>24} {r.path:<52} {r.time_us:8.2f} us {r.algbw_GBps:7.0f} GB/s  vs torch bf16 "
                         f"{r.ratio:5.2f}x")
        elif r.op in ("rmsnorm", "rmsnorm+residual", "rope") and r.path.startswith("xelink"):
            sp = ", ".join(f"{n} {v:.2f}x" for n, v in r.extra["speedup_vs"].items())
            lines.append(f"{r.op:<16} {r.extra['timing']:<5} {r.path:<14} {r.time_us:8.2f} us {r.algbw_GBps:7.0f} GB/s "
                         f"= {r.extra['bw_vs_copy']:.2f} of copy_; vs {sp}")
        elif r.op == "decode-layer":
            vs = f"  vs pdl=off {r.ratio:5.2f}x" if r.ratio else ""
            lines.append(f"decode-layer {shape} {r.path:<16} {r.time_us:8.2f} us a layer{vs}")
        elif r.path.startswith("torch:copy_"):
            lines.append(f"{r.op:<16} {r.extra['timing']:<5} {r.path:<14} {r.time_us:8.2f} us {r.algbw_GBps:7.0f} GB/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the kernel benchmark; returns a process exit code (1 if any timed output was wrong)."""
    parser = argparse.ArgumentParser(prog="python -m xelink.bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="gemm,gemv,norm,decode",
                        help="comma-separated families, run in this order: gemm, gemv, norm, decode")
    parser.add_argument("--out", default="xelink-results", help="folder for kernels.jsonl and kernels.txt")
    parser.add_argument("--quick", action="store_true", help="one shape per family, fewer rounds (smoke test)")
    parser.add_argument("--sweep", nargs="?", const="gemm,gemv", default="",
                        help="also time tuning variants (configs) of these families (default gemm,gemv; "
                             "gemv-tc: the tensor-core GEMV's only; gemv-pdl: its launch options)")
    parser.add_argument("--commit", default=None,
                        help="commit to record instead of git's HEAD (default: the .commit file, if any)")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.only.split(",") if f.strip()]
    sweep = [f.strip() for f in args.sweep.split(",") if f.strip()]
    unknown = set(families) - {"gemm", "gemv", "norm", "decode"}
    if unknown:
        parser.error(f"--only: unknown families {sorted(unknown)}")
    if not torch.cuda.is_available():
        print("xelink.bench.kernels: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    man = manifest(extra={"benchmark": "kernels", "families": families, "quick": args.quick, "sweep": sweep})
    # An explicit --commit wins over git: a copy of the tree on a GPU machine may carry a stale .git.
    commit = args.commit or (Path(".commit").read_text().strip() if Path(".commit").exists() else None)
    if commit:
        man["extra"]["git_head_here"] = man["commit"]
        man["commit"] = commit
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = 2 if args.quick or sweep else 3
    with JsonlWriter(out / "kernels.jsonl", man) as writer:
        report = _Report(writer)
        for family in families:  # in the order given
            if family == "gemm":
                run_gemm(report, GEMM_SHAPES[1:2] if args.quick else GEMM_SHAPES, rounds=rounds, sweep="gemm" in sweep)
            elif family == "gemv":
                run_gemv(report, GEMV_SHAPES[:1] if args.quick else GEMV_SHAPES, rounds=rounds,
                         sweep="all" if "gemv" in sweep else "tc" if "gemv-tc" in sweep else
                         "pdl" if "gemv-pdl" in sweep else "")
            elif family == "norm":
                run_norm(report, rounds=rounds)
            else:
                run_decode(report, rounds=rounds)
    text = "\n".join([f"commit {man['commit']}  devices {man['devices']}  torch {man['versions']['torch']}  "
                      f"triton {man['versions']['triton']}", "", format_table(report.rows), "", _summary(report.rows)]
                     + ([""] + report.notes if report.notes else []))
    (out / "kernels.txt").write_text(text + "\n")
    print(text)
    bad = sum(r.wrong for r in report.rows)
    if bad:
        print(f"xelink.bench.kernels: {bad} wrong elements in timed outputs", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
