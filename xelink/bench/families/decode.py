"""``xelink bench decode``: decode at one token a sequence, two ways (rank 0 runs the family while the other
ranks wait).

Layer rows (op ``decode-layer``, skipped with ``--model-only``): a stack of decoder layers' kernel chains
(``xelink.models.decode_layers``: W4A16 projections, residual RMSNorm, RoPE, decode attention over a KV
cache; the activation left out).

- CPU: a small layer (hidden 512, 8/2 heads, MLP 1024, 512 cached tokens; ``--quick``: half of each),
  two layers, through xelink's kernels' reference paths (``impl="reference"``), vs the same chain in
  plain torch eager on the weights dequantized to bf16 once (``torch.nn.functional.rms_norm``,
  ``torch.matmul``, SDPA), host clock.
- CUDA: ``LLAMA3_8B`` (H 4096, 32/8 heads, MLP 14336, decode attention over 4096 cached tokens), four
  layers (distinct weight and cache sets, more bytes than L2) in a CUDA graph, with programmatic
  dependent launch on every kernel (``xelink:pdl=all``, the sm90 default), on the GEMVs only
  (``xelink:pdl=gemv``), and on none (``xelink:pdl=off``, the baseline), all in the same run.

Layer times are per layer; the outputs of the timed runs are checked against the layer's pure-torch twin
(``reference_decode_layers``; ``#wrong``: elements off by more than 2% of the value plus 2% of the
output's RMS).

Model rows (op ``decode-model``, issue 26): the time of a whole Llama decode step (``Llama.random``: random
weights at a real model's shapes, no files; every sequence's token at position L-1 of a cache whose rows
0..L-1 are read). Their baseline is the same model in plain torch (``TorchDecode``, written here on the bf16
model's own weight tensors, shared, not copied): embedding row, ``F.rms_norm``, ``F.linear``, RoPE with
Hugging Face's ``rotate_half``, the token's K/V written into the twin's own static cache (``index_put_`` at
the position; the cache holds exactly L positions: no row past the context is read), SDPA over the cache
with a boolean mask of positions <= pos (one graph serves every position, as a static-cache
implementation does; ``enable_gqa=True``), SiLU * up, the head and the argmax.

- CUDA: ``--model`` (default ``llama-3.1-8b``), ``impl="xelink"``: the replay of ``Llama.decode_graph(B)``
  (one CUDA graph a step, inputs set once) against the twin captured in one CUDA graph at the same B and
  L, co-measured with CUDA events around back-to-back replays: bf16 B=1 at each context (``--contexts``,
  default 1K 8K 32K; ``--quick`` 1K 8K), and at the smallest context W4A16 B=1, W8A16 B=1 (not under
  ``--quick``) and bf16 B=8. The W4A16/W8A16 rows have the bf16 twin (same B and L) as their baseline
  (``baseline_us``; no second torch row). Each weight format's model is built once (max_batch the largest
  B of its rows, max_seq_len its largest context + 16) and freed before the next; the bf16 weights stay
  for the twin. Next to them, unless ``--no-transformers`` or transformers is missing (a note says why),
  ``transformers:generate(static cache)``: ``LlamaForCausalLM`` of the same config with its own random
  weights, bf16, eager (``disable_compile``: no torch.compile), greedy, a prompt of L tokens at B=1 and the
  smallest context; a token's time is (generate(1 + 32 new tokens) - generate(1)) / 32 on the host clock
  after a synchronize; the xelink bf16 row at that shape gets ``extra["vs_transformers"]``. The B=1 rows at
  the smallest context also get ``extra["breakdown_us"]`` and a note: ``step_breakdown``, each op of the step
  alone over every layer in its own CUDA graph (us a step, GB/s).
- CPU: the ``tiny`` config in float32 at B=1, context 64 (``--contexts`` too): eager ``Llama.decode``
  through the reference paths (``impl="reference"``) vs the twin eager, host clock.

Parallel rows (op ``decode-model``, on a launch of n > 1 ranks; ``--no-parallel`` leaves them out,
``--parallel-only`` runs only them), every rank taking part, each sample the slowest rank's:

- TP = n (``tp_rows``): the model with ``tp_group`` = the world at the smallest context, B=1 (CUDA: its
  decode graph, bf16; CPU: the tiny config eager through the reference paths, float32), against the plain-
  torch twin on the same slices with the launch's collectives (``TorchDecode(collectives=...)``: NCCL in a
  CUDA graph with one GPU per rank, left out where ranks share a GPU; MPI or gloo eager on CPU ranks).
- CP = n (``cp_rows``): the model with ``cp_group`` = the world at ``--cp-context`` (CUDA 128K, quick 32K;
  CPU 64), the token at the context's last position (CUDA: its decode graph, the merge's all-gather in it; CPU:
  eager), against TP = 1 on rank 0 alone at the same context measured first (CUDA: its decode graph). Each
  rank's cache holds its round-robin share of the context, random.
- Checks: non-finite logits, tokens off their row's maximum, ranks disagreeing on the next token (#wrong).
  Targets (8B, 2 ranks): TP = 2 at 1K <= 2.6 ms; CP = 2 at 128K <= 0.8x TP = 1.

A model row's time is one decode step (``count`` = B tokens, one per sequence: the time per output token
of each sequence); ``size_bytes`` and ``extra["bytes_per_step"]`` the bytes a step reads (every linear
weight as stored, scales included, the norms, the head, one embedding row per sequence, the K/V cache rows
0..L-1 of every layer for B sequences); ``extra["roofline"]`` (CUDA) that over the time over the device's peak
HBM bandwidth (``HBM_BYTES_PER_S`` by name; none for a GPU not listed). ``extra["kernels"]``: the kernels of one
replay as the profiler saw them, counted after the timing. Checks: on CPU ``#wrong`` counts the logits off
the twin run in float64 (2% of the value plus 2% of the RMS); on CUDA, where bf16 rounding over 32 layers
separates the two, ``#wrong`` counts non-finite logits and next tokens not at their row's maximum, while the
agreement with the twin, taken on the first replay, is recorded (``same_next_token``, ``logits_max_abs_diff``,
``logits_rel_rms_diff``; random weights give near-flat logits, so a differing token is no failure). The notes
give a line per model row and issue 26's targets (8B only): bf16 B=1 <= 4.2 / 4.4 / 5.4 ms at 1K / 8K / 32K and
>= 1.6x the torch graph, W4A16 B=1 1K <= 1.8 ms, bf16 B=8 1K <= 1.2x the B=1 time (the millisecond ones judged on
an H200 only).
"""
from __future__ import annotations

import collections
import functools
import gc
import importlib
import statistics
import sys
import time
import traceback

import torch

from ...models import (CONFIGS, LLAMA3_8B, DecodeLayerConfig, DecodeLayerWeights, Llama, decode_layers,
                       reference_decode_layers)
from ...kernels.pdl import prefetch_bytes
from ..harness import (CUDA_ONLY, co_measure, make_row, on_cuda, one_gpu_per_rank, rank_max, rank_sums,
                       time_cuda_events, time_fn)
from ..kernel_timing import (KernelReport, add_timing_arguments, cpu_rows, cuda_graph, measure_checked,
                             run_single_device, timing, wrong_elements)
from .collectives import transport_baseline

# (modules whose names the packages' functions shadow) the decode attention's prefetch of the O weight, recorded
llama_mod = importlib.import_module("xelink.models.llama")
attention_mod = importlib.import_module("xelink.kernels.attention")

