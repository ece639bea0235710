"""Models built from xelink's kernels and collectives.

- ``Llama`` (``llama.py``): a Llama-style causal LM read from a Hugging Face folder
  (``Llama.from_pretrained``), tensor parallelism applied from outside (``parallel.py``), generation
  (``generate.py``), folder I/O and random folders (``checkpoint.py``: ``save_random_llama``, ``CONFIGS``).
- ``decode_layer``: the kernel chain of one decoder layer at decode time (W4A16 projections, RMSNorm,
  RoPE, decode attention over a KV cache), with its pure-torch twin.
"""
from .checkpoint import CONFIGS, LlamaConfig, save_random_llama
from .decode_layer import (LAYER_IMPLS, LLAMA3_8B, DecodeLayerConfig, DecodeLayerWeights, decode_layer,
                           decode_layers, reference_decode_layer, reference_decode_layers)
from .llama import Llama

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "save_random_llama", "DecodeLayerConfig", "DecodeLayerWeights", "LAYER_IMPLS", "LLAMA3_8B", "decode_layer", "decode_layers",
           "reference_decode_layer", "reference_decode_layers"]
