"""The kernel chain of one Llama-style decoder layer at decode time (W4A16 weights, a few tokens), on
xelink's kernels, with its pure-torch reference twin.

One step of a layer, for ``B`` sequences of one new token each (``x [B, hidden]``):

1. ``normed, h = rmsnorm(x, norm1, residual=h)``: the residual add fused with the pre-attention norm;
2. ``qkv = gemv(W_qkv, normed)`` (W4A16), viewed as ``(B, heads + 2 * kv_heads, 1, head_dim)``;
3. ``q, k = rope(q, k, cos, sin)``;
4. ``a = decode_attention(q, k_cache, v_cache, kv_lens)`` over the cached tokens;
5. ``o = gemv(W_o, a)``;
6. ``normed, h = rmsnorm(o, norm2, residual=h)``;
7. ``gu = gemv(W_gate_up, normed)``, then ``y = gemv(W_down, gu[:, :ffn])``.

What the chain leaves out (the decode model completes it; the benchmark times the kernels as they are):
the SwiGLU activation (the down GEMV reads the gate half of ``gu``), the V projection's use (the v rows
of ``qkv`` are computed and not read) and the cache update (the new k and v are not written into the
cache: every step attends to the same ``kv_lens`` tokens, so a CUDA graph of the chain can be replayed
as it is).

``decode_layer`` runs a step through xelink's public kernels (``xelink.kernels``: Triton on GPUs, the
reference paths elsewhere) with programmatic dependent launch where asked; ``reference_decode_layer``
is its twin in plain torch (each op in float32, rounded once to the activation dtype, as each kernel
is). ``decode_layers`` / ``reference_decode_layers`` run a stack of layers from a zero residual.
"""
from __future__ import annotations

import dataclasses

import torch

from ..kernels import (decode_attention, gemv, pack_w4a16, reference_decode_attention, reference_gemv,
                       reference_rmsnorm, reference_rope, rmsnorm, rope)

__all__ = ["DecodeLayerConfig", "DecodeLayerWeights", "LLAMA3_8B", "decode_layer", "decode_layers",
           "reference_decode_layer", "reference_decode_layers", "LAYER_IMPLS"]

LAYER_IMPLS = ("auto", "triton", "reference")
_MAX_ROWS = 8  # gemv takes 1-8 rows of activations
_W4_GROUP = 128  # columns of a W4A16 weight sharing one scale


