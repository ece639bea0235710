"""Shared by the kernel tests: for ``out=``, a NaN-poisoned buffer and the check that a kernel wrote exactly
the block of it that it was given (every element of the block, none outside); for kernels that keep
per-stream scratch (split.py), the same calls enqueued on two streams at once."""
import torch


def on_two_streams(run, repeats: int = 4) -> list:
    """``run()`` ``repeats`` times on each of two new streams, the streams' work interleaved on the GPU;
    returns every result (GPU only)."""
    side = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    torch.cuda.synchronize()
    for st in side:
        with torch.cuda.stream(st):
            outs += [run() for _ in range(repeats)]
    torch.cuda.synchronize()
    return outs


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
