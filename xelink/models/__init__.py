"""Models built from xelink's kernels and collectives.

Today: the kernel chain of a Llama-style decoder layer at decode time (``decode_layer``: W4A16
projections, RMSNorm, RoPE, decode attention over a KV cache), with its pure-torch twin; the decode
model grows from it.
"""
from .decode_layer import (LAYER_IMPLS, LLAMA3_8B, DecodeLayerConfig, DecodeLayerWeights, decode_layer,
                           decode_layers, reference_decode_layer, reference_decode_layers)

__all__ = ["DecodeLayerConfig", "DecodeLayerWeights", "LAYER_IMPLS", "LLAMA3_8B", "decode_layer", "decode_layers",
           "reference_decode_layer", "reference_decode_layers"]
