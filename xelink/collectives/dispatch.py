"""``algo="auto"``: which algorithm runs for an op, a message size and a communicator.

Order of authority: a measured tuning table that matches the machine's topology (written by the
benchmark suite), else the cost model, else the simple rule below.
"""
from __future__ import annotations

from . import _groups

__all__ = ["choose"]

# Below this many bytes one round of messages (direct) beats the 2(n-1) rounds of a ring on every
# transport we have measured; above it the ring's bandwidth efficiency wins.
_DIRECT_MAX_BYTES = 64 << 10


def choose(comm, op: str, nbytes: int, dtype) -> str:
    """The algorithm ``auto`` runs for ``op`` ("all_reduce", "all_gather", "reduce_scatter")."""
    multi_package = len(_groups.layout(comm)) > 1
    small = nbytes <= _DIRECT_MAX_BYTES
    if op == "all_reduce":
        return "direct" if small else ("hierarchical" if multi_package else "ring")
    if op == "all_gather":
        return "direct" if small else ("topo" if multi_package else "ring")
    if op == "reduce_scatter":
        return "dest_split" if small else ("hierarchical" if multi_package else "ring")
    raise ValueError(f"choose: unknown op {op!r}")