__all__ = ["CPU_CONFIG", "CPU_CONTEXTS", "CPU_MODEL", "GPU_CONFIG", "GPU_CONTEXTS", "GPU_MODEL", "HBM_BYTES_PER_S",
           "device_hbm", "QUICK_CPU_CONFIG", "QUICK_GPU_CONTEXTS", "TorchDecode", "add_arguments", "cp_rows",
           "dense_weights",
           "model_cases", "model_step_bytes", "run", "run_cpu", "run_gpu", "run_model_cpu", "run_model_gpu",
           "run_transformers", "tp_rows"]

CPU_CONFIG = DecodeLayerConfig(hidden=512, heads=8, kv_heads=2, ffn=1024, context=512)
QUICK_CPU_CONFIG = DecodeLayerConfig(hidden=256, heads=4, kv_heads=2, ffn=512, context=256)
GPU_CONFIG = LLAMA3_8B
_events = functools.partial(time_cuda_events, warmup=0)

# Model rows (issue 26).
CPU_MODEL, CPU_CONTEXTS = "tiny", (64,)
GPU_MODEL, GPU_CONTEXTS, QUICK_GPU_CONTEXTS = "llama-3.1-8b", (1024, 8192, 32768), (1024, 8192)
# Peak HBM bandwidth by device name (spec sheets), the roofline's denominator; a device not listed gets no roofline.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}
TARGET_DEVICE = "H200"  # issue 26's millisecond targets are set on one H200: judged there only
HF_NEW_TOKENS = 32  # transformers' row: (generate(1 + n) - generate(1)) / n
# Issue 26's targets, Llama-3.1-8B on one H200: (weights, B, context) -> most ms a step; bf16 B=1 also
# >= TARGET_VS_TORCH x the torch graph; bf16 B=8 at most TARGET_B8 x the B=1 time at the same context.
TARGETS_MS = {("bf16", 1, 1024): 4.2, ("bf16", 1, 8192): 4.4, ("bf16", 1, 32768): 5.4, ("w4a16", 1, 1024): 1.8}
TARGET_VS_TORCH, TARGET_B8 = 1.6, 1.2
# The parallel rows (2 ranks, one GPU each): TP = 2 bf16 B=1 at 1K at most TARGET_TP2_MS, CP = 2 at 128K at most
# TARGET_CP2 x TP = 1's time at that context. CP's context on CUDA (quick: 32K).
TARGET_TP2_MS, TARGET_CP2 = 2.6, 0.8
CP_CONTEXT, QUICK_CP_CONTEXT = 131072, 32768
_LINEARS = ("qkv", "o", "gate_up", "down")
_OP = "decode-model"


def add_arguments(p) -> None:
    """The options of ``xelink bench decode``."""
    add_timing_arguments(p, cpu="default 5, quick 3 (rounds 3, quick 2)",
                         gpu="layers 10, model 20, quick 10 (rounds 3, quick 2)")
    p.add_argument("--layers", type=_positive, default=None, help="layers in the chain (default: CPU 2, CUDA 4)")
    p.add_argument("--model-only", action="store_true", help="the model rows only (no layer-chain rows)")
    p.add_argument("--contexts", nargs="+", type=_context, default=None, metavar="L",
                   help="contexts of the model rows, e.g. 1K 8K (default: CPU 64; CUDA 1K 8K 32K, quick 1K 8K); "
                        "the quantized, B=8 and transformers rows run at the smallest")
    g = p.add_argument_group(CUDA_ONLY)
    g.add_argument("--model", choices=tuple(CONFIGS), default=None,
                   help=f"the named config of the model rows (default {GPU_MODEL}; targets for it only)")
    g.add_argument("--no-transformers", action="store_true", help="no transformers generate row")
    p.add_argument("--cp-context", type=_context, default=None, metavar="L",
                   help="several ranks: the context of the CP rows (default: CUDA 128K, quick 32K; CPU 64)")
    par = p.add_mutually_exclusive_group()
    par.add_argument("--no-parallel", action="store_true", help="several ranks: no TP / CP rows (rank 0's rows only)")
    par.add_argument("--parallel-only", action="store_true", help="several ranks: the TP / CP rows only")


def _context(text: str) -> int:
    t = text.strip().lower()
    value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    if value < 2:
        raise ValueError(f"{value} < 2")
    return value


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


# -- model rows (issue 26) ----------------------------------------------------------------------------


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _linear_bytes(lin) -> int:
    return _nbytes(lin.weight) + _nbytes(lin.scales) + _nbytes(getattr(lin, "bias", None))


def model_step_bytes(model, batch: int, context: int) -> int:
    """Bytes one decode step of ``model`` reads for ``batch`` sequences at ``context`` cached positions each:
    every linear weight as stored (scales and biases included), the norms (Qwen3's q/k ones too), the head, one
    embedding row a sequence and the K/V cache rows ``0 .. context-1`` of every layer."""
    n = _nbytes(model.norm) + _linear_bytes(model.head) + batch * model.embed.shape[1] * model.embed.element_size()
    for layer in model.layers:
        n += _nbytes(layer["attn_norm"]) + _nbytes(layer["mlp_norm"]) + sum(_linear_bytes(layer[k]) for k in _LINEARS)
        n += _nbytes(layer.get("q_norm")) + _nbytes(layer.get("k_norm"))
    k = model.caches[0].k
    return n + len(model.layers) * 2 * batch * context * k.shape[1] * k.shape[3] * k.element_size()


