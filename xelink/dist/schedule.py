"""The orders of the distributed GEMM schedules, as plain data: which shard (or partial) each rank handles
at each step and from or to whom it moves. Pure Python, the same on every rank (each rank computes the plan
of every rank, so senders and receivers agree without talking); the CPU and CUDA paths run the same plans.

Gather plans (``all_gather_matmul``): ``reads[x]`` lists, in x's compute order after its own shard, pairs
``(q, src)``: x obtains shard q from rank ``src`` (q itself, or a rank that obtained q earlier and forwards
it). ``serves(reads, m, x)`` is what x obtains from m, in x's order; every plan here makes that the order in
which m comes to hold those shards (its own first, then in its own read order), which is what lets the CUDA
path count one semaphore signal per shard and the CPU path post forwards as shards land.

Reduce plans (``matmul_reduce_scatter``) are described where they run (``host``): a ring, and the
topology-aware one whose aggregators are given by ``aggregator``.

Context parallelism (``cp_attention``): ``cp_blocks``, ``cp_pieces``, ``cp_lengths`` and ``topo_ring``
(the layouts and the ring order, from ``xelink.layout``, which the cost model reads too), and
``attend_parts`` decomposes a (query range, key range) pair
into what the end-aligned causal kernels can compute; under a sliding window (``window_spans``, ``halo_runs``)
each of a rank's pieces reads one contiguous span of keys instead, and the ranks exchange only those.
"""
from __future__ import annotations

from ..layout import CP_LAYOUTS, cp_blocks, cp_lengths, cp_pieces, topo_ring

__all__ = ["ring_plan", "direct_plan", "topo_plan", "serves", "cross_target", "aggregator", "package_index",
           "check_plan", "CP_LAYOUTS", "cp_blocks", "cp_pieces", "cp_lengths", "topo_ring", "attend_parts",
           "local_pieces", "rank_pieces", "attend_calls", "window_spans", "halo_runs"]



def package_index(packages, rank: int) -> tuple[int, int]:
    """(package index, local index) of ``rank`` in ``packages`` (a partition of the group's ranks)."""
    for p, members in enumerate(packages):
        if rank in members:
            return p, members.index(rank)
    raise ValueError(f"package_index: rank {rank} is in no package of {packages}")


def cross_target(packages, src_local: int, dst_package: int) -> int:
    """The rank of package ``dst_package`` that receives across the fabric from local index ``src_local``:
    the same local index, wrapping in a smaller package (the rule of the topology-aware all-gather of
    ``xelink.collectives``), so that uneven packages still receive every shard exactly once."""
    members = packages[dst_package]
    return members[src_local % len(members)]


def aggregator(packages, my_package: int, dst: int) -> int:
    """The rank of ``my_package`` that sums the package's partials for destination ``dst`` (of another
    package) and sends the sum across: the member with ``dst``'s local index, wrapping."""
    _, dst_local = package_index(packages, dst)
    members = packages[my_package]
    return members[dst_local % len(members)]


def ring_plan(n: int) -> list[list[tuple[int, int]]]:
    """Ring: at step s rank x receives shard ``x - s`` from its left neighbour, which forwards what it
    received one step before (n - 1 messages per link, each of one shard)."""
    return [[((x - s) % n, (x - 1) % n) for s in range(1, n)] for x in range(n)]


def direct_plan(n: int) -> list[list[tuple[int, int]]]:
    """Direct: rank x obtains shard ``x + s`` from its owner at step s (at each step every owner serves
    exactly one reader, so no rank's memory is read by two peers at once)."""
    return [[((x + s) % n, (x + s) % n) for s in range(1, n)] for x in range(n)]


def topo_plan(packages) -> list[list[tuple[int, int]]]:
    """Topology-aware: own shard, the package's shards (from their owners, ring order inside the package),
    then the remote packages in order (the next package first), each remote shard q obtained across the
    fabric by one member of the package (``cross_target``) and from that member by the others.

    Every member of a package reads the remote shards in one order, so a forwarder holds shard q before
    any later shard it forwards, and nobody waits on a rank that waits on it.
    """
    n = sum(len(p) for p in packages)
    reads = []
    for x in range(n):
        p, i = package_index(packages, x)
        mine = packages[p]
        order = [(mine[(i + s) % len(mine)], mine[(i + s) % len(mine)]) for s in range(1, len(mine))]
        for t in range(1, len(packages)):
            other = (p + t) % len(packages)
            for q_local, q in enumerate(packages[other]):
                order.append((q, cross_target(packages, q_local, p)))
        # A cross target that is x itself means: x obtains q from its owner, across the fabric.
        reads.append([(q, q if src == x else src) for q, src in order])
    return reads


def serves(reads, m: int, x: int) -> list[int]:
    """The shards rank ``x`` obtains from rank ``m``, in x's order."""
    return [q for q, src in reads[x] if src == m]


def check_plan(reads) -> None:
    """Raise ``ValueError`` unless every rank obtains every other shard exactly once, from a rank that holds
    it by then, in the order that rank came to hold them (tests run this on every layout)."""
    n = len(reads)
    held_order = {x: [x] + [q for q, _ in reads[x]] for x in range(n)}
    for x in range(n):
        if sorted(q for q, _ in reads[x]) != [q for q in range(n) if q != x]:
            raise ValueError(f"check_plan: rank {x} obtains {sorted(q for q, _ in reads[x])}, not every other shard")
        for m in range(n):
            got = serves(reads, m, x)
            if not got:
                continue
            if m == x:
                raise ValueError(f"check_plan: rank {x} reads from itself")
            positions = [held_order[m].index(q) if q in held_order[m] else -1 for q in got]
            if -1 in positions or positions != sorted(positions):
                raise ValueError(f"check_plan: rank {x} takes {got} from rank {m}, which holds them in the order "
                                 f"{held_order[m]}")


