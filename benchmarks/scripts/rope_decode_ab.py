"""A/B of the decode step's attention call (issue 26): ``rope_decode_attention`` (one launch; the kept step:
not placed early, 64-key splits) against the same under PDL with the QKV GEMV before it letting it go early (gemv's default
for 6144 rows) or late (``gemv.PDL_EARLY_MAX_ROWS`` below 6144: its programs placed only as the GEMV's end, so
they no longer crowd it), with and without the L2 prefetch of the cache before the PDL wait; and ``rope_kv`` +
``decode_attention`` (two launches). Llama-3.1-8B shapes on one GPU, the whole step's graph (``DecodeGraph``) at
1K / 8K / 32K of context (bf16; one model with ``max_seq_len`` 32K + 16, as ``xelink bench decode``) and 1K
(W4A16), each variant captured on its own and replayed interleaved; before them, the attention call's pieces
(``pieces``). The fused variants' logits are compared bit for bit (PDL, the trigger and the prefetch change no
value); the unfused step's may differ by a rounding of the rotated keys.

Also ``release-early`` / ``release-late``: the call, not placed early itself, but compiled with the PDL trigger at
its entry / after its main loop, so that the O GEMV after it is placed early; ``release-late`` is the kept call
since the twenty-ninth session (``attention.DECODE_RELEASE``), ``off`` the call before it.

python3 benchmarks/scripts/rope_decode_ab.py [--variants NAME,NAME] [bf16|w4a16 ...]
"""
import functools
import importlib
import os
import statistics
import sys

import torch

from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import decode_attention, gemv, rope_decode_attention, rope_kv
from xelink.models.llama import KVCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_ab import capture, each_context, print_pieces, time_interleaved  # noqa: E402

attn = importlib.import_module("xelink.kernels.attention")
gemv_mod = importlib.import_module("xelink.kernels.gemv")
CONTEXTS = {"bf16": [1024, 8192, 32768], "w4a16": [1024]}
_prefetch_args, _EARLY_ROWS = attn.prefetch_args, gemv_mod.PDL_EARLY_MAX_ROWS
_pdl_launch_args = attn.pdl_launch_args


def _no_prefetch(*args, **kwargs):
    return {}


def unfused(self, q, k, v, cos, sin, positions, kv_lens, ops, prefetch=None):
    q = rope_kv(q, k, v, cos, sin, positions, self.k, self.v)
    return decode_attention(q, self.k[:q.shape[0]], self.v[:q.shape[0]], kv_lens)


def fused(pdl):
    def decode(self, q, k, v, cos, sin, positions, kv_lens, ops, prefetch=None):
        B = q.shape[0]
        return rope_decode_attention(q, k, v, cos, sin, self.k[:B], self.v[:B], kv_lens, pdl=pdl)
    return decode


def released(mode):
    """The call (not placed early itself) compiled with the PDL trigger (mode 1: at entry, 2: after the main
    loop), so that the O GEMV after it is placed early (its launch and, W4A16, its weight prefetch overlap the
    attention)."""
    def decode(self, q, k, v, cos, sin, positions, kv_lens, ops, prefetch=None):
        attn.pdl_launch_args = lambda option, programs, device: dict(PDL=mode)
        try:
            B = q.shape[0]
            return rope_decode_attention(q, k, v, cos, sin, self.k[:B], self.v[:B], kv_lens)
        finally:
            attn.pdl_launch_args = _pdl_launch_args
    return decode


def variant(decode, qkv_late=False, prefetch=True):
    """The settings of a variant: the cache's decode, whether the QKV GEMV (6144 rows) lets the next kernel go
    late, and whether launches placed early prefetch before their PDL wait."""
    return [(KVCache, "decode", decode), (gemv_mod, "PDL_EARLY_MAX_ROWS", 6000 if qkv_late else _EARLY_ROWS),
            (attn, "prefetch_args", _prefetch_args if prefetch else _no_prefetch)]


VARIANTS = {"release-early": variant(released(1), prefetch=False),
            "release-late": variant(released(2), prefetch=False), "kept": variant(fused(None)),
            "off": variant(fused(False)),
            "pdl": variant(fused("early")), "pdl-qkvlate": variant(fused("early"), True),
            "pdl-late-qkvlate": variant(fused("late"), True),
            "pdl-qkvlate-nopref": variant(fused("early"), True, prefetch=False), "unfused": variant(unfused)}


def pieces(model, L, gen):
    """The attention call alone and after the layer's QKV GEMV (its PDL predecessor in the step), each over the 32
    layers in one graph, fused and unfused: where the step's difference comes from (us a step)."""
    dev, dt, hq, hk, D = model.device, model.dtype, model.heads, model.kv_heads, model.head_dim
    qkv = torch.randn(1, hq + 2 * hk, 1, D, device=dev, generator=gen).to(dt)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    x = torch.randn(1, model.config.hidden_size, device=dev, generator=gen).to(dt)
    lens = torch.full((1,), L, dtype=torch.int64, device=dev)
    pos = lens - 1

    def one(c):
        return rope_decode_attention(q, k, v, model.cos, model.sin, c.k[:1], c.v[:1], lens)

    def two(c):
        return decode_attention(rope_kv(q, k, v, model.cos, model.sin, pos, c.k, c.v), c.k[:1], c.v[:1], lens)

    def after_qkv(fn, ly, c):
        li = ly["qkv"]
        return lambda: (gemv(li.weight, x, li.scales, model.ops.gemv_format(li, x)), fn(c))

    out = {}
    for name, fn in (("fused", one), ("unfused", two)):
        for where, calls in (("alone", [functools.partial(fn, c) for c in model.caches]),
                             ("after qkv", [after_qkv(fn, ly, c) for ly, c in zip(model.layers, model.caches)])):
            graph, _, _ = cuda_graph(calls, 1)
            out[f"{name} {where}"] = statistics.median(time_cuda_events(graph.replay, warmup=2, iters=20)) * 1e6
            del graph
    return ", ".join(f"{n} {us:.1f}" for n, us in out.items())


def main():
    args = sys.argv[1:]
    if "--variants" in args:  # a subset, comma-separated ("kept" is always among them: the logits' reference)
        i = args.index("--variants")
        keep = {"kept", *args[i + 1].split(",")}
        unknown = keep - set(VARIANTS)
        if unknown:
            sys.exit(f"rope_decode_ab.py: unknown variants {sorted(unknown)} (known: {', '.join(VARIANTS)})")
        for name in list(VARIANTS):
            if name not in keep:
                del VARIANTS[name]
        del args[i:i + 2]
    fmts = args or ["bf16", "w4a16"]
    for fmt, model, L, gen in each_context(fmts, CONTEXTS):
        print_pieces(fmt, L, pieces, model, gen)
        graphs, logits = capture(model, L, VARIANTS, gen)
        fused_same = all(torch.equal(logits[n], logits["kept"]) for n in logits if n != "unfused")
        diff = float((logits["unfused"].float() - logits["kept"].float()).abs().max()) \
            if "unfused" in logits else float("nan")
        line = ", ".join(f"{n} {ms:.3f}" for n, ms in time_interleaved(graphs).items())
        print(f"{fmt} ctx {L} step ms (median of 50 replays): {line}; fused variants' logits equal: {fused_same}; "
              f"unfused vs kept logits max abs diff {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
