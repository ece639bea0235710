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
"""
from __future__ import annotations

__all__ = ["ring_plan", "direct_plan", "topo_plan", "serves", "cross_target", "aggregator", "package_index",
           "check_plan"]


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
