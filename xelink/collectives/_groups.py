"""Package layout of a communicator and the sub-communicators hierarchical algorithms run on."""
from __future__ import annotations

from ..comm import Communicator

__all__ = ["layout", "package_comms"]


def layout(comm: Communicator) -> list[list[int]]:
    """The ranks of each package, in rank order (``Communicator.packages``)."""
    return comm.packages


def where(packages: list[list[int]], rank: int) -> tuple[int, int]:
    """(package index, local index) of ``rank``."""
    for p, members in enumerate(packages):
        if rank in members:
            return p, members.index(rank)
    raise ValueError(f"layout: rank {rank} is in no package of {packages}")


def package_comms(comm: Communicator, deadline=None):
    """(package communicator, leaders communicator or None) for ``comm``'s layout, made once and cached.

    The leader of a package is its first rank; the leaders' communicator joins one rank per package.
    Collective on first use for a layout (every rank of ``comm`` is inside the calling collective),
    under the calling collective's ``deadline``.
    """
    packages = layout(comm)
    key = tuple(map(tuple, packages))
    cache = comm.__dict__.setdefault("_package_comms", {})
    if key not in cache:
        p, i = where(packages, comm.rank)
        timeout = None if deadline is None else max(deadline.remaining(), 1e-3)
        pkg = comm.split(p, key=i, timeout=timeout)
        leaders = comm.split(0 if i == 0 else None, key=p, timeout=timeout)
        cache[key] = (pkg, leaders)
    return cache[key]
