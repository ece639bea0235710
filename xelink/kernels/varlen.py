"""What the packed-sequence attention kernels share (``flash_attention_varlen``: the forward in ``attention``, the
backward's passes in ``attention_bwd``): a packed (rows, heads, d) tensor's strides as the kernels take them, and
the two steps every VARLEN program starts with (which sequence-head and tile it is, where its sequence lies)."""
from __future__ import annotations

from .common import tl, triton

__all__ = ["packed_strides", "varlen_ids", "varlen_sequence"]


def packed_strides(t) -> tuple:
    """The (batch, head, row, d) strides the kernels take of a packed (rows, heads, d) tensor: no batch stride."""
    return 0, t.stride(1), t.stride(0), t.stride(2)


if triton is not None:

    @triton.jit
    def varlen_ids(VARLEN: tl.constexpr):
        """(tile, tiles, batch x head) of this program: the grid is (tiles, B * H), or VARLEN (B * H, tiles) (a
        packed batch may hold more sequence-heads than a grid's second dimension takes: 65535 on CUDA)."""
        tile = tl.program_id(0)
        tiles = tl.num_programs(0)
        bh = tl.program_id(1)
        if VARLEN:
            tile = tl.program_id(1)
            tiles = tl.num_programs(1)
            bh = tl.program_id(0)
        return tile, tiles, bh

    @triton.jit
    def varlen_sequence(CU_Q, CU_K, b):
        """Sequence b of a packed batch: its first query and key rows (int64) and its query and key counts."""
        q0 = tl.load(CU_Q + b).to(tl.int64)
        k0 = tl.load(CU_K + b).to(tl.int64)
        return q0, k0, (tl.load(CU_Q + b + 1) - q0).to(tl.int32), (tl.load(CU_K + b + 1) - k0).to(tl.int32)
