"""Hugging Face Llama/Mistral/Qwen2/Qwen3/Phi-3 folders: the config, slice-wise tensor reads, random folders for
tests.

A folder holds ``config.json``, one ``*.safetensors`` file or several with ``model.safetensors.index.json``,
and optionally ``generation_config.json`` and ``tokenizer.json``. ``LlamaConfig.from_hf`` reads the
fields a Llama-style decoder needs (a sliding window and the layers it applies to included) and refuses the ones
it cannot serve (an activation other than SiLU, a RoPE scaling it does not know); ``Checkpoint`` opens the
files lazily and reads row or column slices of a named tensor (``safetensors``' ``get_slice``), so each
rank loads only what it keeps. ``save_random_llama`` writes such a folder with random weights;
``RandomWeights`` draws random tensors of a config where they are read (no folder: ``Llama.random``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import zlib
from pathlib import Path

import torch

__all__ = ["CONFIGS", "Checkpoint", "LlamaConfig", "RandomWeights", "save_random_llama"]

_SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# rope_scaling types: (keys required, keys taken when given); llama3 and yarn also take the pretraining length
_ROPE_KEYS = {"llama3": (("factor", "low_freq_factor", "high_freq_factor"), ()), "linear": (("factor",), ()),
              "yarn": ((), ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                            "truncate"))}
_SERVED_STORAGE = ("F32", "F16", "BF16", "F64")  # safetensors dtype names of the weights a folder may store
HEAD = "lm_head.weight"  # (a tied model's is the embedding's, unless stored)
_NO_ATTENTION_BIAS = ("qwen2", "phi3", "mistral")  # config.json's flag ignored, as by their transformers classes
_NO_MLP_BIAS = ("qwen2", "qwen3", "phi3", "mistral")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-style decoder, read from a Hugging Face ``config.json``.

    Fields follow the HF names: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``vocab_size``, ``rms_norm_eps``,
    ``rope_theta``, ``rope_scaling`` (None or a dict with ``rope_type`` "llama3", "linear" or "yarn"),
    ``max_position_embeddings``, ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``, ``model_type``
    ("llama", "mistral", "qwen2", "qwen3" or "phi3", as transformers builds them: Qwen2's q/k/v projections always
    have a bias, its o one never; Qwen3 RMS-normalizes each head's q and k before the RoPE (``qk_norm``); Phi-3
    stores q, k, v in one ``qkv_proj`` and gate, up in one ``gate_up_proj`` (``fused_projections``), without
    biases; none of them has MLP biases, whatever ``attention_bias`` / ``mlp_bias`` say: ``qkv_bias``, ``o_bias``).
    ``sliding_window`` (Mistral, Phi-3, Qwen2/Qwen3 with ``use_sliding_window``; None: full attention) is the keys a
    query sees, ending at its own; ``layer_types`` says which layers slide (transformers' names, "full_attention" /
    "sliding_attention"; None: every layer): ``layer_window(i)``.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    sliding_window: int | None = None
    layer_types: tuple | None = None

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (its keys a query sees), or None: full attention."""
        if self.sliding_window is None or self.layer_types is not None and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def fused_projections(self) -> bool:
        return self.model_type == "phi3"

    @classmethod
    def from_hf(cls, hf: dict, fn: str = "LlamaConfig.from_hf") -> "LlamaConfig":
        """Read a Hugging Face config dict (old ``rope_theta``/``rope_scaling`` or new ``rope_parameters``)."""
        if not isinstance(hf, dict):
            raise TypeError(f"{fn}: config must be a dict, got {type(hf).__name__}")
        model_type = hf.get("model_type", "llama")
        if model_type not in _SUPPORTED_TYPES:
            raise ValueError(f"{fn}: model_type={model_type!r} is not supported (one of {_SUPPORTED_TYPES})")
        quant = hf.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ValueError(f"{fn}: quantization_config (quant_method={method!r}) is not supported: load the "
                             f"unquantized folder and pass weights='w8a16' or 'w4a16' to quantize at load")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{fn}: hidden_act={act!r} is not supported (only 'silu')")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if name not in hf:
                raise ValueError(f"{fn}: config has no {name!r}")
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        # Transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; real folders have rope_theta
        # and rope_scaling (None, or {rope_type|type: ..., factor, ...}).
        rope = dict(hf.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = dict(hf.get("rope_scaling") or {}) or rope
        kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        # the pretraining length, as transformers takes it: config.json's own field first, then rope_scaling's
        old = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") \
            or hf.get("max_position_embeddings", 2048)
        if kind == "default":
            scaling = None
        elif kind in _ROPE_KEYS:
            needed, optional = _ROPE_KEYS[kind]
            missing = [k for k in needed if scaling.get(k) is None]
            if missing:
                raise ValueError(f"{fn}: rope_scaling of type {kind!r} lacks {missing}")
            scaling = {k: scaling[k] for k in needed + optional if scaling.get(k) is not None}
            scaling["rope_type"] = kind
            if kind != "linear":
                scaling["original_max_position_embeddings"] = int(old)
        else:
            raise ValueError(f"{fn}: rope_scaling type {kind!r} is not supported (None, "
                             f"{', '.join(map(repr, _ROPE_KEYS))})")
        # As transformers reads them: Mistral's window defaults to 4096, Qwen's is off without use_sliding_window
        # and then slides on layers max_window_layers.. unless layer_types says otherwise; Phi-3's defaults to none.
        # A Mistral folder with layer_types is a Ministral one to transformers' Auto classes (its layers alternate).
        window = hf.get("sliding_window", 4096 if model_type == "mistral" else None)
        if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False) or model_type == "llama":
            window = None
        layer_types = hf.get("layer_types")
        if window is not None and layer_types is None and model_type in ("qwen2", "qwen3"):
            first = hf.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(hf["num_hidden_layers"])]
        if window is None or layer_types is None:
            layer_types = None
        else:
            layer_types = tuple(layer_types)
        partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"{fn}: partial_rotary_factor={partial!r} is not supported (only 1.0)")
        cfg = cls(hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                  num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=kv,
                  head_dim=head_dim, vocab_size=hf["vocab_size"],
                  rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5 if model_type == "phi3" else 1e-6)),  # (theirs)
                  rope_theta=theta, rope_scaling=scaling,
                  max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                  tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  # (the types whose transformers class has no such flag ignore it, as transformers does)
                  attention_bias=bool(hf.get("attention_bias", False)) and model_type not in _NO_ATTENTION_BIAS,
                  mlp_bias=bool(hf.get("mlp_bias", False)) and model_type not in _NO_MLP_BIAS,
                  model_type=model_type, sliding_window=window, layer_types=layer_types)
        cfg.check(fn)
        return cfg

    def check(self, fn: str) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{fn}: {name}={v!r} must be an int >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{fn}: num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"{fn}: head_dim={self.head_dim} must be even (RoPE)")
        if self.model_type not in _SUPPORTED_TYPES:
            raise ValueError(f"{fn}: model_type={self.model_type!r} is not supported (one of {_SUPPORTED_TYPES})")
        rs = self.rope_scaling
        if rs is not None:  # (from_hf writes {rope_type, its keys}; a config built by hand must too)
            kind = rs.get("rope_type") if isinstance(rs, dict) else None
            missing = [k for k in _ROPE_KEYS[kind][0] if rs.get(k) is None] if kind in _ROPE_KEYS else []
            if kind != "linear" and kind in _ROPE_KEYS and rs.get("original_max_position_embeddings") is None:
                missing.append("original_max_position_embeddings")
            if kind not in _ROPE_KEYS or missing:
                raise ValueError(f"{fn}: rope_scaling={rs!r} must be None or a dict with rope_type one of "
                                 f"{', '.join(map(repr, _ROPE_KEYS))} and its keys"
                                 + (f" (lacks {missing})" if missing else ""))
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"{fn}: sliding_window={w!r} must be None or an int >= 1")
        if w is not None and self.model_type == "llama":
            raise ValueError(f"{fn}: sliding_window={w} on model_type 'llama' (transformers' Llama has none): use "
                             f"'mistral', 'phi3', 'qwen2' or 'qwen3'")
        kinds = ("full_attention", "sliding_attention")
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers or
                                             any(t not in kinds for t in self.layer_types)):
            raise ValueError(f"{fn}: layer_types={list(self.layer_types)} must give each of the "
                             f"{self.num_hidden_layers} layers one of {kinds}")

    def to_hf(self) -> dict:
        """The ``config.json`` dict of this config (the classic field names every transformers reads)."""
        arch = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "phi3": "Phi3ForCausalLM"}.get(self.model_type, "LlamaForCausalLM")
        out = {"architectures": [arch], "model_type": self.model_type, "hidden_act": "silu",
               "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
               "pad_token_id": None}  # (Phi3Config's default, 32000, lies outside a small vocabulary)
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        out["layer_types"] = None if self.layer_types is None else list(self.layer_types)
        if self.model_type == "llama" or out["layer_types"] is None:
            del out["layer_types"]  # (every layer alike: each transformers version's default)
        if self.model_type == "llama":
            del out["sliding_window"]
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
            if self.sliding_window is not None and self.layer_types is None:  # every layer slides
                out["max_window_layers"] = 0
        return out


