"""``xelink bench decode``: a stack of decoder layers' kernel chains at one token (``xelink.models.decode_layers``:
W4A16 projections, residual RMSNorm, RoPE, decode attention over a KV cache; the activation left out).

- CPU: a small layer (hidden 512, 8/2 heads, MLP 1024, 512 cached tokens; ``--quick``: half of each),
  two layers, through xelink's kernels' reference paths (``impl="reference"``), vs the same chain in
  plain torch eager on the weights dequantized to bf16 once (``torch.nn.functional.rms_norm``,
  ``torch.matmul``, SDPA), host clock.
- CUDA: ``LLAMA3_8B`` (H 4096, 32/8 heads, MLP 14336, decode attention over 4096 cached tokens), four
  layers (distinct weight and cache sets, more bytes than L2) in a CUDA graph, with programmatic
  dependent launch on every kernel (``xelink:pdl=all``, the sm90 default), on the GEMVs only
  (``xelink:pdl=gemv``), and on none (``xelink:pdl=off``, the baseline), all in the same run.

Times are per layer; the outputs of the timed runs are checked against the layer's pure-torch twin
(``reference_decode_layers``; ``#wrong``: elements off by more than 2% of the value plus 2% of the
output's RMS). Rank 0 runs the family while the other ranks wait.
"""
from __future__ import annotations

import functools

import torch

from ...models import LLAMA3_8B, DecodeLayerConfig, DecodeLayerWeights, decode_layers, reference_decode_layers
from ..harness import co_measure, make_row, time_cuda_events
from ..kernel_timing import (KernelReport, add_timing_arguments, cpu_rows, cuda_graph, measure_checked,
                             run_single_device, timing, wrong_elements)

__all__ = ["CPU_CONFIG", "GPU_CONFIG", "QUICK_CPU_CONFIG", "add_arguments", "run", "run_cpu", "run_gpu"]

CPU_CONFIG = DecodeLayerConfig(hidden=512, heads=8, kv_heads=2, ffn=1024, context=512)
QUICK_CPU_CONFIG = DecodeLayerConfig(hidden=256, heads=4, kv_heads=2, ffn=512, context=256)
GPU_CONFIG = LLAMA3_8B
_events = functools.partial(time_cuda_events, warmup=0)


def add_arguments(p) -> None:
    """The options of ``xelink bench decode``."""
    add_timing_arguments(p, cpu="default 5, quick 3 (rounds 3, quick 2)", gpu="default 10 (rounds 3, quick 2)")
    p.add_argument("--layers", type=_positive, default=None, help="layers in the chain (default: CPU 2, CUDA 4)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} < 1")  # argparse reports it as an invalid value of the option
    return value