@dataclasses.dataclass(frozen=True)
class DecodeLayerConfig:
    """The shape of a decoder layer.

    Fields:
        hidden: model width H (a multiple of 128 and of ``heads``).
        heads, kv_heads: query and key/value heads (GQA: ``heads`` a multiple of ``kv_heads``).
        ffn: the MLP's inner width (a multiple of 128).
        context: tokens the KV cache holds (``Smax``).
        eps: the RMSNorm epsilon.
    """

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    context: int
    eps: float = 1e-5

    def __post_init__(self):
        for name in ("hidden", "heads", "kv_heads", "ffn", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeLayerConfig: {name}={value!r} must be an int >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"DecodeLayerConfig: hidden={self.hidden} must be a multiple of heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"DecodeLayerConfig: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"DecodeLayerConfig: head_dim={self.hidden // self.heads} must be even (RoPE)")
        for name in ("hidden", "ffn"):
            if getattr(self, name) % _W4_GROUP:
                raise ValueError(f"DecodeLayerConfig: {name}={getattr(self, name)} must be a multiple of "
                                 f"{_W4_GROUP} (the W4A16 scale group)")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps >= 0:
            raise ValueError(f"DecodeLayerConfig: eps={self.eps!r} must be a float >= 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_width(self) -> int:
        """Output width of the fused QKV projection: ``(heads + 2 * kv_heads) * head_dim``."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim


# Llama-3-8B's layer (H 4096, 32 query and 8 KV heads of 128, MLP 14336) over a 4096-token cache.
LLAMA3_8B = DecodeLayerConfig(hidden=4096, heads=32, kv_heads=8, ffn=14336, context=4096)


@dataclasses.dataclass
class DecodeLayerWeights:
    """One layer's weights (W4A16 projections, RMSNorm weights) and its KV cache.

    Fields:
        config: the layer's shape.
        norm1, norm2: ``[hidden]`` RMSNorm weights (before attention, before the MLP).
        qkv, o, gate_up, down: W4A16 pairs ``(packed uint8 [N, K/2], scales [N, K/128])`` of the fused
            QKV ``[qkv_width, hidden]``, output ``[hidden, hidden]``, fused gate/up ``[2 * ffn, hidden]``
            and down ``[hidden, ffn]`` projections (``xelink.kernels.pack_w4a16``).
        k_cache, v_cache: ``(B, kv_heads, context, head_dim)`` in the activation dtype.
    """

    config: DecodeLayerConfig
    norm1: torch.Tensor
    qkv: tuple
    o: tuple
    norm2: torch.Tensor
    gate_up: tuple
    down: tuple
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def random(cls, config: DecodeLayerConfig, *, batch: int = 1, device=None, dtype=torch.bfloat16,
               generator: torch.Generator | None = None) -> "DecodeLayerWeights":
        """A layer with random weights (``randn / sqrt(K)``, packed to W4A16), unit norm weights and a random
        cache of ``batch`` sequences.

        Args:
            config: the layer's shape.
            batch: sequences the cache holds (1-8).
            device, dtype: where and in what dtype (bf16 or fp16: the activations, scales and cache).
            generator: a ``torch.Generator`` on ``device`` for reproducible draws (None: the default one).

        Returns:
            the weights; draws in the order qkv, o, gate_up, down, cache.
        """
        if not isinstance(config, DecodeLayerConfig):
            raise TypeError(f"DecodeLayerWeights.random: config must be a DecodeLayerConfig, got "
                            f"{type(config).__name__}")
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= _MAX_ROWS:
            raise ValueError(f"DecodeLayerWeights.random: batch={batch!r} must be an int in 1..{_MAX_ROWS}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"DecodeLayerWeights.random: dtype={dtype} must be bfloat16 or float16")
        H, D = config.hidden, config.head_dim

        def packed(n, k):
            return pack_w4a16(torch.randn(n, k, device=device, generator=generator) * k ** -0.5, dtype)

        qkv, o = packed(config.qkv_width, H), packed(H, H)
        gate_up, down = packed(2 * config.ffn, H), packed(H, config.ffn)
        kv = torch.randn(2, batch, config.kv_heads, config.context, D, device=device, generator=generator).to(dtype)
        ones = torch.ones(H, device=device, dtype=dtype)
        return cls(config, ones, qkv, o, ones.clone(), gate_up, down, kv[0], kv[1])


def _check_step(fn: str, x, residual, layer, cos, sin, kv_lens) -> None:
    """Shapes of one step's arguments; the kernels check dtypes and devices themselves."""
    if not isinstance(layer, DecodeLayerWeights):
        raise TypeError(f"{fn}: layer must be a DecodeLayerWeights, got {type(layer).__name__}")
    for name, t in (("x", x), ("residual", residual), ("cos", cos), ("sin", sin), ("kv_lens", kv_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    cfg = layer.config
    if x.dim() != 2 or x.shape[1] != cfg.hidden or not 1 <= x.shape[0] <= _MAX_ROWS:
        raise ValueError(f"{fn}: x.shape={tuple(x.shape)} must be [B, hidden={cfg.hidden}] with 1 <= B <= "
                         f"{_MAX_ROWS}")
    if residual.shape != x.shape:
        raise ValueError(f"{fn}: residual.shape={tuple(residual.shape)} != x.shape={tuple(x.shape)}")
    B = x.shape[0]
    want = (B, cfg.kv_heads, cfg.context, cfg.head_dim)
    if tuple(layer.k_cache.shape) != want or tuple(layer.v_cache.shape) != want:
        raise ValueError(f"{fn}: k_cache.shape={tuple(layer.k_cache.shape)}, v_cache.shape="
                         f"{tuple(layer.v_cache.shape)} must be {want} (B, kv_heads, context, head_dim)")
    if tuple(kv_lens.shape) != (B,):
        raise ValueError(f"{fn}: kv_lens.shape={tuple(kv_lens.shape)} must be ({B},)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[-1] != cfg.head_dim:
            raise ValueError(f"{fn}: {name}.shape={tuple(t.shape)} must end in head_dim={cfg.head_dim}")


def _check_impl(fn: str, impl) -> None:
    if impl not in LAYER_IMPLS:
        raise ValueError(f"{fn}: impl={impl!r} must be one of {', '.join(map(repr, LAYER_IMPLS))}")


def _split_heads(qkv: torch.Tensor, cfg: DecodeLayerConfig):
    """``[B, qkv_width]`` -> (q ``(B, heads, 1, D)``, k ``(B, kv_heads, 1, D)``), views."""
    heads = qkv.view(qkv.shape[0], 1, -1, cfg.head_dim).transpose(1, 2)
    return heads[:, :cfg.heads], heads[:, cfg.heads:cfg.heads + cfg.kv_heads]


def decode_layer(x: torch.Tensor, residual: torch.Tensor, layer: DecodeLayerWeights, cos: torch.Tensor,
                 sin: torch.Tensor, kv_lens: torch.Tensor, *, impl: str = "auto", pdl=None, gemv_pdl=None):
    """One step of a decoder layer's kernel chain through xelink's kernels (module docstring).

    Args:
        x: ``[B, hidden]`` the layer's input (the previous layer's down projection), bf16/fp16, 1 <= B <= 8.
        residual: ``[B, hidden]`` the residual stream before this layer (zeros at the first layer).
        layer: the layer's weights and KV cache (``DecodeLayerWeights``).
        cos, sin: the new token's RoPE table, ``(1, head_dim)`` (one position for every sequence) or any
            shape ``xelink.kernels.rope`` takes for ``S = 1``.
        kv_lens: ``(B,)`` int32/int64 on x's device: cached tokens each sequence attends to.
        impl: ``"auto"`` (each kernel's own choice: Triton on GPUs, the tensor-core GEMV on CUDA sm80+,
            else the reference paths), ``"triton"`` or ``"reference"``, passed to every kernel.
        pdl: programmatic dependent launch of RMSNorm, RoPE and decode attention (``xelink.kernels.rmsnorm``'s
            ``pdl``): None (on where it exists), True, False, ``"early"`` or ``"late"``.
        gemv_pdl: the GEMVs' ``pdl`` (``xelink.kernels.gemv``): None (gemv's default: on for the CUDA GEMV
            on sm90+), True, False, ``"early"`` or ``"late"``.

    Returns:
        ``(y, residual)``: ``y [B, hidden]`` the down projection (the next layer's ``x``) and the residual
        stream after the MLP's norm, both in x's dtype.

    Raises:
        TypeError, ValueError: bad shapes, an unknown impl, or what a kernel raises for its inputs.
    """
    fn = "decode_layer"
    _check_impl(fn, impl)
    _check_step(fn, x, residual, layer, cos, sin, kv_lens)
    cfg, B = layer.config, x.shape[0]

    def mm(w, a):
        return gemv(w[0], a, w[1], "w4a16", impl, pdl=gemv_pdl)

    normed, h = rmsnorm(x, layer.norm1, cfg.eps, residual=residual, impl=impl, pdl=pdl)
    q, k = _split_heads(mm(layer.qkv, normed), cfg)
    q, k = rope(q, k, cos, sin, impl=impl, pdl=pdl)
    a = decode_attention(q, layer.k_cache, layer.v_cache, kv_lens, impl=impl, pdl=pdl)
    o = mm(layer.o, a.reshape(B, cfg.hidden))
    normed, h = rmsnorm(o, layer.norm2, cfg.eps, residual=h, impl=impl, pdl=pdl)
    gu = mm(layer.gate_up, normed)
    return mm(layer.down, gu[:, :cfg.ffn]), h


def reference_decode_layer(x: torch.Tensor, residual: torch.Tensor, layer: DecodeLayerWeights, cos: torch.Tensor,
                           sin: torch.Tensor, kv_lens: torch.Tensor):
    """Pure-torch twin of ``decode_layer``: each op in float32 on the exactly dequantized weights, rounded
    once to x's dtype (``xelink.kernels.reference_gemv``, ``reference_rmsnorm``, ``reference_rope``,
    ``reference_decode_attention``).

    Args and Returns: as ``decode_layer``.
    """
    fn = "reference_decode_layer"
    _check_step(fn, x, residual, layer, cos, sin, kv_lens)
    cfg, B = layer.config, x.shape[0]

    def mm(w, a):
        return reference_gemv(w[0], a, w[1], "w4a16")

    normed, h = reference_rmsnorm(x, layer.norm1, cfg.eps, residual)
    q, k = _split_heads(mm(layer.qkv, normed), cfg)
    q, k = reference_rope(q, k, cos, sin)
    a = reference_decode_attention(q, layer.k_cache, layer.v_cache, kv_lens)
    o = mm(layer.o, a.reshape(B, cfg.hidden))
    normed, h = reference_rmsnorm(o, layer.norm2, cfg.eps, h)
    gu = mm(layer.gate_up, normed)
    return mm(layer.down, gu[:, :cfg.ffn]), h


def _check_layers(fn: str, layers) -> list:
    layers = list(layers) if isinstance(layers, (list, tuple)) else None
    if not layers:
        raise ValueError(f"{fn}: layers must be a non-empty list of DecodeLayerWeights")
    return layers


def decode_layers(x: torch.Tensor, layers, cos: torch.Tensor, sin: torch.Tensor, kv_lens: torch.Tensor, *,
                  impl: str = "auto", pdl=None, gemv_pdl=None):
    """A stack of decoder layers' chains, from a zero residual: each layer's ``y`` is the next one's ``x``.

    Args:
        x: ``[B, hidden]`` the first layer's input.
        layers: a list of ``DecodeLayerWeights`` of one config.
        cos, sin, kv_lens, impl, pdl, gemv_pdl: as ``decode_layer`` (the same for every layer).

    Returns:
        ``(y, residual)`` of the last layer.
    """
    layers = _check_layers("decode_layers", layers)
    y, h = x, torch.zeros_like(x)
    for layer in layers:
        y, h = decode_layer(y, h, layer, cos, sin, kv_lens, impl=impl, pdl=pdl, gemv_pdl=gemv_pdl)
    return y, h


def reference_decode_layers(x: torch.Tensor, layers, cos: torch.Tensor, sin: torch.Tensor, kv_lens: torch.Tensor):
    """Pure-torch twin of ``decode_layers`` (``reference_decode_layer`` per layer). Args and Returns: as it."""
    layers = _check_layers("reference_decode_layers", layers)
    y, h = x, torch.zeros_like(x)
    for layer in layers:
        y, h = reference_decode_layer(y, h, layer, cos, sin, kv_lens)
    return y, h
