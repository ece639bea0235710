"""All-gather on CPU ranks: ring, direct, and topology-aware (each shard crosses the fabric once per
remote package). ``parts`` are the shards of the flat output in rank order (views), this rank's already in place."""
from __future__ import annotations

from .all_reduce import ring_all_gather
from .base import step, tag_for

__all__ = ["ring", "direct", "topo", "cross_target"]


def ring(comm, parts, inp, deadline):
    ring_all_gather(comm, parts, tag_for(comm), deadline, "all_gather_into_tensor")


def direct(comm, parts, inp, deadline):
    n, r = comm.size, comm.rank
    step(comm, [(p, inp) for p in range(n) if p != r], [(p, parts[p]) for p in range(n) if p != r],
         tag_for(comm), deadline, "all_gather_into_tensor")


def cross_target(packages, src_local: int, dst_package: int) -> int:
    """The rank of package ``dst_package`` that receives shards from local index ``src_local``.

    Same local index where it exists; a smaller package wraps (local index mod its size), so uneven
    packages still receive every shard exactly once.
    """
    members = packages[dst_package]
    return members[src_local % len(members)]


def topo(comm, parts, inp, deadline):
    """Topology-aware all-gather in two steps.

    1. Across the fabric: my shard goes to one rank of every other package (``cross_target``), so
       it crosses the fabric once per remote package.
    2. Inside the package: each rank sends the shards it holds (its own and those it received) to
       every other member of its package over the fast local link.
    """
    fn = "all_gather_into_tensor"
    packages = comm.packages
    me_p, me_i = comm.package_index(comm.rank)
    chunk = parts.__getitem__
    # Who sends me what across: every rank q in another package whose target in my package is me.
    held = [comm.rank]
    sends, recvs = [], []
    for p, members in enumerate(packages):
        if p == me_p:
            continue
        sends.append((cross_target(packages, me_i, p), chunk(comm.rank)))
        for q_i, q in enumerate(members):
            if cross_target(packages, q_i, me_p) == comm.rank:
                recvs.append((q, chunk(q)))
                held.append(q)
    step(comm, sends, recvs, tag_for(comm), deadline, fn)
    # Inside the package: I send what I hold to each member and receive what each member holds.
    sends, recvs = [], []
    for m in packages[me_p]:
        if m == comm.rank:
            continue
        theirs = [m] + [q for p, members in enumerate(packages) if p != me_p
                        for q_i, q in enumerate(members) if cross_target(packages, q_i, me_p) == m]
        sends += [(m, chunk(q)) for q in held]
        recvs += [(m, chunk(q)) for q in theirs]
    step(comm, sends, recvs, tag_for(comm), deadline, fn)
