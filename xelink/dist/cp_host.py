"""The context-parallel ring on CPU ranks: nonblocking point-to-point of the packed KV blocks, overlapped with
the reference flash attention of the block at hand.

The ring runs in ``schedule.topo_ring`` order on the group's private duplicate (``host``'s, made on the
first call and freed with the group), so its messages never match the user's own; a block travels under
the tag of its owner, unique per pair and call. At step s a rank posts the receive of the next block from
its left neighbour and the send of the current one to its right, then attends to the current block (MPI
progresses the transfers: the receive is tested before the attention), then waits. Empty blocks (a
sequence shorter than the number of blocks) are not sent: both sides know every length. Every send and
receive completes before the call returns; an error part way fails the group and its duplicate
(``host.fails_group``), whose later calls raise at once instead of matching this call's stray messages.
"""
from __future__ import annotations

from ..collectives import all_gather_into_tensor, irecv, isend
from . import schedule
from .cp_engine import Accumulator, attend
from .host import fails_group, private

__all__ = ["unmet", "start_gather", "ring_attention"]


def unmet(comm, algo: str) -> str | None:
    """Why ``algo`` cannot run on CPU tensors of ``comm`` (None: every algorithm can)."""
    return None


def start_gather(comm, stage, send):
    """The all-gather of ``all_gather``, on the group's worker thread (``async_op=True``): truly beside the
    attention of the own block."""
    return all_gather_into_tensor(stage, send, group=comm, async_op=True)


@fails_group
def ring_attention(comm, q, kv, lengths, layout, causal, scale):
    n, r = comm.size, comm.rank
    seq_len = sum(lengths)
    order = schedule.topo_ring(comm.packages)
    pos = order.index(r)
    left, right = order[(pos - 1) % n], order[(pos + 1) % n]
    p2p = private(comm)
    qpieces = schedule.rank_pieces(seq_len, n, layout, r)
    acc = Accumulator(q)
    two, B, Hkv, _, D = kv.shape
    cur, owner = kv, r
    sends = []
    for s in range(n):
        recv = None
        if s < n - 1:
            nxt_owner = order[(pos - s - 1) % n]
            nxt = kv.new_empty((two, B, Hkv, lengths[nxt_owner], D))
            if nxt.numel():
                recv = irecv(nxt, group=p2p, tag=nxt_owner, group_src=left)
            if cur.numel():
                sends.append(isend(cur, group=p2p, tag=owner, group_dst=right))
                while len(sends) > 1:  # the block sent a step ago has landed: its buffer goes (memory of ~2 blocks,
                    sends.pop(0).wait()  # not of every block the ring passed on)
        if recv is not None:
            recv.is_completed()  # let MPI progress before the attention
        attend(acc, q, qpieces, schedule.rank_pieces(seq_len, n, layout, owner), cur[0], cur[1],
               causal, scale)
        if s < n - 1:
            if recv is not None:
                recv.wait()
            cur, owner = nxt, nxt_owner
    for h in sends:
        h.wait()
    return acc
