"""``xelink bench norm``: RMSNorm (with and without the fused residual add) and RoPE, xelink's kernels next
to torch.

- CPU: ``rmsnorm(impl="reference")`` vs ``torch.nn.functional.rms_norm`` (and the residual add before it),
  ``rope(impl="reference")`` vs torch eager, at small shapes, host clock, checked against float32.
- CUDA: RMSNorm on 8192x4096 bf16 (with and without the fused residual) and RoPE on q 1x32x8192x128,
  k 1x8x8192x128: xelink's Triton kernels vs torch eager and vs ``copy_`` of the same number of bytes
  (all reads + all writes), which gives the bandwidth the machine reaches in this run; eager and
  CUDA-graph timings (``bw_vs_copy``: xelink's bandwidth over copy_'s). Checked against float32
  (``#wrong``: elements off by more than 2% of the value plus 2% of the output's RMS).
- CUDA, host time (ops ``rmsnorm:host``, ``rmsnorm+residual:host``, ``rope:host``): the host time of one
  eager call at decode sizes (8x4096; q 1x32x1x128, k 1x8x1x128) against ``F.rms_norm`` (after the add)
  and torch's eager RoPE, the GPU kept busy (``kernel_timing.host_timing``); issue 20's target is
  torch's + 10 us.

Rank 0 runs the family while the other ranks wait.
"""
from __future__ import annotations

import functools

import torch

from ..harness import co_measure, make_row, summarize, time_cuda_events
from ..kernel_timing import (KernelReport, add_timing_arguments, cpu_rows, cuda_graph, host_rows,
                             host_timing, measure_checked, run_single_device, timing, with_host_rows,
                             wrong_elements)

__all__ = ["QUICK_SHAPES", "SHAPES", "add_arguments", "run", "run_cpu", "run_gpu", "run_host"]

# CPU: (rows, H) of the norms; RoPE there on q (1, 8, rows, 64) and k (1, 2, rows, 64).
SHAPES = ((256, 1024), (1024, 4096))
QUICK_SHAPES = ((256, 1024),)
_events = functools.partial(time_cuda_events, warmup=0)


def add_arguments(p) -> None:
    """The options of ``xelink bench norm``."""
    add_timing_arguments(p, cpu="default 5, quick 3 (rounds 3, quick 2)", gpu="default 10 (rounds 3, quick 2)")


def _step(progress, what: str) -> None:
    if progress is not None:
        progress.step(what)


def _norm_cases(x, r, w, eps: float, impl: str, want, want_res, want_h, suffix: str = "") -> tuple:
    """``(op, bytes, baseline, variants, check)`` of rmsnorm and rmsnorm+residual on ``x [rows, H]``:
    ``rmsnorm(impl=impl)`` next to ``F.rms_norm`` (after the add), checked against the float32 results
    ``want`` and (``want_res``, ``want_h``: the new residual); ``suffix`` goes after the op names."""
    from ...kernels.norm import rmsnorm

    F = torch.nn.functional
    rows, H = x.shape
    act = rows * H * 2
    return (
        ("rmsnorm" + suffix, 2 * act + 2 * H, "torch:F.rms_norm",
         {f"xelink:{impl}": lambda: rmsnorm(x, w, eps, impl=impl),
          "torch:F.rms_norm": lambda: F.rms_norm(x, (H,), w, eps)},
         lambda out: wrong_elements(out, want)),
        ("rmsnorm+residual" + suffix, 4 * act + 2 * H, "torch:add+F.rms_norm",
         {f"xelink:{impl}": lambda: rmsnorm(x, w, eps, residual=r, impl=impl),
          "torch:add+F.rms_norm": lambda: (lambda h: (F.rms_norm(h, (H,), w, eps), h))(x + r)},
         lambda out: wrong_elements(out[0], want_res) + wrong_elements(out[1], want_h)),
    )


