"""All-reduce on CPU ranks: ring, direct (one-shot), two-shot and hierarchical.

Every algorithm reduces half types in float32 and produces bit-identical results on every rank
(each rank combines the same values in the same order). ``x`` is flat and contiguous.
"""
from __future__ import annotations

import torch

from ...transport import shm
from .base import bounds, chunks, combine, finish, reduce_into, state, step, tag_for, work_copy, work_dtype

__all__ = ["ring", "direct", "two_shot", "hierarchical", "ring_reduce_scatter", "ring_all_gather"]


def ring(comm, x, op, deadline):
    """Reduce-scatter around the ring, then all-gather around it: 2(n-1) steps, 2(n-1)/n of the data."""
    n, r = comm.size, comm.rank
    acc = work_copy(x)
    parts = chunks(acc, bounds(acc.numel(), n))
    ring_reduce_scatter(comm, parts, op, tag_for(comm), deadline)
    finish(parts[r], op, n)
    ring_all_gather(comm, parts, tag_for(comm), deadline)
    x.copy_(acc)


def ring_reduce_scatter(comm, parts, op, tag, deadline, fn="all_reduce"):
    """``parts``: the n chunks of an accumulator (``chunks``, the first the longest); after it, ``parts[rank]``
    holds the reduction of that chunk over all ranks. ``fn``: the collective its errors name."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty_like(parts[0])
    for s in range(n - 1):
        out_c, in_c = (r - s - 1) % n, (r - s - 2) % n
        m = parts[in_c].numel()
        buf = incoming if m == incoming.numel() else incoming[:m]
        step(comm, [(right, parts[out_c])], [(left, buf)], tag, deadline, fn)
        combine(parts[in_c], buf, op)


def ring_all_gather(comm, parts, tag, deadline, fn="all_reduce"):
    """``parts[rank]`` (the n chunks of one buffer, ``chunks``) is known; after it, every chunk is. ``fn``: the
    collective its errors name."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        step(comm, [(right, parts[(r - s) % n])], [(left, parts[(r - s - 1) % n])], tag, deadline, fn)


def direct(comm, x, op, deadline):
    """One-shot: every rank gets every peer's whole buffer and reduces all n in rank order.

    On one host under MPI the buffers are read straight from the peers' shared memory
    (``_direct_peer_memory``); otherwise, or where the host's shared-memory filesystem has no room for the
    window, every rank sends its buffer to every peer in one step.
    """
    if shm.available(comm) and comm.local_size == comm.size and x.nbytes < state(comm).window_refused:
        try:
            return _direct_peer_memory(comm, x, op, deadline)
        except shm.PeerMemoryUnavailable:  # no room (every rank alike, nothing written yet): messages below
            st = state(comm)
            st.window_refused = min(st.window_refused, x.nbytes)
    n, r = comm.size, comm.rank
    parts = [x if p == r else torch.empty_like(x) for p in range(n)]
    step(comm, [(p, x) for p in range(n) if p != r], [(p, parts[p]) for p in range(n) if p != r],
         tag_for(comm), deadline, "all_reduce")
    reduce_into(x, parts, op, disjoint=False)  # parts[r] is x