def dense_weights(model, dtype: torch.dtype | None = None) -> dict:
    """The tensors of a dense-weight ``model`` (``weights="bf16"``) the plain-torch twin reads: shared, not
    copied (``dtype``: copies in that dtype instead, e.g. float64 for a CPU reference). Under tensor
    parallelism they are this rank's slices (``"tp"``: the TP size; the twin then needs collectives)."""
    cfg = model.config
    if any(layer[k].fmt != "dense" for layer in model.layers for k in _LINEARS) or model.head.fmt != "dense":
        raise ValueError("dense_weights: the twin needs a model with dense weights (weights='bf16')")
    if model.cp is not None:
        raise ValueError("dense_weights: the twin has no context parallelism")
    if any(getattr(layer[k], "bias", None) is not None for layer in model.layers for k in _LINEARS):
        raise ValueError("dense_weights: the twin has no biases")

    def t(x):
        return x if dtype is None else x.to(dtype)

    layers = [{"attn_norm": t(layer["attn_norm"]), "mlp_norm": t(layer["mlp_norm"]),
               **{k: t(layer[k].weight) for k in _LINEARS},
               **{k: t(layer[k]) for k in ("q_norm", "k_norm") if k in layer}}  # Qwen3's per-head norms
              for layer in model.layers]
    return {"config": cfg, "heads": model.heads, "kv_heads": model.kv_heads, "head_dim": model.head_dim,
            "embed": t(model.embed), "norm": t(model.norm), "head": t(model.head.weight), "layers": layers,
            "cos": t(model.cos), "sin": t(model.sin), "tp": model.tp.size}


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchDecode:
    """One Llama decode step in plain torch: what a torch user with a static KV cache runs (see the module).

    ``weights``: ``dense_weights(model)``; ``caches``: the model's caches, whose rows ``0 .. context-1`` of
    the first ``batch`` sequences the twin copies into its own ``[batch, kv_heads, context, head_dim]``
    caches (in ``dtype``, default the weights'). ``set(tokens, positions)`` fills the static inputs;
    ``step()`` returns ``(logits [B, vocab], next tokens [B])`` with no host synchronization (a CUDA graph
    can hold it) and writes each token's K/V at its position. A TP model's twin (``weights["tp"] > 1``) sums
    the O and down projections' partials with ``collectives.all_reduce`` and gathers the head's vocabulary
    blocks with ``collectives.all_gather`` (``transport_baseline``: NCCL on CUDA, MPI or gloo on CPU ranks).
    """

    def __init__(self, weights: dict, batch: int, context: int, caches, dtype: torch.dtype | None = None,
                 collectives=None):
        if weights["tp"] > 1 and collectives is None:
            raise ValueError(f"TorchDecode: the twin of a TP model ({weights['tp']} ranks) needs collectives")
        self.w, self.batch, self.context, self.coll = weights, batch, context, collectives
        dev = weights["embed"].device
        dtype = dtype or weights["embed"].dtype
        self.k = [c.k[:batch, :, :context].to(dtype, copy=True) for c in caches]
        self.v = [c.v[:batch, :, :context].to(dtype, copy=True) for c in caches]
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.positions = torch.full((batch,), context - 1, dtype=torch.int64, device=dev)
        self.rows = torch.arange(batch, device=dev)
        self.keys = torch.arange(context, device=dev)

    def set(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)

    def bytes(self) -> int:
        """Bytes a step reads (as ``model_step_bytes``)."""
        w = self.w
        n = _nbytes(w["norm"]) + _nbytes(w["head"]) + self.batch * w["embed"].shape[1] * w["embed"].element_size()
        n += sum(_nbytes(t) for layer in w["layers"] for t in layer.values())
        return n + sum(_nbytes(t) for t in self.k + self.v)

    def sdpa(self) -> str:
        """The attention call and the backend torch's dispatch picks for it (private API: "?" where it fails)."""
        try:
            from torch.nn.attention import SDPBackend

            q = self.k[0].new_empty(self.batch, self.w["heads"], 1, self.w["head_dim"])
            mask = torch.ones(self.batch, 1, 1, self.context, dtype=torch.bool, device=q.device)
            picked = SDPBackend(torch._fused_sdp_choice(q, self.k[0], self.v[0], attn_mask=mask, dropout_p=0.0,
                                                        is_causal=False, enable_gqa=True)).name.lower()
        except Exception:  # noqa: BLE001 - a private API: the backend is only recorded
            picked = "?"
        return f"boolean mask, enable_gqa=True: {picked}"

    def step(self):
        F = torch.nn.functional
        w, B = self.w, self.batch
        cfg, hq, hk, D = w["config"], w["heads"], w["kv_heads"], w["head_dim"]
        H, ffn, eps = cfg.hidden_size, w["layers"][0]["down"].shape[1], cfg.rms_norm_eps
        pos = self.positions
        cos, sin = w["cos"][pos].view(B, 1, 1, D), w["sin"][pos].view(B, 1, 1, D)
        mask = (self.keys[None, :] <= pos[:, None]).view(B, 1, 1, self.context)
        x = F.embedding(self.tokens, w["embed"])  # [B, H]
        for layer, kc, vc in zip(w["layers"], self.k, self.v):
            qkv = F.linear(F.rms_norm(x, (H,), layer["attn_norm"], eps), layer["qkv"]).view(B, hq + 2 * hk, 1, D)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
            if "q_norm" in layer:
                q, k = F.rms_norm(q, (D,), layer["q_norm"], eps), F.rms_norm(k, (D,), layer["k_norm"], eps)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            kc[self.rows, :, pos] = k[:, :, 0]
            vc[self.rows, :, pos] = v[:, :, 0]
            a = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)  # [B, hq, 1, D]
            x = x + self._sum(F.linear(a.reshape(B, hq * D), layer["o"]))
            gu = F.linear(F.rms_norm(x, (H,), layer["mlp_norm"], eps), layer["gate_up"])
            x = x + self._sum(F.linear(F.silu(gu[:, :ffn]) * gu[:, ffn:], layer["down"]))
        logits = self._vocab(F.linear(F.rms_norm(x, (H,), w["norm"], eps), w["head"]))
        return logits, logits.argmax(dim=-1)

    def _sum(self, partial):
        """A row-parallel projection's partials summed over the TP ranks (in place)."""
        if self.w["tp"] > 1:
            self.coll.all_reduce(partial)
        return partial

    def _vocab(self, logits):
        """``[B, vocab/n]`` blocks of the TP ranks -> ``[B, vocab]`` (the last block's padding cut)."""
        n, vocab = self.w["tp"], self.w["config"].vocab_size
        if n == 1:
            return logits
        B, V = logits.shape
        out = logits.new_empty(n * B, V)
        self.coll.all_gather(out, logits.contiguous())
        return out.view(n, B, V).permute(1, 0, 2).reshape(B, n * V)[:, :vocab]


def model_cases(contexts, quick: bool = False) -> list:
    """The CUDA model rows, ``(weights, B, context)`` grouped by weight format: bf16 B=1 at every context,
    bf16 B=8, W4A16 B=1 (the head dense, as issue 26's target; then ``"w4a16+head"``: the head quantized too,
    ``quantize_head``) and (not quick) W8A16 B=1 at the smallest."""
    contexts = sorted(set(contexts))
    c0 = contexts[0]
    cases = [("bf16", 1, c) for c in contexts] + [("bf16", 8, c0), ("w4a16", 1, c0), ("w4a16+head", 1, c0)]
    return cases if quick else cases + [("w8a16", 1, c0)]


def _model_shape(name: str, batch: int, context: int) -> str:
    return f"{name} B={batch} ctx={context}"


def _fill_caches(model, batch: int, context: int, gen) -> None:
    """Random keys and values in cache rows ``0 .. context-1`` of the first ``batch`` sequences."""
    for c in model.caches:
        c.k[:batch, :, :context].normal_(generator=gen)
        c.v[:batch, :, :context].normal_(generator=gen)


def _agreement(logits, next_tokens, twin_logits, twin_next) -> dict:
    """How the logits of a step agree with the twin's (recorded in the row, never failed on)."""
    a, b = logits.float(), twin_logits.float()
    return {"same_next_token": bool(torch.equal(next_tokens, twin_next)),
            "next_tokens": next_tokens.tolist(), "torch_next_tokens": twin_next.tolist(),
            "logits_max_abs_diff": float((a - b).abs().max()),
            "logits_rel_rms_diff": float((a - b).norm() / b.norm().clamp_min(1e-30))}


def _bad(logits, next_tokens) -> int:
    """Non-finite logits plus sequences whose next token is not at its row's maximum."""
    f = logits.float()
    off = f.gather(1, next_tokens[:, None])[:, 0] != f.max(dim=1).values
    return int((~torch.isfinite(f)).sum()) + int(off.sum())


