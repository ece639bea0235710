"""Local-kernel families of the suite: ``xelink bench gemm``, ``gemv`` and ``attention``.

On a CPU machine each times the kernels' reference paths (``impl="reference"`` of
``xelink.kernels.gemm``/``gemv``/``flash_attention``/``decode_attention``, the pure-torch twins the GPU
kernels are tested against) next to torch's own op at small shapes, co-measured, interleaved, with the
outputs of the timed runs checked against a float64/float32 computation (#wrong):

- gemm: bf16 ``gemm(a, b, impl="reference")`` vs ``torch.matmul(a, b)``.
- gemv: ``gemv(w, x, scales, fmt, impl="reference")`` for bf16, W8A16 and W4A16 weights (the row's
  dtype), 1 and 8 rows, vs ``torch.matmul(x, W.T)`` on the bf16 weight; GB/s counts the bytes read.
- attention: ``flash_attention(impl="reference")`` (MHA, causal GQA) and ``decode_attention(impl=
  "reference")`` vs ``torch.nn.functional.scaled_dot_product_attention``.

On CUDA the family runs the GPU benchmark instead (``python -m xelink.bench.kernels --only gemm|gemv``,
``python -m xelink.bench.attention``) on rank 0, with options it does not know passed on to it; its
rows come back from the JSON Lines it writes. In a multi-rank job rank 0 runs the kernels while the
other ranks wait.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .harness import co_measure, make_row

__all__ = ["add_arguments", "run", "run_gemm", "run_gemv", "run_attention", "SHAPES", "QUICK_SHAPES", "PASS_THROUGH"]

# Options this module does not know are passed on to the GPU benchmarks (xelink bench attention --impl ...).
PASS_THROUGH = True

# CPU shapes: small enough that the whole family takes seconds on two cores.
SHAPES = {
    # torch.matmul in bf16 is slow on CPUs without bf16 instructions (0.7 s at 512^3 here), so no larger.
    "gemm": ((128, 128, 128), (256, 256, 256), (512, 512, 512)),  # M, N, K
    "gemv": ((1024, 1024), (4096, 4096)),  # N, K (rows 1 and 8 each)
    "attention": (("mha", 1, 8, 8, 256, 64, False), ("gqa_causal", 1, 8, 2, 256, 64, True),
                  ("mha", 1, 8, 8, 1024, 128, False), ("gqa_causal", 1, 8, 2, 1024, 128, True),
                  ("decode", 1, 8, 2, 4096, 128, False)),  # name, B, Hq, Hkv, S, D, causal
}
QUICK_SHAPES = {
    "gemm": ((128, 128, 128), (256, 256, 256)),
    "gemv": ((1024, 1024),),
    "attention": (("mha", 1, 8, 8, 256, 64, False), ("gqa_causal", 1, 8, 2, 256, 64, True),
                  ("decode", 1, 8, 2, 1024, 64, False)),
}
GEMV_ROWS = (1, 8)


def add_arguments(p) -> None:
    p.add_argument("--iters", type=int, help="timed calls per variant per round (CPU; default 5, quick 3)")
    p.add_argument("--rounds", type=int, help="rounds, variants interleaved (CPU; default 3, quick 2)")


def _timing(ctx) -> dict:
    knobs = {"iters": 3, "rounds": 2} if ctx.quick else {"iters": 5, "rounds": 3}
    knobs.update({k: getattr(ctx.args, k) for k in knobs if getattr(ctx.args, k) is not None})
    return knobs


def _measure(variants: dict, outputs: dict, checks: dict, *, iters: int, rounds: int) -> tuple[dict, dict]:
    """(samples, wrong) of ``variants`` co-measured; ``checks[name](outputs[name])`` counts wrong elements."""
    wrong = {name: 0 for name in variants}

    def check(name):
        wrong[name] += checks[name](outputs[name])

    def keep(name, fn):
        return lambda: outputs.__setitem__(name, fn())

    samples = co_measure({n: keep(n, f) for n, f in variants.items()}, warmup=1, iters=iters, rounds=rounds,
                         after_block=check)
    return samples, wrong


def _rows(op, samples, wrong, base, *, size_bytes, count, dtype, flops, extra) -> list:
    from .harness import summarize

    out = []
    for name, s in samples.items():
        is_base = name == base
        seconds = summarize(s)["median"]
        out.append(make_row(op, name, s, size_bytes=size_bytes, count=count, dtype=dtype, nranks=1,
                            wrong=wrong[name], baseline=None if is_base else base,
                            baseline_samples=None if is_base else samples[base],
                            extra={**extra, "timing": "host clock, CPU",
                                   **({} if flops is None else {"gflops": flops / seconds / 1e9 if seconds > 0 else None})}))
    return out


def run_gemm(shapes, *, iters: int, rounds: int, progress=None) -> list:
    """bf16 GEMM: xelink's reference path vs torch.matmul, checked against float64. Returns rows."""
    from ..kernels.gemm import gemm
    from .kernels import _wrong

    rows = []
    for M, N, K in shapes:
        g = torch.Generator().manual_seed(M * 7 + N * 3 + K)
        a = torch.randn(M, K, generator=g).to(torch.bfloat16)
        b = torch.randn(K, N, generator=g).to(torch.bfloat16)
        ref = (a.double() @ b.double()).float()
        variants = {"xelink:reference": lambda: gemm(a, b, impl="reference"), "torch:matmul": lambda: torch.matmul(a, b)}
        checks = {n: (lambda out: _wrong(out, ref)) for n in variants}
        samples, wrong = _measure(variants, {}, checks, iters=iters, rounds=rounds)
        rows += _rows("gemm", samples, wrong, "torch:matmul", size_bytes=2 * (M * K + K * N + M * N), count=M * N,
                      dtype=torch.bfloat16, flops=2.0 * M * N * K, extra={"shape": f"{M}x{N}x{K}"})
        if progress is not None:
            progress.step(f"gemm {M}x{N}x{K}")
    return rows


