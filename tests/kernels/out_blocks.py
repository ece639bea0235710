"""Shared by the kernel tests of ``out=``: a NaN-poisoned buffer, and the check that a kernel wrote exactly
the block of it that it was given (every element of the block, none outside)."""
import torch


def poisoned(*shape, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _flat_index(big: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Flat indices into ``big`` (contiguous) of the elements of its view ``block``."""
    idx = torch.tensor((block.data_ptr() - big.data_ptr()) // big.element_size())
    for size, stride in zip(block.shape, block.stride()):
        idx = idx[..., None] + torch.arange(size) * stride
    return idx.reshape(-1).to(big.device)


def only_block_written(big: torch.Tensor, block: torch.Tensor) -> None:
    """``block`` (a view of the poisoned ``big``) holds no NaN, and everything of ``big`` outside it does."""
    assert not block.isnan().any(), "an element of the out= block was left unwritten"
    outside = torch.ones(big.numel(), dtype=torch.bool, device=big.device)
    outside[_flat_index(big, block)] = False
    assert big.reshape(-1)[outside].isnan().all(), "an element outside the out= block was written"