# Real models' shapes (from their config.json) and a tiny one for tests and examples.
CONFIGS = {
    "llama-3.1-8b": LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072),
    "llama-3.2-1b": LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True),
    # Qwen/Qwen3-0.6B: 16 heads of 128 over a hidden 1024 (a head_dim of its own), q/k norms, tied embeddings.
    "qwen3-0.6b": LlamaConfig(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, model_type="qwen3"),
    # Widths of multiples of 128 per rank at TP = 2, so every weight format loads at TP 1 and 2.
    "tiny": LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=512, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
        max_position_embeddings=2048),
}


def _resolve_config(config, fn: str) -> LlamaConfig:
    if isinstance(config, LlamaConfig):
        config.check(fn)  # (a config built by hand: from_hf's checks ran on the others)
        return config
    if isinstance(config, str):
        if config not in CONFIGS:
            raise ValueError(f"{fn}: config={config!r} is not a named config ({', '.join(CONFIGS)})")
        return CONFIGS[config]
    if isinstance(config, dict):
        return LlamaConfig.from_hf(config, fn)
    raise TypeError(f"{fn}: config must be a name, a dict or a LlamaConfig, got {type(config).__name__}")


def head_tensor(cfg: LlamaConfig, source) -> str:
    """The tensor the head reads: ``lm_head.weight``, or a tied model's embedding unless ``source`` (a
    ``Checkpoint`` or ``RandomWeights``) stores a head anyway (a fine-tune that untied it and kept the flag:
    transformers 5 warns and reads the stored one)."""
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings and not source.has(HEAD) else HEAD