def run_gemv(shapes, *, iters: int, rounds: int, rows_per=GEMV_ROWS, progress=None) -> list:
    """GEMV with bf16, W8A16 and W4A16 weights (reference path) vs torch.matmul on the bf16 weight."""
    from ..kernels.gemv import gemv, pack_w4a16, pack_w8a16, unpack_w4a16, unpack_w8a16
    from .kernels import _wrong

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
                checks = {"xelink:reference": lambda out, r=ref: _wrong(out, r),
                          "torch:matmul(bf16)": lambda out: _wrong(out, dense)}
                samples, wrong = _measure(variants, {}, checks, iters=iters, rounds=rounds)
                out_rows += _rows("gemv", samples, wrong, "torch:matmul(bf16)",
                                  size_bytes=wbytes[fmt] + 2 * M * K + 2 * M * N, count=M * N, dtype=fmt,
                                  flops=None, extra={"shape": f"N={N},K={K},M={M}"})
            if progress is not None:
                progress.step(f"gemv N={N} K={K} M={M}: bf16, w8a16, w4a16")
    return out_rows


def run_attention(cases, *, iters: int, rounds: int, progress=None) -> list:
    """Flash (prefill) and decode attention, reference path vs SDPA, checked against float32 SDPA."""
    import torch.nn.functional as F

    from ..kernels.attention import decode_attention, flash_attention
    from .attention import _wrong

    rows = []
    for name, B, hq, hkv, S, D, causal in cases:
        g = torch.Generator().manual_seed(S + D + hq)
        decode = name == "decode"
        sq = 1 if decode else S
        q = torch.randn(B, hq, sq, D, generator=g).to(torch.bfloat16)
        k = torch.randn(B, hkv, S, D, generator=g).to(torch.bfloat16)
        v = torch.randn(B, hkv, S, D, generator=g).to(torch.bfloat16)
        gqa = hq != hkv
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=gqa)
        if decode:
            lens = torch.full((B,), S, dtype=torch.int32)
            ours = lambda: decode_attention(q, k, v, lens, impl="reference")  # noqa: E731
        else:
            ours = lambda: flash_attention(q, k, v, causal=causal, impl="reference")  # noqa: E731
        variants = {"xelink:reference": ours,
                    "torch:sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)}
        checks = {n: (lambda out: _wrong(out, ref)) for n in variants}
        samples, wrong = _measure(variants, {}, checks, iters=iters, rounds=rounds)
        flops = 4.0 * B * hq * sq * S * D / (2 if causal else 1)
        nbytes = 2 * (2 * q.numel() + k.numel() + v.numel())
        op = "decode_attention" if decode else "flash_attention"
        shape = f"{name} B={B} Hq={hq} Hkv={hkv} S={S} D={D}"
        rows += _rows(op, samples, wrong, "torch:sdpa", size_bytes=nbytes, count=q.numel(), dtype=torch.bfloat16,
                      flops=flops, extra={"shape": shape, "causal": causal})
        if progress is not None:
            progress.step(shape)
    return rows


_CPU = {"gemm": run_gemm, "gemv": run_gemv, "attention": run_attention}


def _run_cpu(ctx, family: str) -> list:
    shapes = (QUICK_SHAPES if ctx.quick else SHAPES)[family]
    progress = ctx.progress(len(shapes) * (len(GEMV_ROWS) if family == "gemv" else 1))
    return _CPU[family](shapes, progress=progress, **_timing(ctx))


def _run_gpu(ctx, family: str) -> list:
    """The GPU benchmark of ``family`` (rank 0); rows read back from the JSON Lines it wrote."""
    from . import attention, kernels
    from .suite import rows_of_jsonl

    folder = ctx.out / f"{family}-gpu" if ctx.out is not None else Path(tempfile.mkdtemp(prefix="xelink-bench-"))
    if family == "attention":
        argv = ["--out", str(folder)] + (["--quick", "--iters", "5"] if ctx.quick else []) + ctx.rest
        rc, jsonl = attention.main(argv), folder / "attention.jsonl"
    else:
        argv = ["--only", family, "--out", str(folder)] + (["--quick"] if ctx.quick else []) + ctx.rest
        rc, jsonl = kernels.main(argv), folder / "kernels.jsonl"
    ctx.failed = rc != 0
    ctx.delegated = True
    ctx.notes.append(f"{family}: GPU benchmark output in {folder}/ (exit status {rc})")
    return rows_of_jsonl(jsonl)


def run(ctx) -> list:
    """Rank 0 runs the family (CPU reference paths, or the GPU benchmark on CUDA); rows on rank 0, [] elsewhere.

    Collective: every rank of the world must call this.
    """
    family = ctx.family
    cuda = getattr(ctx.world.device, "type", "cpu") == "cuda"
    if not cuda and ctx.rest:  # every rank refuses, so none waits for rank 0
        raise SystemExit(f"xelink bench {family}: unrecognized arguments (the GPU benchmark's options have no "
                         f"meaning for the CPU reference run): {' '.join(ctx.rest)}")
    if ctx.lead and not cuda:
        ctx.header = (f"# {family}: xelink's reference path (pure torch, what the GPU kernels are tested against) vs "
                      f"torch on CPU, rank 0 alone; ratio = torch time / xelink time (>1: xelink faster); outputs of "
                      f"the timed runs checked against float64/float32 (#wrong)")
    rows = ctx.solo(lambda: (_run_gpu if cuda else _run_cpu)(ctx, family))
    return rows or []