def run_cpu(shapes, *, iters: int, rounds: int, progress=None) -> list:
    """RMSNorm (plain and with the residual) and RoPE: xelink's reference paths vs torch, checked against
    float32. RoPE runs on q ``(1, 8, rows, 64)`` and k ``(1, 2, rows, 64)``. Returns rows."""
    from ...kernels.norm import rope

    out = []
    eps = 1e-6
    for rows, H in shapes:
        g = torch.Generator().manual_seed(rows + H)
        x = torch.randn(rows, H, generator=g).to(torch.bfloat16)
        r = torch.randn(rows, H, generator=g).to(torch.bfloat16)
        w = torch.randn(H, generator=g).to(torch.bfloat16)
        xf, hf = x.float(), (x.float() + r.float()).to(torch.bfloat16).float()
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        href = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        for op, nbytes, base, variants, check in _norm_cases(x, r, w, eps, "reference", ref, href, hf):
            samples, wrong = measure_checked(variants, {n: check for n in variants}, iters=iters, rounds=rounds)
            out += cpu_rows(op, samples, wrong, base, size_bytes=nbytes, count=rows * H, dtype=torch.bfloat16,
                            flops=None, extra={"shape": f"{rows}x{H}"})
        S, D = rows, 64
        q = torch.randn(1, 8, S, D, generator=g).to(torch.bfloat16)
        k = torch.randn(1, 2, S, D, generator=g).to(torch.bfloat16)
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
        emb = torch.outer(torch.arange(S).float(), inv)
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        want = [_rot(t.float(), cos.float(), sin.float()) for t in (q, k)]
        variants = {"xelink:reference": lambda: rope(q, k, cos, sin, impl="reference"),
                    "torch:eager": lambda: _torch_rope(q, k, cos, sin)}
        check = lambda out: wrong_elements(out[0], want[0]) + wrong_elements(out[1], want[1])  # noqa: E731
        samples, wrong = measure_checked(variants, {n: check for n in variants}, iters=iters, rounds=rounds)
        nbytes = 2 * 2 * (q.numel() + k.numel()) + 2 * 2 * S * D
        out += cpu_rows("rope", samples, wrong, "torch:eager", size_bytes=nbytes, count=q.numel() + k.numel(),
                        dtype=torch.bfloat16, flops=None,
                        extra={"shape": f"q 1x8x{S}x{D}, k 1x2x{S}x{D}"})
        _step(progress, f"rmsnorm, rmsnorm+residual {rows}x{H}; rope S={S}")
    return out


def _rot(t, cos, sin):
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


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


