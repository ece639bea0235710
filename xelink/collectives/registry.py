"""The one table of collective algorithms: op x algorithm x backend.

Every algorithm a collective can run is registered here once, by the backend that implements it
(``cpu/``: CPU tensors over the host transports; ``gpu/``: CUDA tensors over peer memory or NCCL;
``xelink.sycl``: arrays of one process's SYCL queues, registered as backend ``"sycl"`` when it is imported,
without a dispatch module: its front door takes lists of arrays, not one tensor per rank).
``algo=`` names, ``algo="auto"`` (``dispatch``), the cost model (each entry names the schedule of
``xelink.cost`` it runs), the tuning table and the benchmark suite all read this table; adding a
backend means registering its algorithms, not editing the ops.

An entry's ``needs`` say when it can run:
    ``peer_memory``     the communicator's ranks share peer memory (CUDA: one host, Triton present)
    ``symmetric``       the input lives in memory from ``xelink.empty`` (read in place by the peers)
    ``baseline``        the vendor's collective (NCCL): a fallback and a baseline, never xelink's own path
"""
from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["Algorithm", "OPS", "NEEDS", "register", "supports", "algorithms", "get", "names", "backends", "alias",
           "add_backend", "backend"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
NEEDS = frozenset({"peer_memory", "symmetric", "baseline"})


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One registered algorithm.

    Attributes:
        op: the op family (one of ``OPS``).
        name: its ``algo=`` name.
        backend: ``"cpu"`` or ``"cuda"`` (the device type of the tensors it moves), or ``"sycl"``.
        impl: the backend's implementation (its signature is the backend's business).
        schedule: the ``xelink.cost`` schedule of ``op`` it runs (the cost model prices it by this).
        needs: when it can run (see the module docstring).
        summary: one line for listings.
    """

    op: str
    name: str
    backend: str
    impl: Callable
    schedule: str
    needs: frozenset = frozenset()
    summary: str = ""


_table: dict[tuple[str, str], dict[str, Algorithm]] = {}
_aliases: dict[tuple[str, str], str] = {}
_modules: dict = {}


def add_backend(name: str, module) -> None:
    """Make ``module`` the backend of tensors whose device type is ``name``: it runs the ops (the
    functions ``all_reduce``, ``all_gather_into_tensor``, ... that ``api`` calls), says what an algorithm
    needs that a communicator lacks (``unmet``: the exception to raise, or None), and gives ``auto`` its size
    rule (``size_rule``, ``MODEL_AUTO``: whether the cost model may choose)."""
    _modules[name] = module


def backend(name: str):
    """The backend module of device type ``name`` (``add_backend``)."""
    return _modules[name]


def register(op: str, name: str, backend: str, impl: Callable, *, schedule: str | None = None, needs=(),
             summary: str = "") -> Algorithm:
    """Add an algorithm (a backend does this when it is imported); returns the entry."""
    from .. import cost

    if op not in OPS:
        raise ValueError(f"register: op={op!r} is not one of {', '.join(OPS)}")
    schedule = name if schedule is None else schedule
    if schedule not in cost.ALGOS[op]:
        raise ValueError(f"register: {backend} {op} {name!r} runs schedule {schedule!r}, which the cost model "
                         f"does not price (it knows {', '.join(cost.ALGOS[op])})")
    unknown = set(needs) - NEEDS
    if unknown:
        raise ValueError(f"register: needs={sorted(unknown)} (known: {', '.join(sorted(NEEDS))})")
    entry = Algorithm(op, name, backend, impl, schedule, frozenset(needs), summary)
    algos = _table.setdefault((op, backend), {})
    if name in algos:
        raise ValueError(f"register: {backend} {op} {name!r} is registered already")
    algos[name] = entry
    return entry


def alias(backend: str, other: str, name: str) -> None:
    """Let ``algo=other`` mean ``name`` on ``backend`` (a name another backend uses for the same schedule)."""
    _aliases[(backend, other)] = name


def supports(op: str, backend: str) -> bool:
    """Whether ``backend`` has an algorithm of ``op``."""
    return bool(_table.get((op, backend)))


def algorithms(op: str, backend: str) -> tuple[Algorithm, ...]:
    """The algorithms of ``op`` on ``backend``, in registration order."""
    return tuple(_table.get((op, backend), {}).values())


def names(backend: str) -> dict[str, tuple[str, ...]]:
    """``{op: algorithm names}`` of ``backend`` (the ops it has)."""
    return {op: tuple(_table[(op, backend)]) for op in OPS if (op, backend) in _table}


def backends() -> tuple[str, ...]:
    return tuple(_modules)


def get(fn: str, op: str, name: str, backend: str) -> Algorithm:
    """The entry for ``algo=name``; a ``ValueError`` naming ``fn`` and the choices if there is none."""
    algos = _table.get((op, backend), {})
    found = algos.get(_aliases.get((backend, name), name))
    if found is None:
        where = {"cuda": " for CUDA tensors", "sycl": " for xelink.sycl arrays"}.get(backend, "")
        raise ValueError(f"{fn}: algo={name!r} is not one of auto, {', '.join(algos)}{where}")
    return found
