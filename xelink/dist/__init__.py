"""Composed distributed ops on the public layers below (``xelink.symm``, ``xelink.collectives``,
``xelink.kernels``): ``gemm`` (all-gather + matmul, matmul + reduce-scatter, matmul + all-reduce) and
``cp_attention`` (context-parallel attention: ring and all-gather, cp_shard/cp_unshard/cp_positions) and
``cp_attention_varlen`` (packed sequences cut over the ranks)."""
from .cp_attention import CP_ALGOS, CP_LAYOUTS, cp_attention, cp_positions, cp_shard, cp_unshard
from .cp_varlen import cp_attention_varlen
from .gemm import DIST_GEMM_ALGOS, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

__all__ = ["CP_ALGOS", "CP_LAYOUTS", "DIST_GEMM_ALGOS", "all_gather_matmul", "cp_attention", "cp_attention_varlen",
           "cp_positions",
           "cp_shard", "cp_unshard", "matmul_all_reduce", "matmul_reduce_scatter"]