def run_model_cpu(name: str = CPU_MODEL, contexts=CPU_CONTEXTS, *, batch: int = 1, iters: int, rounds: int,
                  progress=None) -> list:
    """Eager ``Llama.decode`` through the reference paths (float32) vs the plain-torch twin eager, host
    clock; both checked against the twin run in float64. Rows, one pair per context."""
    contexts = sorted(set(contexts))
    model = Llama.random(name, impl="reference", device="cpu", dtype=torch.float32, max_batch=batch,
                         max_seq_len=contexts[-1] + 16)
    weights, ref_weights = dense_weights(model), dense_weights(model, torch.float64)
    gen = torch.Generator().manual_seed(7)
    xname, tname = "xelink:reference float32", "torch:eager float32"
    rows = []
    for L in contexts:
        _fill_caches(model, batch, L, gen)
        tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=gen)
        positions = torch.full((batch,), L - 1, dtype=torch.int64)
        twin, ref = TorchDecode(weights, batch, L, model.caches), TorchDecode(ref_weights, batch, L, model.caches)
        twin.set(tokens, positions)
        ref.set(tokens, positions)
        want = ref.step()[0]
        first = model.decode(tokens, positions)
        agree = _agreement(first, first.argmax(-1), *twin.step())
        variants = {xname: lambda: model.decode(tokens, positions), tname: lambda: twin.step()[0]}
        checks = {n: (lambda out: wrong_elements(out, want)) for n in variants}
        samples, wrong = measure_checked(variants, checks, iters=iters, rounds=rounds)
        nbytes = model_step_bytes(model, batch, L)
        extra = {"shape": _model_shape(name, batch, L), "batch": batch, "context": L, "weights": "float32",
                 "per": "decode step (a token a sequence)", "bytes_per_step": nbytes,
                 "kernels": "reference paths (pure torch), eager; collectives: none"}
        for r in cpu_rows(_OP, samples, wrong, tname, size_bytes=nbytes, count=batch, dtype="float32", flops=None,
                          extra=extra):
            r.extra["ms_per_token"] = r.time_us / 1e3
            if r.path == xname:
                r.extra.update(agree)
            else:
                r.extra["sdpa"] = twin.sdpa()
            rows.append(r)
        if progress is not None:
            progress.step(f"decode-model {extra['shape']}: eager reference vs torch")
    return rows


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameters, at most 48 characters."""
    name = name.removeprefix("void ")
    for stop in "<(":
        name = name.split(stop, 1)[0]
    return name.strip()[:48] or "?"


def _kernels(fn) -> str:
    """The kernels one call of ``fn`` ran on the GPU, as the profiler saw them (or why not counted)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = collections.Counter(_short(e.name) for e in prof.events()
                                    if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as e:  # noqa: BLE001 - the kernel list is optional
        return f"not counted ({type(e).__name__}: {e})"[:160]
    if not names:
        return "none seen by the profiler; collectives: none (one device)"
    top = ", ".join(f"{n} x{c}" for n, c in names.most_common(8))
    more = ", ..." if len(names) > 8 else ""
    return f"{sum(names.values())} launches a step ({len(names)} kernels): {top}{more}; collectives: none (one device)"


def step_breakdown(model, B: int, L: int, gen, *, replays: int = 10) -> dict:
    """Where the decode step's time goes: each op of ``Llama.decode`` timed alone at B sequences and context L,
    its calls over every layer (each layer's own weights and cache, so the weights stream from HBM as in the
    step) captured in one CUDA graph: ``{op: (us per step, GB/s)}`` (GB/s over the bytes the op reads), in the
    order of the step. ``"sum"`` adds them; the step's own time minus it is launch gaps and the small torch
    ops (embedding row, kv_lens, argmax). A step that folds its norms (``Llama._fold_norms``) is timed as it runs:
    the first and final norms, ``gemv_rms`` (qkv, gate/up) and ``gemv_residual`` (o, down)."""
    from ...kernels import gemv, gemv_residual, gemv_rms, rmsnorm, rope_decode_attention

    cfg, dev, dt = model.config, model.device, model.dtype
    H, eps, hq, hk, D = cfg.hidden_size, cfg.rms_norm_eps, model.heads, model.kv_heads, model.head_dim
    ffn = model.tp.ffn

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(dt)

    x, res = rnd(B, 1, H), rnd(B, 1, H)
    qkv = rnd(B, hq + 2 * hk, 1, D)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    lens = torch.full((B,), L, dtype=torch.int64, device=dev)
    acts = {"qkv": x.view(B, H), "o": rnd(B, hq * D), "gate_up": x.view(B, H), "down": rnd(B, ffn)}

    layers, caches = model.layers, model.caches

    fold = model._fold_norms(B)
    h = x.view(B, H).clone()  # (fold: the residual the o and down GEMVs add into)

    def gemvs(lins, a, act=None, fn=None, norm="mlp_norm"):
        """The GEMV of each Linear in ``lins`` on ``a`` (``fn``: folded, "rms" or "residual"), and the bytes they
        read."""
        def call(li, ly):
            fmt = model.ops.gemv_format(li, a)
            if fn == "rms":
                return functools.partial(gemv_rms, li.weight, a, li.scales, fmt, h, eps, "auto", act=act)
            if fn == "residual":
                return functools.partial(gemv_residual, li.weight, a, li.scales, fmt, h, ly[norm], "auto")
            return functools.partial(gemv, li.weight, a, li.scales, fmt, "auto", act=act)

        return [call(li, ly) for li, ly in zip(lins, layers)], sum(_linear_bytes(li) for li in lins)

    kv_bytes = len(caches) * 2 * B * hk * L * D * caches[0].k.element_size()
    if fold:
        norms = ("rmsnorm (first and final)", [functools.partial(rmsnorm, x, w, eps) for w in
                                               (layers[0]["attn_norm"], model.norm)])
    else:
        norms = ("rmsnorm (2 a layer)", [functools.partial(rmsnorm, x, ly[n], eps, res) for ly in layers
                                         for n in ("attn_norm", "mlp_norm")])
    rms, residual = ("rms", "residual") if fold else (None, None)
    folded = " (norm folded)" if fold else ""
    ops = {norms[0]: (norms[1], None),
           "gemv qkv" + folded: gemvs([ly["qkv"] for ly in layers], acts["qkv"], fn=rms),
           "rope_decode_attention": ([functools.partial(rope_decode_attention, q, k, v, model.cos, model.sin,
                                                        c.k[:B], c.v[:B], lens) for c in caches], kv_bytes),
           "gemv o" + folded: gemvs([ly["o"] for ly in layers], acts["o"], fn=residual),
           "gemv gate_up + silu_mul" + folded: gemvs([ly["gate_up"] for ly in layers], acts["gate_up"], "silu_mul",
                                                     fn=rms),
           "gemv down" + folded: gemvs([ly["down"] for ly in layers], acts["down"], fn=residual, norm="attn_norm"),
           "gemv head": gemvs([model.head], acts["qkv"])}
    out, total = {}, 0.0
    for name, (calls, nbytes) in ops.items():
        graph, _, _ = cuda_graph(calls, 1)
        us = statistics.fmean(time_cuda_events(graph.replay, warmup=1, iters=replays)) * 1e6
        out[name] = (round(us, 1), round(nbytes / us / 1e3, 1) if nbytes else None)
        total += us
        del graph
    out["sum"] = (round(total, 1), None)
    return out


def device_hbm() -> float | None:
    """The current CUDA device's peak HBM bytes a second (``HBM_BYTES_PER_S``), None where unknown or no GPU."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)


def _roofline(row, nbytes: int) -> None:
    """The row's share of the HBM roofline (its bytes over the device's peak; none on a device not listed)."""
    peak = device_hbm()
    if peak:
        row.extra.update(roofline=nbytes / (row.time_us * 1e-6) / peak, hbm_bytes_per_s=peak)


def _per_token(rows, roofline: bool) -> None:
    """A model row's step figures in its extra: bytes a step, ms a token and (``roofline``, CUDA) the share of
    the HBM roofline (a rank's bytes over its own HBM)."""
    for r in rows:
        r.extra.update(bytes_per_step=r.size_bytes, ms_per_token=r.time_us / 1e3)
        if roofline:
            _roofline(r, r.size_bytes)


def _gpu_case(model, weights, name, fmt, B, L, gen, *, iters, rounds, report, baseline_name="torch:graph bf16"):
    """One (weights, B, L) case: the model's decode graph vs the twin's, co-measured; rows into ``report``.
    Returns the xelink row."""
    dev = model.device
    _fill_caches(model, B, L, gen)
    tokens = torch.randint(0, model.config.vocab_size, (B,), device=dev, generator=gen)
    positions = torch.full((B,), L - 1, dtype=torch.int64, device=dev)
    twin = TorchDecode(weights, B, L, model.caches)
    twin.set(tokens, positions)
    tgraph, (tout,), _ = cuda_graph([twin.step], 1)  # warmed up eagerly on a side stream, then captured
    g = model.decode_graph(B)
    logits = g.step(tokens, positions)
    tgraph.replay()
    agree = _agreement(logits, g.next_tokens, *tout)
    xname = f"xelink:graph {fmt}"
    outs = {xname: (logits, g.next_tokens), baseline_name: tout}
    wrong = {xname: 0, baseline_name: 0}

    def check(n):
        wrong[n] += _bad(*outs[n])

    samples = co_measure({xname: g.graph.replay, baseline_name: tgraph.replay}, warmup=2, iters=iters, rounds=rounds,
                         timing=_events, after_block=check)
    shape = _model_shape(name, B, L)
    base = {"shape": shape, "batch": B, "context": L, "timing": "cuda-graph per step",
            "per": "decode step (a token a sequence)", "weights": fmt}
    xbytes, tbytes = model_step_bytes(model, B, L), twin.bytes()
    xrow = make_row(_OP, xname, samples[xname], size_bytes=xbytes, count=B, dtype=fmt, nranks=1, wrong=wrong[xname],
                    baseline=baseline_name, baseline_samples=samples[baseline_name],
                    extra={**base, "impl": "xelink", "prefetch_mb": prefetch_bytes(1, dev) >> 20,
                           "gemv_prefetch_mb": prefetch_bytes(1, dev, gemv=True) >> 20,
                           "o_prefetch_mb": llama_mod.PREFETCH_O_MB,
                           "o_prefetch_from_keys": attention_mod.NEXT_MIN_KEYS, **agree,
                           "check": "agreement with the torch twin at the first replay (bf16 twin: quantization "
                           "error included for w8a16/w4a16)"})
    rows = [xrow]
    if fmt == "bf16":
        rows.append(make_row(_OP, baseline_name, samples[baseline_name], size_bytes=tbytes, count=B, dtype="bf16",
                             nranks=1, wrong=wrong[baseline_name],
                             extra={**base, "sdpa": twin.sdpa()}))
    xrow.extra["kernels"] = _kernels(g.graph.replay)
    if fmt == "bf16":
        rows[1].extra["kernels"] = _kernels(tgraph.replay)
    else:
        xrow.extra["torch_bf16_us"] = xrow.baseline_us
    _per_token(rows, roofline=True)
    for r in rows:
        report.add(r)
    outs.clear()
    del tgraph, tout, twin
    torch.cuda.empty_cache()
    return xrow


def _free() -> None:
    gc.collect()  # a DecodeGraph and its model reference each other
    torch.cuda.empty_cache()


def run_transformers(config, context: int, *, device, new_tokens: int = HF_NEW_TOKENS, reps: int = 3,
                     seed: int = 0) -> tuple[list, dict]:
    """Time per token of transformers' ``LlamaForCausalLM.generate`` (static cache, greedy, eager) on a
    random model of ``config`` (a ``LlamaConfig``), B=1 and a prompt of ``context`` tokens:
    ``(generate(1 + new_tokens) - generate(1)) / new_tokens`` on the host clock after a synchronize, ``reps``
    times, after one call of each. Returns (samples in seconds, extra). Raises ImportError without
    transformers."""
    import transformers

    device = torch.device(device)
    hf_config = transformers.LlamaConfig(**config.to_hf())
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, context), device=device, generator=gen)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, cache_implementation="static", pad_token_id=0)
    eager = hasattr(transformers.GenerationConfig(), "disable_compile")
    if eager:
        kw["disable_compile"] = True  # else generate compiles the forward of a static cache on CUDA
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    wrong = 0

    def generate(n):
        nonlocal wrong
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync()
        wrong += int(out.shape != (1, context + n))
        return time.perf_counter() - t0

    generate(1 + new_tokens)  # the longer first: the static cache it sizes serves both
    generate(1)
    samples = []
    for _ in range(reps):
        long, short = generate(1 + new_tokens), generate(1)
        samples.append((long - short) / new_tokens)
    extra = {"transformers": transformers.__version__, "wrong": wrong,
             "timing": f"host clock after synchronize: (generate(1+{new_tokens}) - generate(1)) / {new_tokens}, "
                       + ("eager (disable_compile=True: no torch.compile)" if eager else "eager (this transformers "
                          "has no disable_compile: it may compile the forward of a static cache)")}
    return samples, extra  # the model is freed with this frame (the caller empties the CUDA cache)


