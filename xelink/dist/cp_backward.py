"""The backward of context-parallel attention, on either backend (public collectives and point-to-point only,
so the same code runs on CPU ranks and on CUDA tensors).

Each rank holds its queries' output, LSE and output gradient; the gradient of a query row is a sum over every
key block, the gradient of a key block a sum over every rank's queries. For each (query pieces, key block)
pair the calls are those of the forward (``schedule.attend_calls``: the causal decomposition), each a
``flash_attention_backward`` with the row's global output and LSE, which gives exactly that block's
contribution. dq accumulates locally; dk and dv (one float32 ``(2, B, Hkv, L, D)`` buffer a block) go back to
the block's owner:

- ``ring`` (the forward's ring order, ``schedule.topo_ring``): the KV blocks travel as in the forward and each
  block's gradient travels one step behind it: at step s a rank adds its contribution for the block at hand
  to the partial received from its left neighbour (who worked on that block at step s - 1) and sends the sum
  to its right neighbour; after n steps the sum arrives at the owner. Memory: about two blocks and two
  gradients, as the forward. This is ring-flash-attention's backward schedule.
- ``all_gather``: the packed KV gathered again (the forward's gather, not kept: memory), every block's
  contribution computed locally into one buffer, which ``reduce_scatter_tensor`` sums onto the owners.

Point-to-point runs on the group's private duplicate (``host.private``), under tags that name the message
(KV ``owner``, gradient ``n + owner``) and, since CUDA point-to-point matches by order, posted in the same
order on both sides of every link. Every transfer completes before the call returns; an error part way fails
the group and its duplicate (``host.fails_group``): their later calls raise at once instead of taking this
call's stray messages for theirs.
"""
from __future__ import annotations

import torch

from ..collectives import irecv, isend, reduce_scatter_tensor
from ..kernels import flash_attention_backward
from . import schedule
from .cp_engine import gather_kv
from .host import fails_group, private

__all__ = ["all_gather_backward", "ring_backward"]


def _ctype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _attend_backward(dq, dkv, g, qpieces, kpieces, k, v, causal, scale) -> None:
    """Add the contributions of the key block ``k``, ``v`` (positions ``kpieces``) to ``dq`` and ``dkv``
    (``(2, B, Hkv, L, D)``); ``g``: this rank's (q, dout, out, lse, dlse), dlse None where no loss used the LSE."""
    q, dout, out, lse, dlse = g
    for lo, hi, ka, kb, c in schedule.attend_calls(qpieces, kpieces, causal):
        a, b, d = flash_attention_backward(dout[:, :, lo:hi], q[:, :, lo:hi], k[:, :, ka:kb], v[:, :, ka:kb],
                                           out[:, :, lo:hi], lse[:, :, lo:hi], causal=c, scale=scale,
                                           dlse=None if dlse is None else dlse[:, :, lo:hi])
        dq[:, :, lo:hi] += a
        dkv[0][:, :, ka:kb] += b
        dkv[1][:, :, ka:kb] += d


@fails_group
def all_gather_backward(comm, g, kv, lengths, layout, causal, scale, start_gather):
    """(dq, dkv) of this rank for ``algo="all_gather"``; ``g`` as ``_attend_backward``'s."""
    n, r = comm.size, comm.rank
    seq_len = sum(lengths)
    q = g[0]
    stage, work = gather_kv(comm, kv, lengths, start_gather)
    two, B, Hkv, L, D = kv.shape
    ct = _ctype(q)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dstage = torch.zeros(stage.shape, dtype=ct, device=q.device)
    qpieces = schedule.rank_pieces(seq_len, n, layout, r)
    _attend_backward(dq, dstage[r], g, qpieces, qpieces, kv[0], kv[1], causal, scale)
    work.wait()
    for x in range(n):
        if x != r:
            _attend_backward(dq, dstage[x], g, qpieces, schedule.rank_pieces(seq_len, n, layout, x), stage[x, 0],
                             stage[x, 1], causal, scale)
    mine = dstage.new_empty(stage.shape[1:])
    reduce_scatter_tensor(mine, dstage, group=comm)
    return dq, mine[:, :, :, :L]


@fails_group
def ring_backward(comm, g, kv, lengths, layout, causal, scale):
    """(dq, dkv) of this rank for ``algo="ring"``; ``g`` as ``_attend_backward``'s."""
    n, r = comm.size, comm.rank
    seq_len = sum(lengths)
    q = g[0]
    order = schedule.topo_ring(comm.packages)
    pos = order.index(r)
    left, right = order[(pos - 1) % n], order[(pos + 1) % n]
    owners = [order[(pos - s) % n] for s in range(n)]  # the block at hand at step s
    p2p = private(comm)
    two, B, Hkv, _, D = kv.shape
    ct = _ctype(q)
    qpieces = schedule.rank_pieces(seq_len, n, layout, r)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)

    def grads(owner: int, fill=torch.zeros) -> torch.Tensor:
        """A gradient buffer of ``owner``'s block: zeros to accumulate into, ``torch.empty`` to receive into."""
        return fill((two, B, Hkv, lengths[owner], D), dtype=ct, device=q.device)

    def post(t: torch.Tensor, tag: int, send: bool):
        if not t.numel():  # both sides know every length: empty blocks are not sent
            return None
        return isend(t, group=p2p, tag=tag, group_dst=right) if send else irecv(t, group=p2p, tag=tag, group_src=left)

    cur, partial, sends = kv, None, []
    for s, owner in enumerate(owners):
        if s < n - 1:  # the next block from the left; this block onwards to the right
            nxt = kv.new_empty((two, B, Hkv, lengths[owners[s + 1]], D))
            kv_recv = post(nxt, owners[s + 1], False)
            sends.append(post(cur, owner, True))
        mine = grads(owner)
        _attend_backward(dq, mine, g, qpieces, schedule.rank_pieces(seq_len, n, layout, owner), cur[0], cur[1],
                         causal, scale)
        if partial is not None:
            if partial[1] is not None:
                partial[1].wait()
            mine += partial[0]
        if s < n - 1:
            # The next block's partial gradient, which the left neighbour sends only after its step-s kernels:
            # posted after this rank's, so that no receive is pending for a message its sender posts after the
            # kernels this rank is launching (a kernel's first launch loads it, which waits for the running
            # kernels: such a receive, spinning for a neighbour in the same state, would stall both).
            nxt_partial = grads(owners[s + 1], torch.empty)
            partial = (nxt_partial, post(nxt_partial, n + owners[s + 1], False))
        sends.append(post(mine, n + owner, True))  # after n steps the sum reaches the owner
        while len(sends) > 4:  # the last two steps' messages in flight at most
            h = sends.pop(0)
            if h is not None:
                h.wait()
        if s < n - 1:
            if kv_recv is not None:
                kv_recv.wait()
            cur = nxt
    total = grads(r, torch.empty)
    h = post(total, n + r, False)
    if h is not None:
        h.wait()
    for h in sends:
        if h is not None:
            h.wait()
    return dq, total