def tensor_shapes(cfg: LlamaConfig) -> dict:
    """Every tensor of a Hugging Face Llama folder of this config: name -> shape."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        if cfg.fused_projections:
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                del shapes[p + name + ".weight"]
            shapes.update({p + "self_attn.qkv_proj.weight": (q + 2 * kv, H), p + "mlp.gate_up_proj.weight": (2 * I, H)})
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,),
                           p + "mlp.down_proj.bias": (H,)})
    if not cfg.tie_word_embeddings:
        shapes[HEAD] = (cfg.vocab_size, H)
    return shapes


class Checkpoint:
    """The safetensors files of a folder, opened lazily; reads whole tensors or slices by name.

    Args:
        path: the folder (``model.safetensors``, or shards listed in ``model.safetensors.index.json``, or
            any ``*.safetensors`` files).
    """

    def __init__(self, path, fn: str = "Checkpoint"):
        from safetensors import safe_open  # the test/model extra; imported where a folder is read

        self.path, self._open, self._handles, self._keys = Path(path), safe_open, {}, {}
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            self.where = {name: self.path / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{fn}: no *.safetensors files in {self.path}")
            self.where = {}
            for f in files:
                for name in self._handle(f).keys():
                    self.where[name] = f
        self.fn = fn

    def _handle(self, f: Path):
        if f not in self._handles:
            if not f.exists():
                raise FileNotFoundError(f"{getattr(self, 'fn', 'Checkpoint')}: {f} (listed in the index) is missing")
            self._handles[f] = self._open(str(f), framework="pt")
        return self._handles[f]

    def has(self, name: str) -> bool:
        """Whether the folder stores tensor ``name``."""
        return name in self.where

    def _slice(self, name: str):
        """The stored tensor ``name`` (safetensors' lazy slice), or a ValueError naming it (and the shard the index
        puts it in, where that file does not hold it: safetensors' own error named neither shard nor folder)."""
        if name not in self.where:
            raise ValueError(f"{self.fn}: tensor {name!r} is missing from {self.path}")
        f = self.where[name]
        handle = self._handle(f)
        if name not in self._keys.setdefault(f, set(handle.keys())):
            raise ValueError(f"{self.fn}: tensor {name!r} is missing from {f.name}, where "
                             f"model.safetensors.index.json puts it ({self.path})")
        return handle.get_slice(name)

    def shape(self, name: str) -> tuple:
        return tuple(self._slice(name).get_shape())

    def check(self, shapes: dict) -> None:
        """Every named tensor present with its shape and stored in a float dtype that can be served (F32, F16,
        BF16, F64), before any read."""
        for name, want in shapes.items():
            got = self.shape(name)
            if got != tuple(want):
                raise ValueError(f"{self.fn}: tensor {name!r} has shape {got}, the config needs {tuple(want)}")
            stored = self._slice(name).get_dtype()
            if stored not in _SERVED_STORAGE:
                raise ValueError(f"{self.fn}: tensor {name!r} is stored as {stored}, which cannot be served (one of "
                                 f"{', '.join(_SERVED_STORAGE)}; quantized checkpoints are not read)")

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or its ``[start:stop]`` slice along ``dim`` (0 or 1), read alone from the file."""
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        return sl[start:stop] if dim == 0 else sl[:, start:stop]


class RandomWeights:
    """A stand-in for :class:`Checkpoint` whose tensors are drawn when read, on ``device``: ``N(0, 0.02)``
    (norms ``1 + N(0, 0.02)``) from a generator seeded by ``seed`` and the tensor's name, so every rank's
    slice of a tensor comes from the same tensor (tensor parallelism) without any file. Not the values
    ``save_random_llama`` writes (that one draws on the CPU in name order)."""

    def __init__(self, cfg: LlamaConfig, seed: int, device):
        self.shapes, self.seed, self.device = tensor_shapes(cfg), int(seed), torch.device(device)

    def has(self, name: str) -> bool:
        """Whether the config has tensor ``name``."""
        return name in self.shapes

    def check(self, shapes: dict) -> None:
        """Nothing to check: the shapes are the config's own."""

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (float32), or its ``[start:stop]`` slice along ``dim`` (0 or 1)."""
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.randn(self.shapes[name], generator=g, device=self.device) * 0.02
        if name.endswith("norm.weight"):
            t += 1.0
        if dim is None:
            return t
        return t[start:stop] if dim == 0 else t[:, start:stop]


def save_random_llama(path, config, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      max_shard_bytes: int = 2 << 30, generation_config: dict | None = None) -> Path:
    """Write a Hugging Face Llama folder with random weights (no download needed): ``config.json``,
    ``generation_config.json`` and ``model.safetensors`` (or shards with an index above ``max_shard_bytes``).

    Args:
        path: the folder (created).
        config: a named config (``CONFIGS``: "llama-3.1-8b", "llama-3.2-1b", "qwen3-0.6b", "tiny"), a HF-style dict or a
            ``LlamaConfig``.
        seed: weights are ``N(0, 0.02)`` (norms ``1 + N(0, 0.02)``) drawn from this seed, in name order.
        dtype: the stored dtype.
        max_shard_bytes: the largest shard file.
        generation_config: the ``generation_config.json`` dict (default: greedy, eos 2).

    Returns:
        the folder's path.
    """
    from safetensors.torch import save_file

    fn = "save_random_llama"
    cfg = _resolve_config(config, fn)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{fn}: dtype={dtype!r} must be a floating torch.dtype")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    gen = generation_config or {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    g = torch.Generator().manual_seed(seed)
    shards, current, size = [], {}, 0
    for name, shape in tensor_shapes(cfg).items():
        t = torch.randn(shape, generator=g) * 0.02
        if name.endswith("norm.weight"):
            t += 1.0
        t = t.to(dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # an earlier save's shards and index (a stale index names missing files)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


def read_json(path: Path, name: str) -> dict | None:
    f = Path(path) / name
    return json.loads(f.read_text()) if f.exists() else None


def rope_inv_freq(cfg: LlamaConfig) -> tuple[torch.Tensor, float]:
    """The RoPE inverse frequencies ``[head_dim / 2]`` in float32 and the factor cos and sin are multiplied by,
    with the config's scaling (Llama 3's, linear or YaRN) applied as transformers applies it."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = cfg.rope_scaling
    if s is None:
        return inv, 1.0
    if s["rope_type"] == "linear":
        return inv / s["factor"], 1.0
    if s["rope_type"] == "yarn":
        return _yarn(cfg, s)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(cfg: LlamaConfig, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023), as transformers computes it: each frequency between the original one and
    1 / ``factor`` of it along a linear ramp over the dimensions that turn between ``beta_slow`` and ``beta_fast``
    times in the pretraining length; cos and sin scaled by ``0.1 ln(factor) + 1`` (or ``attention_factor``, or
    the ratio of two such terms with ``mscale`` / ``mscale_all_dim``)."""
    D, base, old = cfg.head_dim, cfg.rope_theta, s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_position_embeddings / old

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def turns_dim(turns):  # the dimension that turns ``turns`` times over the pretraining length
        return D * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_dim(s.get("beta_fast") or 32), turns_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, D, 2).float() / D)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep, float(attention)