def _bandwidth_case(report, op: str, label: str, nbytes: int, variants: dict, checks: dict,
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
        graphs[name], _, launches[name] = cuda_graph([fn] * sets, 4)
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


def run_gpu(report, iters: int = 10, rounds: int = 3, progress=None) -> None:
    """RMSNorm (with and without the fused residual) on 8192x4096 bf16 and RoPE on q 1x32x8192x128, k 1x8x8192x128
    against torch eager and copy_ of the same bytes, eager and in CUDA graphs; rows into ``report``."""
    from ...kernels.norm import rmsnorm, rope

    rows, H, eps = 8192, 4096, 1e-6
    xs = [torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    rs = [torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    def checker(residual: bool):
        def check(i, out):
            if residual:
                h = (xs[i].float() + rs[i].float()).to(torch.bfloat16).float()
                ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()
                return wrong_elements(out[0], ref) + wrong_elements(out[1], h)
            xf = xs[i].float()
            return wrong_elements(out, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float())
        return check

    act = rows * H * 2
    _bandwidth_case(report, "rmsnorm", f"{rows}x{H}", 2 * act + 2 * H, {
        "xelink:triton": lambda i: rmsnorm(xs[i], w, eps, impl="triton"),
        "torch:eager": lambda i: _torch_rmsnorm(xs[i], w, eps),
        "torch:F.rms_norm": lambda i: torch.nn.functional.rms_norm(xs[i], (H,), w, eps),
    }, {"xelink:triton": checker(False)}, iters, rounds)
    _step(progress, f"rmsnorm {rows}x{H}")

    def add_norm(i):
        h = xs[i] + rs[i]
        return torch.nn.functional.rms_norm(h, (H,), w, eps), h

    _bandwidth_case(report, "rmsnorm+residual", f"{rows}x{H}", 4 * act + 2 * H, {
        "xelink:triton": lambda i: rmsnorm(xs[i], w, eps, residual=rs[i], impl="triton"),
        "torch:eager": lambda i: _torch_rmsnorm(xs[i], w, eps, rs[i]),
        "torch:add+F.rms_norm": add_norm,
    }, {"xelink:triton": checker(True)}, iters, rounds)
    _step(progress, f"rmsnorm+residual {rows}x{H}")
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

        return wrong_elements(qo, rot(qs[i])) + wrong_elements(ko, rot(ks[i]))

    nbytes = 2 * 2 * (qs[0].numel() + ks[0].numel()) + 2 * 2 * S * D
    _bandwidth_case(report, "rope", f"q {B}x{HQ}x{S}x{D}, k {B}x{HK}x{S}x{D}", nbytes, {
        "xelink:triton": lambda i: rope(qs[i], ks[i], cos, sin, impl="triton"),
        "torch:eager": lambda i: _torch_rope(qs[i], ks[i], cos, sin),
    }, {"xelink:triton": rope_check}, iters, rounds)
    _step(progress, f"rope q {B}x{HQ}x{S}x{D}, k {B}x{HK}x{S}x{D}")


def run_host(report, *, calls: int = 100, rounds: int = 10, progress=None) -> None:
    """Host time of one eager rmsnorm (with and without the residual) and rope at decode sizes against
    torch's; rows ``rmsnorm:host``, ``rmsnorm+residual:host``, ``rope:host`` into ``report``."""
    from ...kernels.norm import reference_rmsnorm, reference_rope, rope

    rows, H, eps = 8, 4096, 1e-6
    x, r = (torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    ref, (ref_res, ref_h) = reference_rmsnorm(x, w, eps), reference_rmsnorm(x, w, eps, r)
    for op, nbytes, base, variants, check in _norm_cases(x, r, w, eps, "triton", ref, ref_res, ref_h, ":host"):
        samples, wrong = host_timing(variants, {n: check for n in variants}, calls=calls, rounds=rounds)
        for row in host_rows(op, samples, wrong, base, size_bytes=nbytes, count=rows * H, dtype=torch.bfloat16,
                             extra={"shape": f"{rows}x{H}"}):
            report.add(row)
        _step(progress, f"{op} {rows}x{H}")
    B, HQ, HK, S, D = 1, 32, 8, 1, 128
    q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16)
    emb = torch.randn(S, D, device="cuda")
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    want = reference_rope(q, k, cos, sin)
    check = lambda out: wrong_elements(out[0], want[0]) + wrong_elements(out[1], want[1])  # noqa: E731
    variants = {"xelink:triton": lambda: rope(q, k, cos, sin, impl="triton"),
                "torch:eager": lambda: _torch_rope(q, k, cos, sin)}
    samples, wrong = host_timing(variants, {n: check for n in variants}, calls=calls, rounds=rounds)
    label = f"q {B}x{HQ}x{S}x{D}, k {B}x{HK}x{S}x{D}"
    nbytes = 2 * 2 * (q.numel() + k.numel()) + 2 * 2 * S * D
    for row in host_rows("rope:host", samples, wrong, "torch:eager", size_bytes=nbytes, count=q.numel() + k.numel(),
                         dtype=torch.bfloat16, extra={"shape": label}):
        report.add(row)
    _step(progress, f"rope:host {label}")


def _summary(rows) -> str:
    """One line per xelink path and copy_: time, GB/s, the share of copy_'s bandwidth, the ratio to torch."""
    lines = []
    for r in rows:
        if r.path.startswith("xelink") and "speedup_vs" in r.extra:
            sp = ", ".join(f"{n} {v:.2f}x" for n, v in r.extra["speedup_vs"].items())
            lines.append(f"{r.op:<16} {r.extra['timing']:<5} {r.path:<14} {r.time_us:8.2f} us {r.algbw_GBps:7.0f} GB/s "
                         f"= {r.extra['bw_vs_copy']:.2f} of copy_; vs {sp}")
        elif r.path.startswith("torch:copy_"):
            lines.append(f"{r.op:<16} {r.extra['timing']:<5} {r.path:<14} {r.time_us:8.2f} us {r.algbw_GBps:7.0f} GB/s")
    return "\n".join(lines)


def _cpu(ctx) -> list:
    shapes = QUICK_SHAPES if ctx.quick else SHAPES
    return run_cpu(shapes, progress=ctx.progress(len(shapes)),
                   **timing(ctx, {"iters": 5, "rounds": 3}, {"iters": 3, "rounds": 2}))


def _gpu(ctx) -> list:
    report = KernelReport()
    progress = ctx.progress(6)
    run_gpu(report, progress=progress, **timing(ctx, {"iters": 10, "rounds": 2 if ctx.quick else 3}))
    return with_host_rows(ctx, report, _summary(report.rows), run_host, progress)


def run(ctx) -> list:
    """The norm family (CPU reference run, or the GPU benchmark on CUDA); rows on rank 0. Collective."""
    return run_single_device(ctx, cpu=_cpu, gpu=_gpu)
