"""Inputs the distributed GEMM tests share (CPU and GPU modules): small integers, exact in every
summation order, and b as a contiguous [K, N] or as the transposed view of an nn.Linear-style weight."""
import torch


def ints(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def weight(k, n, seed, dtype, transposed):
    """[K, N]: contiguous, or the transposed view of an [N, K] nn.Linear-style weight."""
    return ints((n, k), seed, dtype).t() if transposed else ints((k, n), seed, dtype)
