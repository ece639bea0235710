"""Building the tuning table (``xelink.tuning``) from measured result rows."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from ..tuning import OWN, TuningTable, _check_fingerprint
from .harness import Row

__all__ = ["build_table"]


def _candidates(rows: Sequence[Row]):
    """(op, dtype, size) -> {algo: best median us}, from every correct measurement in ``rows``."""
    out: dict[tuple[str, str, int], dict[str, float]] = {}

    def add(key, path: str, us: float | None):
        if us is None:
            return
        # Anything not xelink's own is a vendor baseline; auto dispatches to it by backend.
        algo = path if path.startswith("xelink:") else "baseline:" + path.split(":")[0]
        best = out.setdefault(key, {})
        best[algo] = min(us, best.get(algo, us))

    for row in rows:
        if row.wrong:
            continue  # a path that gave wrong results cannot be the fastest
        key = (row.op, row.dtype, row.size_bytes)
        add(key, row.path, row.time_us)
        if row.baseline is not None:
            add(key, row.baseline, row.baseline_us)
    return out


def build_table(rows: Iterable[Row], fingerprint, *, manifest: Mapping[str, Any] | None = None) -> TuningTable:
    """The tuning table of measured result rows: per op, dtype and size, the fastest path.

    Candidates are xelink's own paths (``xelink:*``) and the baselines (other paths, both their own
    rows and the ``baseline_us`` of xelink rows), recorded as ``baseline:<backend>`` when faster.
    Rows with wrong results are ignored. Each measured size ``s`` gets the range up to the next
    measured size; the smallest size's range starts at 0 and the largest has no upper end, so sizes
    outside the sweep take the winner at its nearest end. Neighbouring ranges with the same winner
    are merged. Ties go to xelink's path, then to the name. For a host op (CPU ranks) where a baseline
    wins somewhere, the entry ``op + tuning.OWN`` holds xelink's fastest path per range too: the CPU
    backend cannot hand the work to MPI's own collective, so that is what ``auto`` runs there.

    Args:
        rows: result rows of one machine layout (all with the same ``nranks``).
        fingerprint: the fingerprint of that layout.
        manifest: the measuring run's manifest, kept in the table for provenance.

    Returns:
        the table.
    """
    fp = fingerprint  # the argument hides the module's fingerprint(), which is not needed here
    _check_fingerprint("build_table", fp)
    rows = list(rows)
    for row in rows:
        if not isinstance(row, Row):
            raise TypeError(f"build_table: rows must be Row objects, found {row!r}")
    nranks = sorted({row.nranks for row in rows})
    if len(nranks) > 1:
        raise ValueError(f"build_table: rows measured at nranks {nranks}; one table covers one machine layout")
    winners: dict[tuple[str, str], list[tuple[int, str]]] = {}
    own: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for (op, dtype, size), times in sorted(_candidates(rows).items()):
        best = min(times, key=lambda algo: (times[algo], algo.startswith("baseline:"), algo))
        winners.setdefault((op, dtype), []).append((size, best))
        mine = [algo for algo in times if algo.startswith("xelink:")]
        if mine and ":" not in op:  # host ops (CPU ranks): MPI's own collective cannot be dispatched to; the GPU
            # backends register their baselines (NCCL), so a "cuda:<op>" table needs no second entry
            own.setdefault((op + OWN, dtype), []).append((size, min(mine, key=lambda algo: (times[algo], algo))))
    entries = {key: _ranges(points) for key, points in winners.items()}
    # xelink's fastest where a baseline wins somewhere (tuning.OWN: what auto runs where it cannot hand work over)
    entries.update({key: _ranges(points) for key, points in own.items()
                    if any(algo.startswith("baseline:") for _, _, algo in entries[(key[0][:-len(OWN)], key[1])])})
    return TuningTable(fingerprint=fp, entries=entries, manifest=dict(manifest) if manifest is not None else None)


def _ranges(points: list[tuple[int, str]]) -> list[tuple[int, int | None, str]]:
    """Measured (size, winner) points as ranges: each size's range reaches the next measured size, the first
    starts at 0, the last has no end, and neighbours with one winner merge."""
    ranges: list[list] = []
    for i, (size, algo) in enumerate(points):
        lo = 0 if i == 0 else size
        if ranges and ranges[-1][2] == algo:
            continue  # the previous range extends over this size
        if ranges:
            ranges[-1][1] = lo
        ranges.append([lo, None, algo])
    return [tuple(r) for r in ranges]