# -- context parallelism ----------------------------------------------------------------------------

def attend_parts(q_range: tuple[int, int], k_range: tuple[int, int], causal: bool) -> list[tuple]:
    """What queries at global positions ``[qs, qe)`` see of keys ``[ks, ke)``, as kernel calls
    ``((qs', qe'), (ks', ke'), causal')`` whose end-aligned causal mask (query i of Sq sees key j of Sk iff
    j <= i + Sk - Sq) is the global one (query p sees key k iff k <= p).

    Non-causal: one call, everything. Causal: keys after the last query are dropped (nothing if the keys
    all lie after it: the pair is skipped); a key range that ends no later than the first query plus one is
    fully visible (one non-causal call); otherwise, the keys clipped to end at ``ke' = min(ke, qe)``, the
    queries before ``ke'`` take one causal call over keys ``[ks, ke')`` (their ends are aligned, so the
    kernel's mask is the global one; queries before ``ks`` see nothing and get LSE -inf) and the queries
    from ``ke'`` on, which see every key, one non-causal call. The layouts' blocks are equal or disjoint,
    so between two of them this is always one of: skipped, fully visible, or the diagonal (one causal call).
    """
    (qs, qe), (ks, ke) = q_range, k_range
    if qe <= qs or ke <= ks:
        return []
    if not causal:
        return [((qs, qe), (ks, ke), False)]
    if ks >= qe:
        return []
    if ke <= qs + 1:
        return [((qs, qe), (ks, ke), False)]
    ke = min(ke, qe)
    parts = [((qs, ke), (ks, ke), True)]
    if ke < qe:
        parts.append(((ke, qe), (ks, ke), False))
    return parts


def local_pieces(pieces) -> list[tuple[int, int, int]]:
    """A rank's pieces (``cp_pieces``) as ``(global start, length, local offset)``."""
    out, off = [], 0
    for start, length in pieces:
        out.append((start, length, off))
        off += length
    return out


def rank_pieces(seq_len: int, n: int, layout: str, rank: int) -> list[tuple[int, int, int]]:
    """``rank``'s pieces of a sequence of ``seq_len`` over ``n`` ranks as ``local_pieces`` gives them."""
    return local_pieces(cp_pieces(seq_len, n, layout, rank))


def attend_calls(qpieces, kpieces, causal: bool) -> list[list]:
    """The kernel calls ``[local rows lo, hi, local keys lo, hi, causal]`` of a rank's queries (``qpieces``:
    ``local_pieces``) against keys whose positions are ``kpieces`` (``(global start, length, offset in the
    keys)``), each pair split by ``attend_parts`` and coalesced where the kernel allows: query rows adjacent in
    the local order that see one key range fully are one call, and so are key pieces adjacent in the keys that
    one row range sees fully (zigzag: the second half of the queries against both blocks of a later rank)."""
    calls = []
    for ks, kl, koff in kpieces:
        for qs, ql, off in qpieces:
            for (a, b), (ka, kb), c in attend_parts((qs, qs + ql), (ks, ks + kl), causal):
                call = [off + a - qs, off + b - qs, koff + ka - ks, koff + kb - ks, c]
                last = calls[-1] if calls else None
                if last and not c and not last[4] and last[1] == call[0] and last[2:4] == call[2:4]:
                    last[1] = call[1]
                else:
                    calls.append(call)
    merged = []
    for call in calls:
        last = merged[-1] if merged else None
        if last and not call[4] and not last[4] and last[:2] == call[:2] and last[3] == call[2]:
            last[3] = call[3]
        else:
            merged.append(call)
    return merged


def window_spans(seq_len: int, window: int, causal: bool, pieces) -> list[tuple[int, int, int, int]]:
    """The keys each of a rank's pieces (``local_pieces``) sees under a sliding window of ``window`` positions,
    as ``(local lo, local hi, first key, end key)``, one contiguous span a non-empty piece. Causal: a query at p
    sees (p - window, p], so the piece [s, e) reads [max(0, s - window + 1), e) and one end-aligned causal call
    with that window computes it exactly; without causal every query sees the last ``window`` positions
    (``flash_attention``'s non-causal window)."""
    spans = []
    for start, length, off in pieces:
        if length:
            first, end = (max(0, start - window + 1), start + length) if causal else (max(0, seq_len - window),
                                                                                    seq_len)
            spans.append((off, off + length, first, end))
    return spans


def halo_runs(seq_len: int, n: int, layout: str, window: int, causal: bool, reader: int,
              owner: int) -> list[tuple[int, int, int]]:
    """The positions of ``owner`` that ``reader``'s spans (``window_spans``) reach, as runs ``(global start,
    length, offset in owner's local sequence)`` in global order (empty for the reader itself)."""
    if reader == owner:
        return []
    spans = sorted((a, b) for _, _, a, b in window_spans(seq_len, window, causal,
                                                         rank_pieces(seq_len, n, layout, reader)))
    union = []
    for a, b in spans:
        if union and a <= union[-1][1]:
            union[-1][1] = max(union[-1][1], b)
        else:
            union.append([a, b])
    runs = []
    for start, length, off in rank_pieces(seq_len, n, layout, owner):
        for a, b in union:
            lo, hi = max(a, start), min(b, start + length)
            if lo < hi:
                runs.append((lo, hi - lo, off + lo - start))
    return sorted(runs)