def _inputs(cfg: DecodeLayerConfig, layers: int, device, gen):
    """The layers' weights, the first input, the RoPE table and the cache lengths (a full cache)."""
    weights = [DecodeLayerWeights.random(cfg, device=device, generator=gen) for _ in range(layers)]
    lens = torch.tensor([cfg.context], device=device)
    x0 = torch.randn(1, cfg.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    angle = torch.rand(1, cfg.head_dim // 2, device=device, generator=gen) * 6.28
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    return weights, x0, cos, sin, lens


def _bytes(layer) -> int:
    """Bytes of a layer's projections (packed weights and bf16 scales) and its KV cache."""
    wbytes = sum(w[0].numel() + 2 * w[1].numel() for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return wbytes + 2 * (layer.k_cache.numel() + layer.v_cache.numel())


def _shape(cfg: DecodeLayerConfig) -> str:
    return f"H={cfg.hidden},heads={cfg.heads}/{cfg.kv_heads},ffn={cfg.ffn},context={cfg.context},M=1"


def _torch_layers(x, dense, cos, sin, cfg: DecodeLayerConfig):
    """The chain in plain torch eager on bf16 weights (``dense``: per layer the dequantized projections and
    norm weights), attention over the whole cache: what a torch user would run."""
    F = torch.nn.functional
    B, D = x.shape[0], cfg.head_dim

    def rot(t):
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-t2, t1), dim=-1) * sin

    y, h = x, torch.zeros_like(x)
    for w in dense:
        h = y + h
        qkv = (F.rms_norm(h, (cfg.hidden,), w["norm1"], cfg.eps) @ w["qkv"].T).view(B, 1, -1, D).transpose(1, 2)
        q, _ = rot(qkv[:, :cfg.heads]), rot(qkv[:, cfg.heads:cfg.heads + cfg.kv_heads])  # k: as the chain, unused
        a = F.scaled_dot_product_attention(q, w["k_cache"], w["v_cache"], enable_gqa=True)
        h = a.reshape(B, cfg.hidden) @ w["o"].T + h
        gu = F.rms_norm(h, (cfg.hidden,), w["norm2"], cfg.eps) @ w["gate_up"].T
        y = gu[:, :cfg.ffn] @ w["down"].T
    return y


def run_cpu(cfg: DecodeLayerConfig = CPU_CONFIG, *, layers: int = 2, iters: int, rounds: int, progress=None) -> list:
    """The chain through xelink's reference paths vs plain torch on bf16 weights; rows per layer."""
    from ...kernels import unpack_w4a16

    gen = torch.Generator().manual_seed(7)
    weights, x0, cos, sin, lens = _inputs(cfg, layers, None, gen)
    ref = reference_decode_layers(x0, weights, cos, sin, lens)[0].float()
    dense = [dict(norm1=lw.norm1, norm2=lw.norm2, k_cache=lw.k_cache, v_cache=lw.v_cache,
                  **{k: unpack_w4a16(*getattr(lw, k)).to(torch.bfloat16) for k in ("qkv", "o", "gate_up", "down")})
             for lw in weights]
    cos16, sin16 = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    variants = {"xelink:reference": lambda: decode_layers(x0, weights, cos, sin, lens, impl="reference")[0],
                "torch:eager(bf16 weights)": lambda: _torch_layers(x0, dense, cos16, sin16, cfg)}
    checks = {n: (lambda out: wrong_elements(out, ref)) for n in variants}
    samples, wrong = measure_checked(variants, checks, iters=iters, rounds=rounds)
    rows = cpu_rows("decode-layer", samples, wrong, "torch:eager(bf16 weights)", size_bytes=_bytes(weights[0]),
                    count=1, dtype="w4a16", flops=None, per=layers,
                    extra={"shape": _shape(cfg), "layers": layers, "per": "layer"})
    if progress is not None:
        progress.step(f"decode {layers} layer(s) {_shape(cfg)}")
    return rows


def run_gpu(report, config: DecodeLayerConfig = GPU_CONFIG, layers: int = 4, iters: int = 10, rounds: int = 3,
            progress=None) -> None:
    """Time a chain of decode layers (``layers`` distinct weight and cache sets) in a CUDA graph with
    programmatic dependent launch on every kernel (the sm90 default), on the GEMVs only, and on none, all in
    the same run; the baseline is the chain without it. Rows into ``report``."""
    cfg = config
    gen = torch.Generator(device="cuda").manual_seed(7)
    weights, x0, cos, sin, lens = _inputs(cfg, layers, "cuda", gen)

    def chain(norm_pdl, gemv_pdl):
        return decode_layers(x0, weights, cos, sin, lens, pdl=norm_pdl, gemv_pdl=gemv_pdl)[0]

    ref = reference_decode_layers(x0, weights, cos, sin, lens)[0].float()
    plans = {"xelink:pdl=off": (False, False), "xelink:pdl=gemv": (False, True),
             "xelink:pdl=all": (None, True)}
    graphs, outs, launches = {}, {}, {}
    for name, (norm_pdl, gemv_pdl) in plans.items():
        graphs[name], outs[name], launches[name] = cuda_graph([functools.partial(chain, norm_pdl, gemv_pdl)], 4)
    wrong = {}

    def check(name):
        wrong[name] = wrong.get(name, 0) + wrong_elements(outs[name][0], ref)

    samples = co_measure({n: g.replay for n, g in graphs.items()}, warmup=1, iters=iters, rounds=rounds,
                         timing=_events, after_block=check)
    base = [t / (launches["xelink:pdl=off"] * layers) for t in samples["xelink:pdl=off"]]
    wbytes = _bytes(weights[0])
    for name, s in samples.items():
        is_base = name == "xelink:pdl=off"
        report.add(make_row("decode-layer", name, [t / (launches[name] * layers) for t in s],
                            size_bytes=wbytes, count=1, dtype="w4a16", nranks=1, wrong=wrong.get(name, 0),
                            baseline=None if is_base else "xelink:pdl=off", baseline_samples=None if is_base else base,
                            extra={"shape": _shape(cfg), "timing": "cuda-graph", "layers": layers, "per": "layer"}))
    del graphs, outs, weights
    torch.cuda.empty_cache()
    if progress is not None:
        progress.step(f"decode {layers} layer(s) {_shape(cfg)}: pdl off, gemv, all")


def _summary(rows) -> str:
    """One line per path: time a layer and the ratio to the baseline."""
    return "\n".join(f"decode-layer {r.extra.get('shape', '')} {r.path:<26} {r.time_us:8.2f} us a layer"
                     + (f"  vs {r.baseline} {r.ratio:5.2f}x" if r.ratio else "") for r in rows)


def _layers(ctx, default: int) -> int:
    return default if ctx.args.layers is None else ctx.args.layers


def _cpu(ctx) -> list:
    cfg = QUICK_CPU_CONFIG if ctx.quick else CPU_CONFIG
    rows = run_cpu(cfg, layers=_layers(ctx, 2), progress=ctx.progress(1),
                   **timing(ctx, {"iters": 5, "rounds": 3}, {"iters": 3, "rounds": 2}))
    ctx.notes.append(_summary(rows))
    return rows


def _gpu(ctx) -> list:
    report = KernelReport()
    run_gpu(report, GPU_CONFIG, layers=_layers(ctx, 4), progress=ctx.progress(1),
            **timing(ctx, {"iters": 10, "rounds": 2 if ctx.quick else 3}))
    ctx.notes += [_summary(report.rows)] + report.notes
    return report.rows


def run(ctx) -> list:
    """The decode family (CPU reference run, or the GPU benchmark on CUDA); rows on rank 0. Collective."""
    return run_single_device(ctx, cpu=_cpu, gpu=_gpu)
