"""``algo="auto"``: which algorithm runs for an op, a message size and a communicator.

Order of authority: a measured tuning table that matches the machine's topology (written by
``xelink bench collectives --tune`` and found through ``XELINK_TUNING``), else the cost model on the
communicator's placement in the topology, else a size rule (for layouts set by hand).
Decisions are cached per communicator, op, dtype and power-of-two size class.
"""
from __future__ import annotations

from ..log import get_logger

__all__ = ["choose"]

_log = get_logger("dispatch")
# The size rule: below this many bytes one round of messages (direct) beats the 2(n-1) rounds of a
# ring; above it the ring's bandwidth efficiency wins, or the hierarchical path with several packages.
_DIRECT_MAX_BYTES = 64 << 10
_RULE = {"all_reduce": ("direct", "ring", "hierarchical"), "all_gather": ("direct", "ring", "topo"),
         "reduce_scatter": ("dest_split", "ring", "hierarchical")}


def _from_table(comm, op, nbytes, dtype, algos):
    from ..runtime import get_world, tuning_table

    table = tuning_table()
    # A table describes the whole world on its own topology; a sub-communicator or a hand-set layout
    # is another machine as far as the measurements go.
    if table is None or comm.size != get_world().size or comm._packages is not None:
        return None
    algo = table.lookup(op, dtype, nbytes)
    if algo is not None and algo.startswith("xelink:"):
        algo = algo.split(":", 1)[1]
    if algo not in algos:
        _log.debug("dispatch: tuning table says %r for %s at %d B; not an xelink path here", algo, op, nbytes)
        return None
    return algo


def _from_model(comm, op, nbytes, algos):
    if comm.topology is None or comm.world_placement is None or comm._packages is not None:
        return None
    from ..cost import best
    from ..topology import Placement

    wp = comm.world_placement
    placement = Placement(comm.topology, tuple(wp.devices[w] for w in comm.world_ranks))
    return best(comm.topology, placement, op, nbytes, algos)


def choose(comm, op: str, nbytes: int, dtype) -> str:
    """The algorithm ``auto`` runs for ``op`` ("all_reduce", "all_gather", "reduce_scatter")."""
    if op not in _RULE:
        raise ValueError(f"choose: unknown op {op!r}")
    cache = comm.__dict__.setdefault("_auto_cache", {})
    key = (op, str(dtype), max(nbytes, 1).bit_length())
    if key not in cache:
        from . import ALGORITHMS

        algos = ALGORITHMS[op]
        algo = _from_table(comm, op, nbytes, dtype, algos) or _from_model(comm, op, nbytes, algos)
        if algo is None:
            small, flat, hier = _RULE[op]
            algo = small if nbytes <= _DIRECT_MAX_BYTES else (hier if len(comm.packages) > 1 else flat)
        _log.debug("dispatch: %s %s %d B on %s -> %s", op, dtype, nbytes, comm.name, algo)
        cache[key] = algo
    return cache[key]
