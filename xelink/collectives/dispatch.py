"""Which algorithm runs: ``algo=`` checked against the registry, or ``algo="auto"`` chosen (the one auto).

Order of authority for ``auto``, over the algorithms of the tensor's backend that can run here (not
the baseline-only paths whose input must be symmetric): a measured tuning table of this machine
(``xelink.tuning``; written by ``xelink bench collectives --tune`` / ``gpu-collectives --tune``), else
the cost model on the communicator's placement (backends that trust it for the choice: the CPU one), priced
with the measured calibration ``XELINK_CALIBRATION`` names, else with the backend's estimated software terms
(``cost.SOFTWARE``), else the backend's size rule. Decisions are cached per communicator, backend, op, dtype and
power-of-two size class, or per size where a tuning table's range starts or ends inside the class.
"""
from __future__ import annotations

from .. import tuning
from ..comm import get_world
from ..errors import XelinkError
from ..log import get_logger
from . import registry

__all__ = ["resolve", "choose"]

_log = get_logger("dispatch")


def resolve(fn: str, op: str, algo, comm, backend: str, nbytes: int, dtype, x=None) -> registry.Algorithm:
    """The registry entry that runs ``fn``: ``algo`` checked (known here, and able to run on ``comm`` with
    the input ``x``), or ``auto``'s choice. Raises before anything is sent."""
    if not registry.supports(op, backend):
        raise ValueError(f"{fn}: {backend.upper()} tensors are not supported by this op (CPU tensors and numpy "
                         f"arrays only)")
    if algo == "auto":
        return _auto(comm, op, nbytes, dtype, backend)
    entry = registry.get(fn, op, algo, backend)
    why = registry.backend(backend).unmet(comm, entry, x)
    if why is not None:
        raise type(why)(f"{fn}: algo={algo!r} {why}")
    return entry


def _candidates(comm, op: str, backend: str) -> list[registry.Algorithm]:
    b = registry.backend(backend)
    return [a for a in registry.algorithms(op, backend) if "symmetric" not in a.needs and b.unmet(comm, a) is None]


def _table(comm):
    """The tuning table that speaks for ``comm``, or None: a table describes the whole world on its own
    topology; a sub-communicator or a hand-set layout is another machine as far as the measurements go."""
    table = tuning.active()
    if table is None or comm.size != get_world().size or comm._packages is not None:
        return None
    return table


def _table_op(op: str, backend: str) -> str:
    """The op's name in a tuning table: bare for CPU ranks, ``"<backend>:<op>"`` for a GPU backend."""
    return op if backend == "cpu" else f"{backend}:{op}"


def _splits_class(comm, op, backend, nbytes, dtype) -> bool:
    """Whether the table has a range edge inside ``nbytes``' power-of-two size class."""
    table = _table(comm)
    if table is None:
        return False
    key = _table_op(op, backend)
    bits = max(nbytes, 1).bit_length()
    lo, hi = (0 if bits == 1 else 1 << (bits - 1)), (1 << bits) - 1
    return table.splits(key, dtype, lo, hi) or table.splits(key + tuning.OWN, dtype, lo, hi)


def _from_table(comm, op, backend, nbytes, dtype, names):
    table = _table(comm)
    if table is None:
        return None
    key = _table_op(op, backend)
    found = table.lookup(key, dtype, nbytes)
    name = None if found is None else found.split(":", 1)[-1]  # "xelink:two_shot", "baseline:nccl"
    if name not in names and found is not None and found.startswith("baseline:"):
        # a baseline this backend cannot hand the work to (MPI's own on CPU ranks): xelink's fastest there
        found = table.lookup(key + tuning.OWN, dtype, nbytes)
        name = None if found is None else found.split(":", 1)[-1]
    if name not in names:
        _log.debug("dispatch: tuning table says %r for %s at %d B; not runnable here", found, op, nbytes)
        return None
    return name


def _from_model(comm, op, nbytes, algos, backend):
    placement = comm.placement
    if placement is None:
        return None
    from ..cost import SOFTWARE, active_calibration, active_oversubscription, best, oversubscribed

    cal = active_calibration()
    if cal is None and backend in SOFTWARE:  # the estimate is of a host with a core a rank: scale it to this one
        cal = oversubscribed(SOFTWARE[backend], active_oversubscription())
    schedule = best(comm.topology, placement, op, nbytes, [a.schedule for a in algos], cal)
    return next(a.name for a in algos if a.schedule == schedule)


_PER_SIZE = object()  # a size class's cache entry when its sizes are decided one by one
_MAX_ENTRIES = 4096


def choose(comm, op: str, nbytes: int, dtype, backend: str = "cpu") -> str:
    """The algorithm ``auto`` runs for ``op`` on ``backend`` at ``nbytes`` bytes of ``dtype``."""
    return _auto(comm, op, nbytes, dtype, backend).name


def _auto(comm, op: str, nbytes: int, dtype, backend: str) -> registry.Algorithm:
    """``choose``'s registry entry, cached (the cache holds entries: a small call looks up nothing else)."""
    if op not in registry.OPS:
        raise ValueError(f"choose: unknown op {op!r}")
    cache = comm.resource("dispatch.auto", dict)
    key = (backend, op, str(dtype), max(nbytes, 1).bit_length())
    found = cache.get(key)
    if found is None and _splits_class(comm, op, backend, nbytes, dtype):
        cache[key] = found = _PER_SIZE
    if found is _PER_SIZE:  # a table edge inside the class: decided (from the table, cheaply) per size
        if len(cache) > _MAX_ENTRIES:  # sizes without end: start again (every rank alike: same calls, same sizes)
            cache.clear()
            cache[key] = _PER_SIZE
        key += (nbytes,)
        found = cache.get(key)
    if found is None:
        algos = _candidates(comm, op, backend)
        if not algos:
            raise XelinkError(f"{op}: no {backend} algorithm can run on {comm.name}")
        names = [a.name for a in algos]
        b = registry.backend(backend)
        algo = _from_table(comm, op, backend, nbytes, dtype, names)
        if algo is None and b.MODEL_AUTO:
            algo = _from_model(comm, op, nbytes, algos, backend)
        if algo is None:
            rule = b.size_rule(comm, op, nbytes)
            algo = rule if rule in names else names[0]
        _log.debug("dispatch: %s %s %s %d B on %s -> %s", backend, op, dtype, nbytes, comm.name, algo)
        cache[key] = found = next(a for a in algos if a.name == algo)
    return found