def run_model_gpu(report, name: str = GPU_MODEL, contexts=GPU_CONTEXTS, *, quick: bool = False,
                  transformers: bool = True, iters: int = 20, rounds: int = 3, progress=None, device=None) -> bool:
    """The CUDA model rows (see the module) into ``report``; a weight format or transformers that fails
    leaves a note (with the traceback on stderr) and the others run. Returns True if a format failed.
    ``device``: default the current CUDA device."""
    cases = model_cases(contexts, quick)
    c0 = min(contexts)
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(7)
    weights, failed = None, False
    xbf16 = None
    for fmt in dict.fromkeys(f for f, _, _ in cases):
        mine = [(B, L) for f, B, L in cases if f == fmt]
        model = None
        try:
            model = Llama.random(name, weights=fmt.removesuffix("+head"), quantize_head=fmt.endswith("+head"),
                                 impl="xelink", device=dev, max_batch=max(B for B, _ in mine),
                                 max_seq_len=max(L for _, L in mine) + 16)
            if fmt == "bf16":
                weights = dense_weights(model)
            elif weights is None:
                raise RuntimeError("no bf16 weights for the torch twin (the bf16 model failed)")
            for B, L in mine:
                row = _gpu_case(model, weights, name, fmt, B, L, gen, iters=iters, rounds=rounds, report=report)
                if (B, L) == (1, c0):
                    try:
                        parts = step_breakdown(model, B, L, gen)
                    except Exception as e:  # noqa: BLE001 - the breakdown is an extra: the rows stand without it
                        parts = {f"not measured ({type(e).__name__}: {e})"[:120]: (0, None)}
                    row.extra["breakdown_us"] = parts
                    report.notes.append(f"decode-model {_model_shape(name, B, L)} {fmt}: where the step's "
                                        f"{row.time_us:.0f} us go (each op alone over every layer, us and GB/s): "
                                        + ", ".join(f"{k} {u}" + (f" ({g} GB/s)" if g else "")
                                                    for k, (u, g) in parts.items()))
                if fmt == "bf16" and (B, L) == (1, c0):
                    xbf16 = row
                if progress is not None:
                    progress.step(f"decode-model {_model_shape(name, B, L)} {fmt}: xelink graph vs torch graph")
        except Exception as e:  # noqa: BLE001 - one format's failure must not lose the other rows
            failed = True
            traceback.print_exc(file=sys.stderr)
            report.notes.append(f"decode-model {name} {fmt}: FAILED ({type(e).__name__}: {e})")
        del model
        _free()
        if fmt == "bf16" and transformers:
            _transformers_row(report, name, c0, dev, xbf16, 2 if quick else 3, progress)
    del weights
    _free()
    return failed


