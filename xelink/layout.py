"""How one sequence is laid over the ranks of a group (context parallelism's layouts) and the ring order
over packages: plain data, shared by the context-parallel schedules (``xelink.dist.schedule``) and the
cost model that prices them (``xelink.cost.predict_cp_attention``).

Layouts: ``contiguous`` (n blocks, rank r holds block r) and ``zigzag`` (2n blocks, rank r holds blocks r
and 2n - 1 - r, in that order), the blocks sized as ``numpy.array_split`` sizes them; over a batch of packed
sequences (``varlen_pieces``, ``cp_attention_varlen``'s): zigzag lays each sequence out on its own, contiguous cuts
the packed tokens.
"""
from __future__ import annotations

__all__ = ["CP_LAYOUTS", "cp_blocks", "cp_pieces", "cp_lengths", "topo_ring", "varlen_pieces"]

CP_LAYOUTS = ("contiguous", "zigzag")


def cp_blocks(seq_len: int, n: int, layout: str) -> list[tuple[int, int]]:
    """The layout's blocks of a sequence of ``seq_len`` over ``n`` ranks as ``(start, length)``, in global
    order: n blocks (contiguous) or 2n (zigzag), sized as ``numpy.array_split`` sizes them (the first
    ``seq_len % blocks`` are one longer)."""
    count = n if layout == "contiguous" else 2 * n
    base, extra = divmod(seq_len, count)
    out, start = [], 0
    for b in range(count):
        length = base + (1 if b < extra else 0)
        out.append((start, length))
        start += length
    return out


def cp_pieces(seq_len: int, n: int, layout: str, rank: int) -> list[tuple[int, int]]:
    """The global ranges ``(start, length)`` rank ``rank`` holds, in its local order: block ``rank``
    (contiguous), or blocks ``rank`` and ``2n - 1 - rank`` concatenated (zigzag)."""
    blocks = cp_blocks(seq_len, n, layout)
    if layout == "contiguous":
        return [blocks[rank]]
    return [blocks[rank], blocks[2 * n - 1 - rank]]


def cp_lengths(seq_len: int, n: int, layout: str) -> list[int]:
    """Every rank's local length."""
    return [sum(length for _, length in cp_pieces(seq_len, n, layout, r)) for r in range(n)]


def varlen_pieces(cu_seqlens, n: int, layout: str, rank: int) -> list[tuple[int, int]]:
    """The global ranges ``(start, length)`` of a packed batch (sequences at offsets ``cu_seqlens``) that rank
    ``rank`` holds, in its local order, one range a sequence's piece: ``contiguous``, its block of the packed
    tokens (``cp_pieces`` of the total), cut where sequences end; ``zigzag``, every sequence laid out on its own
    (``cp_pieces`` of its length), sequence after sequence. Empty ranges are left out."""
    cu = list(cu_seqlens)
    if layout == "contiguous":
        (lo, length), = cp_pieces(cu[-1], n, layout, rank)
        hi = lo + length
        return [(max(a, lo), min(b, hi) - max(a, lo)) for a, b in zip(cu, cu[1:]) if max(a, lo) < min(b, hi)]
    return [(a + s, length) for a, b in zip(cu, cu[1:]) for s, length in cp_pieces(b - a, n, layout, rank) if length]


def topo_ring(packages) -> list[int]:
    """The ring's order of the ranks: package after package (members in rank order), so the ring crosses
    each package boundary once per step instead of at every hop of a rank-ordered ring over interleaved
    packages."""
    return [r for members in packages for r in members]
