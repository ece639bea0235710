"""Collectives that autograd differentiates (``xelink.nn.functional``), as torch.distributed.nn."""
from . import functional

__all__ = ["functional"]