def _transformers_row(report, name, context, dev, xrow, reps, progress) -> None:
    """transformers' generate row at B=1 and ``context`` (or a note why not); its ratio into ``xrow``."""
    try:
        samples, extra = run_transformers(CONFIGS[name], context, device=dev, reps=reps)
    except Exception as e:  # noqa: BLE001 - transformers missing or failing: a note, not a failure
        if not isinstance(e, ImportError):
            traceback.print_exc(file=sys.stderr)
        report.notes.append(f"decode-model transformers:generate(static cache): skipped ({type(e).__name__}: "
                            f"{str(e)[:200]})")
        if progress is not None:
            progress.step(f"decode-model {_model_shape(name, 1, context)}: transformers skipped")
        return
    finally:
        _free()
    wrong = extra.pop("wrong")
    nbytes = xrow.size_bytes if xrow is not None else 0  # the same weights and cache rows as the xelink bf16 row
    extra.update(shape=_model_shape(name, 1, context), batch=1, context=context, weights="bf16",
                 per="output token (B=1)", model="LlamaForCausalLM, its own random weights")
    row = make_row(_OP, "transformers:generate(static cache)", samples, size_bytes=nbytes, count=1, dtype="bf16",
                   nranks=1, wrong=wrong, extra=extra)
    row.extra.update(ms_per_token=row.time_us / 1e3)
    if nbytes:
        row.extra.update(bytes_per_step=nbytes)
        _roofline(row, nbytes)
        xrow.extra.update(vs_transformers=row.time_us / xrow.time_us, transformers_us=row.time_us)
    else:
        row.algbw_GBps = None
    report.add(row)
    if progress is not None:
        progress.step(f"decode-model {_model_shape(name, 1, context)}: transformers generate")


# -- parallel rows (issue 26: TP and CP over the launch's ranks) -----------------------------------------


def _par_env(world):
    """(device, dtype, impl, weight name, timing) of the parallel rows: bf16 kernels and CUDA events on CUDA,
    the float32 reference paths and the host clock on CPU ranks."""
    if on_cuda(world):
        return world.device, torch.bfloat16, "xelink", "bf16", _events
    return torch.device("cpu"), torch.float32, "reference", "float32", None


def _fill_cp_caches(model, cached: int, gen) -> None:
    """A CP model's caches as if ``cached`` positions were cached: this rank's round-robin share of them,
    random keys and values (decode attention reads a set of keys: which positions they were does not
    matter)."""
    cp = model.cp
    mine = len(range(cp.rank, cached, cp.size))
    for c in model.caches:
        c.k[:, :, :mine].normal_(generator=gen)
        c.v[:, :, :mine].normal_(generator=gen)
        c.cached(mine, cached)


def tp_rows(world, name: str, context: int, *, iters: int, rounds: int) -> tuple[list, list]:
    """Tensor parallelism over every rank of ``world``: the decode step of ``name`` (B=1, ``context``
    cached positions) with ``tp_group=world`` (CUDA: its ``decode_graph`` replayed; CPU: eager through the
    reference paths) against the same model in plain torch with the launch's collectives (``TorchDecode``
    on this rank's slices: NCCL in a CUDA graph, one GPU per rank; MPI or gloo eager on CPU ranks),
    co-measured, each sample the slowest rank's. (rows on rank 0, notes). Collective."""
    n = world.size
    dev, dtype, impl, wname, timing = _par_env(world)
    cuda = dev.type == "cuda"
    model = Llama.random(name, weights="bf16", impl=impl, device=dev, dtype=dtype, tp_group=world, max_batch=1,
                         max_seq_len=context + 16)
    _fill_caches(model, 1, context, torch.Generator(device=dev).manual_seed(7 + world.rank))  # this rank's heads
    same = torch.Generator(device=dev).manual_seed(11)  # the same token on every rank
    tokens = torch.randint(0, model.config.vocab_size, (1,), device=dev, generator=same)
    positions = torch.full((1,), context - 1, dtype=torch.int64, device=dev)
    notes, twin = [], None
    xname = f"xelink:{'graph' if cuda else 'reference'} {wname} tp={n}"
    if not cuda or one_gpu_per_rank(world):
        base = transport_baseline(world)
        twin = TorchDecode(dense_weights(model), 1, context, model.caches, collectives=base)
        twin.set(tokens, positions)
        tname = f"torch+{base.name}:{'graph' if cuda else 'eager'} {wname} tp={n}"
    else:
        notes.append(f"{_OP} tp={n}: the torch + NCCL twin skipped: {n} ranks share a GPU, and NCCL needs one GPU "
                     f"per rank (the xelink row is time-sliced: a check, not a speed)")
    if cuda:
        g = model.decode_graph(1)
        g.step(tokens, positions)
        variants, outs = {xname: g.graph.replay}, {xname: lambda: (g.logits, g.next_tokens)}
        if twin is not None:
            tgraph, (tout,), _ = cuda_graph([twin.step], 1)
            variants[tname], outs[tname] = tgraph.replay, (lambda: tout)
    else:
        last = {}

        def xel():
            last[xname] = model.decode(tokens, positions)

        def tor():
            last[tname] = twin.step()

        variants, outs = {xname: xel, tname: tor}, {xname: lambda: (last[xname], last[xname].argmax(-1)),
                                                    tname: lambda: last[tname]}
    wrong = dict.fromkeys(variants, 0)

    def check(v):
        wrong[v] += _bad(*outs[v]())

    samples = co_measure(variants, warmup=2, iters=iters, rounds=rounds, barrier=world.barrier,
                         reduce_max=rank_max(world), timing=timing, after_block=check)
    agree = _agreement(*outs[xname](), *outs[tname]()) if twin is not None else {}
    wrong = rank_sums(world, wrong)
    same_tokens = len({tuple(t) for t in world.allgather_object(outs[xname]()[1].tolist())}) == 1
    wrong[xname] += 0 if same_tokens else 1
    shape = _model_shape(name, 1, context)
    base_extra = {"shape": shape, "batch": 1, "context": context, "weights": wname, "tp": n, "cp": 1,
                  "timing": "cuda-graph per step" if cuda else "host clock, eager",
                  "per": "decode step (a token a sequence)", "time": "the slowest rank's, each block"}
    rows = [make_row(_OP, xname, samples[xname], size_bytes=model_step_bytes(model, 1, context), count=1,
                     dtype=dtype, nranks=n, wrong=wrong[xname], baseline=tname if twin is not None else None,
                     baseline_samples=samples[tname] if twin is not None else None,
                     extra={**base_extra, "impl": impl, **agree, "ranks_agree": same_tokens,
                            "collectives": "xelink.all_reduce after O and down, all_gather_into_tensor of the head"})]
    if twin is not None:
        rows.append(make_row(_OP, tname, samples[tname], size_bytes=twin.bytes(), count=1, dtype=dtype, nranks=n,
                             wrong=wrong[tname], extra={**base_extra, "collectives": f"{base.name} all_reduce, "
                                                        f"all_gather", **({"sdpa": twin.sdpa()} if cuda else {})}))
    _per_token(rows, roofline=cuda)
    return (rows if world.rank == 0 else []), notes  # the models and graphs go with this frame (_parallel frees)


