"""Composed distributed ops on the public layers below (``xelink.symm``, ``xelink.collectives``,
``xelink.kernels``): ``gemm`` (all-gather + matmul, matmul + reduce-scatter, matmul + all-reduce)."""
from .gemm import DIST_GEMM_ALGOS, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

__all__ = ["DIST_GEMM_ALGOS", "all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter"]