def _direct_peer_memory(comm, x, op, deadline):
    """One-shot through MPI-3 shared memory: copy in, one peer-counter barrier, read every peer.

    One barrier per call is enough because calls alternate between the window's two fixed slots
    (``PeerWindow.next_slot`` says why that holds whatever the sizes of consecutive calls).
    """
    n, nbytes, dtype = comm.size, x.nbytes, x.dtype
    st = state(comm)
    win = st.window
    if win is None or win.freed:  # sized for two slots of this call at once (no growth in next_slot)
        win = st.window = shm.PeerWindow(comm, 2 * (-(-nbytes // 64) * 64), timeout=max(deadline.remaining(), 1e-3),
                                         fn="all_reduce")
    offset = win.next_slot(nbytes, timeout=max(deadline.remaining(), 1e-3))
    win.torch_slot(win.node_rank, dtype, offset, nbytes).copy_(x)
    win.barrier(deadline, "all_reduce", note=nbytes)
    sizes = win.counters.notes()
    if sizes.count(nbytes) != n:  # a peer's slot holds another size: reading it would return its stale bytes
        odd = next(p for p, b in enumerate(sizes) if b != nbytes)
        raise ValueError(f"all_reduce: rank {win.node_ranks[odd]} passed {sizes[odd]} bytes and rank {comm.rank} "
                         f"{nbytes} (every rank must pass the same size)")
    # x is the caller's tensor, the slots the window's memory, which nobody else can hold: disjoint
    reduce_into(x, [win.torch_slot(p, dtype, offset, nbytes) for p in range(n)], op, disjoint=True)


def two_shot(comm, x, op, deadline):
    """Each rank reduces one chunk from all peers (direct reduce-scatter), then sends it to all."""
    n, r = comm.size, comm.rank
    parts = chunks(x, bounds(x.numel(), n))
    mine = parts[r]
    incoming = [mine if p == r else torch.empty_like(mine) for p in range(n)]
    step(comm, [(p, parts[p]) for p in range(n) if p != r], [(p, incoming[p]) for p in range(n) if p != r],
         tag_for(comm), deadline, "all_reduce")
    reduce_into(mine, incoming, op, disjoint=False)  # incoming[r] is mine
    step(comm, [(p, mine) for p in range(n) if p != r], [(p, parts[p]) for p in range(n) if p != r],
         tag_for(comm), deadline, "all_reduce")


def spans(packages, count: int) -> dict:
    """rank -> (lo, hi): the chunk a rank holds after a reduce-scatter inside its package (member i of a
    package of k holds chunk i of k)."""
    out = {}
    for members in packages:
        b = bounds(count, len(members))
        for i, m in enumerate(members):
            out[m] = (b[i], b[i + 1])
    return out


def hierarchical(comm, x, op, deadline):
    """Reduce-scatter inside each package, all-reduce each chunk across packages, all-gather inside.

    1. Inside my package: member i of a package of k ranks receives chunk i of k from every member and
       reduces it (member order): the package's partial of that chunk.
    2. Across packages: the partial goes to the ranks that hold the same elements in the other
       packages (with uneven packages a chunk overlaps several of them), which send theirs back; each
       element is combined in package order, so every holder computes the same bits. Each rank's
       1/k share crosses the fabric, once per remote package.
    3. Inside my package: every member sends its finished chunk to the others.

    Partials travel in the working type (float32 for half types). The GPU ``hierarchical`` runs the
    same schedule (``xelink.collectives.gpu.compose``).
    """
    packages, r = comm.packages, comm.rank
    me_p, _ = comm.package_index(r)
    wd = work_dtype(x.dtype)
    inner = "sum" if op == "avg" else op
    span = spans(packages, x.numel())
    lo, hi = span[r]
    members = [m for m in packages[me_p] if m != r]
    # 1. reduce-scatter inside the package
    got = {m: torch.empty(hi - lo, dtype=x.dtype) for m in members}
    step(comm, [(m, x[span[m][0]:span[m][1]]) for m in members], list(got.items()), tag_for(comm), deadline,
         "all_reduce")
    acc = None
    for m in packages[me_p]:
        part = x[lo:hi] if m == r else got[m]
        if acc is None:
            acc = part.to(wd, copy=True)
        else:
            combine(acc, part, inner)
    # 2. across packages: each overlap with a holder of another package, both ways
    partial = {me_p: acc}
    sends, recvs = [], []
    for q, others in enumerate(packages):
        if q == me_p:
            continue
        partial[q] = torch.empty(hi - lo, dtype=wd)
        for s in others:
            a, b = max(lo, span[s][0]), min(hi, span[s][1])
            if a < b:
                sends.append((s, acc[a - lo:b - lo]))
                recvs.append((s, partial[q][a - lo:b - lo]))
    step(comm, sends, recvs, tag_for(comm), deadline, "all_reduce")
    total = partial[0].clone()
    for q in range(1, len(packages)):
        combine(total, partial[q], inner)
    if op == "avg":
        total.div_(comm.size)
    done = total.to(x.dtype)
    # 3. all-gather inside the package
    step(comm, [(m, done) for m in members], [(m, x[span[m][0]:span[m][1]]) for m in members], tag_for(comm),
         deadline, "all_reduce")
    x[lo:hi] = done