def cp_rows(ctx, name: str, context: int, *, iters: int, rounds: int) -> list:
    """Context parallelism over every rank of the world at ``context`` cached positions (B=1): ``Llama`` with
    ``cp_group=world``, the token at position ``context - 1`` (CUDA: its decode graph replayed, the cache writes
    and the merge's all-gather in it; CPU: eager ``Llama.decode``), against TP = 1 on rank 0 alone (measured first,
    the other ranks waiting: CUDA its decode graph, CPU the eager reference path) at the same context. Rows on
    rank 0. Collective."""
    world, n = ctx.world, ctx.world.size
    dev, dtype, impl, wname, timing = _par_env(world)
    cuda = dev.type == "cuda"
    one_name = f"xelink:{'graph' if cuda else 'reference'} {wname} tp=1"

    def one():
        model = Llama.random(name, weights="bf16", impl=impl, device=dev, dtype=dtype, max_batch=1,
                             max_seq_len=context + 16)
        _fill_caches(model, 1, context, torch.Generator(device=dev).manual_seed(7))
        tok = torch.zeros(1, dtype=torch.int64, device=dev)
        pos = torch.full((1,), context - 1, dtype=torch.int64, device=dev)
        if cuda:
            g = model.decode_graph(1)
            g.step(tok, pos)
            got = time_cuda_events(g.graph.replay, warmup=2, iters=iters * rounds)
        else:
            got = time_fn(lambda: model.decode(tok, pos), warmup=2, iters=iters * rounds)
        return got, model_step_bytes(model, 1, context)

    one_samples, one_bytes = world.allgather_object(ctx.solo(one))[0]
    if cuda:
        _free()  # rank 0's model
    model = Llama.random(name, weights="bf16", impl=impl, device=dev, dtype=dtype, cp_group=world, max_batch=1,
                         max_seq_len=context + 16)
    _fill_cp_caches(model, context - 1, torch.Generator(device=dev).manual_seed(7 + world.rank))
    tok = torch.zeros(1, dtype=torch.int64, device=dev)
    pos = torch.full((1,), context - 1, dtype=torch.int64, device=dev)
    xname = f"xelink:{'graph' if cuda else 'eager'} {wname} cp={n}"
    if cuda:
        g = model.decode_graph(1)
        g.step(tok, pos)
        step, out = g.graph.replay, (lambda: g.logits)
    else:
        last = []

        def step():
            last[:] = [model.decode(tok, pos)]

        out = lambda: last[0]  # noqa: E731
    wrong = [0]

    def check(_):
        wrong[0] += _bad(out(), out().argmax(-1))

    samples = co_measure({xname: step}, warmup=2, iters=iters, rounds=rounds, barrier=world.barrier,
                         reduce_max=rank_max(world), timing=timing, after_block=check)
    same_tokens = len(set(world.allgather_object(out().argmax(-1).tolist()[0]))) == 1
    bad = sum(world.allgather_object(wrong[0])) + (0 if same_tokens else 1)
    kv = len(model.caches) * 2 * model.kv_heads * model.head_dim * model.caches[0].k.element_size()
    nbytes = model_step_bytes(model, 1, 0) + kv * (context // n)  # a rank's weights and its share of the cache
    extra = {"shape": _model_shape(name, 1, context), "batch": 1, "context": context, "weights": wname, "tp": 1,
             "cp": n, "timing": "cuda-graph per step" if cuda else "host clock, eager",
             "per": "decode step (a token a sequence)",
             "collectives": "the LSE merge of the ranks' partial attentions (xelink.cp_attention's merge)",
             "ranks_agree": same_tokens, "baseline_timing": "TP = 1 on rank 0 alone, measured first"}
    rows = [make_row(_OP, xname, samples[xname], size_bytes=nbytes, count=1, dtype=dtype, nranks=n, wrong=bad,
                     baseline=one_name, baseline_samples=one_samples, extra={**extra, "impl": impl}),
            make_row(_OP, one_name, one_samples, size_bytes=one_bytes, count=1, dtype=dtype, nranks=1,
                     extra={**extra, "cp": 1, "timing": "CUDA graph per step" if cuda else "host clock, eager"})]
    _per_token(rows, roofline=False)
    return rows if world.rank == 0 else []


def _parallel(ctx) -> list:
    """The TP and CP rows over the world's ranks (every rank takes part); rows on rank 0."""
    world, args = ctx.world, ctx.args
    n, cuda = world.size, on_cuda(world)
    name = (args.model or GPU_MODEL) if cuda else CPU_MODEL
    contexts = args.contexts or ((QUICK_GPU_CONTEXTS if ctx.quick else GPU_CONTEXTS) if cuda else CPU_CONTEXTS)
    cp_context = args.cp_context or ((QUICK_CP_CONTEXT if ctx.quick else CP_CONTEXT) if cuda else CPU_CONTEXTS[-1])
    knobs = timing(ctx, {"iters": 20, "rounds": 3}, {"iters": 10, "rounds": 2}) if cuda else \
        timing(ctx, {"iters": 5, "rounds": 3}, {"iters": 3, "rounds": 2})
    progress = ctx.progress(2)
    rows, notes = [], []
    heads = CONFIGS[name].num_attention_heads
    if heads % n:
        notes.append(f"{_OP} tp={n}: skipped ({name} has {heads} query heads, not a multiple of {n} ranks)")
    else:
        got, more = tp_rows(world, name, min(contexts), **knobs)
        rows, notes = rows + got, notes + more
        if cuda:
            _free()
    progress.step(f"{_OP} {name} tp={n}")
    rows += cp_rows(ctx, name, cp_context, **knobs)
    if cuda:
        _free()
    progress.step(f"{_OP} {name} cp={n} at {cp_context}")
    ctx.extra.update(parallel={"tp": n, "cp": n, "cp_context": cp_context})
    notes.append(f"{_OP} tp=/cp= rows: every one of the {n} ranks takes part, each sample the slowest rank's (the "
                 f"other rows and tp=1: rank 0 alone)")
    ctx.notes += [_model_summary(rows)] + _parallel_targets(rows, name, n) + notes if ctx.lead else []
    return rows


def _parallel_targets(rows, name: str, n: int) -> list:
    """Issue 26's TP and CP targets (Llama-3.1-8B, 2 ranks, one GPU each), marked in their rows."""
    if name != "llama-3.1-8b" or n != 2:
        return []
    lines = []
    for r in rows:
        if r.path.startswith("xelink:") and r.extra.get("tp") == 2 and r.extra["context"] == 1024:
            ok = r.time_us / 1e3 <= TARGET_TP2_MS
            r.extra.update(target_ms=TARGET_TP2_MS, target_ok=ok)
            lines.append(f"target bf16 TP=2 ctx=1024: <= {TARGET_TP2_MS} ms: {r.time_us / 1e3:.2f} ms"
                         + (f" ({r.ratio:.2f}x {r.baseline})" if r.ratio else "") + f": {'met' if ok else 'MISSED'}")
        if r.path.startswith("xelink:") and r.extra.get("cp") == 2 and r.ratio:
            got = (f"{r.time_us / r.baseline_us:.2f}x ({r.time_us / 1e3:.2f} / {r.baseline_us / 1e3:.2f} ms)")
            if r.extra["context"] < CP_CONTEXT:  # the target is set at 128K: a shorter run is reported, not judged
                lines.append(f"target bf16 CP=2: <= {TARGET_CP2}x TP=1's time at {CP_CONTEXT // 1024}K; this run's "
                             f"context {r.extra['context']}: {got} (not judged)")
                continue
            ok = r.time_us <= TARGET_CP2 * r.baseline_us
            r.extra.update(target_x_tp1=TARGET_CP2, target_ok=ok)
            lines.append(f"target bf16 CP=2 ctx={r.extra['context']}: <= {TARGET_CP2}x TP=1's time: {got}: "
                         f"{'met' if ok else 'MISSED'}")
    return lines


def _targets(rows, name: str, device: str | None = None) -> list:
    """Issue 26's targets (Llama-3.1-8B only), each marked in its row's extra; one line each. The millisecond
    targets are judged on an H200 only (``device``: the GPU's name; None: judged): elsewhere the time is
    reported and the ratio targets alone are judged."""
    if name != "llama-3.1-8b":
        return [f"decode-model targets (issue 26): Llama-3.1-8B only (this run: {name})"] if rows else []
    lines = []
    judge_ms = device is None or TARGET_DEVICE in device
    if not judge_ms:
        lines.append(f"decode-model: the millisecond targets are set on one {TARGET_DEVICE}; this run's {device} is "
                     f"reported against them, not judged (the ratios are judged)")
    xel = {(r.extra["weights"], r.extra["batch"], r.extra["context"]): r for r in rows if r.path.startswith("xelink:")}
    for (fmt, B, L), ms in TARGETS_MS.items():
        what = f"target {fmt} B={B} ctx={L}: <= {ms} ms" + (f" and >= {TARGET_VS_TORCH}x the torch graph"
                                                           if fmt == "bf16" else "")
        r = xel.get((fmt, B, L))
        if r is None:
            lines.append(f"{what}: not measured in this run")
            continue
        ok = r.time_us / 1e3 <= ms if judge_ms else True
        got = f"{r.time_us / 1e3:.2f} ms" + ("" if judge_ms else " (not judged)")
        if fmt == "bf16":
            ok = ok and r.ratio is not None and r.ratio >= TARGET_VS_TORCH
            got += f", {r.ratio:.2f}x" if r.ratio is not None else ", no torch time"
        elif not judge_ms:
            lines.append(f"{what}: {got}")
            continue
        r.extra.update(target_ms=ms, target_ok=ok)
        if fmt == "bf16":
            r.extra["target_vs_torch"] = TARGET_VS_TORCH
        lines.append(f"{what}: {got}: {'met' if ok else 'MISSED'}")
    for (fmt, B, L), r in xel.items():
        one = xel.get((fmt, 1, L))
        if fmt == "bf16" and B == 8 and one is not None:
            ratio = r.time_us / one.time_us
            ok = ratio <= TARGET_B8
            r.extra.update(b8_over_b1=ratio, target_b8_over_b1=TARGET_B8, target_ok=ok)
            lines.append(f"target bf16 B=8 ctx={L}: <= {TARGET_B8}x the B=1 time: {ratio:.2f}x "
                         f"({r.time_us / 1e3:.2f} / {one.time_us / 1e3:.2f} ms): {'met' if ok else 'MISSED'}")
    return lines


def _model_summary(rows) -> str:
    """One line per model row: ms per step, the roofline share, the ratio to the torch twin (and transformers)."""
    lines = []
    for r in rows:
        roof = r.extra.get("roofline")
        line = (f"{_OP} {r.extra.get('shape', ''):<28} {r.path:<36} {r.time_us / 1e3:8.3f} ms/token"
                + (f"  roofline {100 * roof:5.1f}%" if roof is not None else "")
                + (f"  vs {r.baseline} {r.ratio:5.2f}x" if r.ratio else ""))
        if "vs_transformers" in r.extra:
            line += f", vs transformers {r.extra['vs_transformers']:5.2f}x"
        if "same_next_token" in r.extra:
            line += (f"  next token {'=' if r.extra['same_next_token'] else '!='} torch's "
                     f"(logits rel. RMS diff {r.extra['logits_rel_rms_diff']:.1e})")
        lines.append(line)
    return "\n".join(lines)


def _summary(rows) -> str:
    """One line per layer-chain path: time a layer and the ratio to the baseline."""
    return "\n".join(f"decode-layer {r.extra.get('shape', '')} {r.path:<26} {r.time_us:8.2f} us a layer"
                     + (f"  vs {r.baseline} {r.ratio:5.2f}x" if r.ratio else "") for r in rows)


def _layers(ctx, default: int) -> int:
    return default if ctx.args.layers is None else ctx.args.layers


def _cpu(ctx) -> list:
    args = ctx.args
    contexts = args.contexts or CPU_CONTEXTS
    progress = ctx.progress((0 if args.model_only else 1) + len(set(contexts)))
    knobs = timing(ctx, {"iters": 5, "rounds": 3}, {"iters": 3, "rounds": 2})
    rows = []
    if not args.model_only:
        cfg = QUICK_CPU_CONFIG if ctx.quick else CPU_CONFIG
        rows = run_cpu(cfg, layers=_layers(ctx, 2), progress=progress, **knobs)
        ctx.notes.append(_summary(rows))
    model_rows = run_model_cpu(CPU_MODEL, contexts, progress=progress, **knobs)
    ctx.extra.update(model=CPU_MODEL, contexts=sorted(set(contexts)))
    ctx.notes.append(_model_summary(model_rows))
    return rows + model_rows


def _gpu(ctx) -> list:
    args = ctx.args
    name = args.model or GPU_MODEL
    contexts = args.contexts or (QUICK_GPU_CONTEXTS if ctx.quick else GPU_CONTEXTS)
    cases = model_cases(contexts, ctx.quick)
    hf = not args.no_transformers
    progress = ctx.progress((0 if args.model_only else 1) + len(cases) + hf)
    report = KernelReport()
    if not args.model_only:
        run_gpu(report, GPU_CONFIG, layers=_layers(ctx, 4), progress=progress,
                **timing(ctx, {"iters": 10, "rounds": 2 if ctx.quick else 3}))
    layer_rows = list(report.rows)
    ctx.extra.update(model=name, contexts=sorted(set(contexts)), cases=[list(c) for c in cases])
    failed = run_model_gpu(report, name, contexts, quick=ctx.quick, transformers=hf, progress=progress,
                           **timing(ctx, {"iters": 20, "rounds": 3}, {"iters": 10, "rounds": 2}))
    model_rows = report.rows[len(layer_rows):]
    ctx.failed = ctx.failed or failed
    ctx.notes += ([_summary(layer_rows)] if layer_rows else []) + [_model_summary(model_rows)]
    ctx.notes += _targets(model_rows, name, torch.cuda.get_device_name()) + report.notes
    ctx.notes.append(f"{_OP} #wrong on CUDA: non-finite logits and next tokens off their row's maximum; the agreement "
                     f"with the torch twin (bf16 rounding over the layers) is recorded, not failed on")
    return report.rows


def run(ctx) -> list:
    """The decode family (CPU reference run, or the GPU benchmark on CUDA) on rank 0, then, on several ranks,
    the TP and CP rows over all of them; rows on rank 0. Collective."""
    args, several = ctx.args, ctx.world.size > 1
    rows = []
    if not (several and args.parallel_only):
        rows = run_single_device(ctx, cpu=_cpu, gpu=_gpu)
    if several and not args.no_parallel:
        rows += _parallel(ctx)
    return rows
