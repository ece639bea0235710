"""The tuning table: per op, dtype and size range, the fastest path measured on one machine.

``algo="auto"`` reads it when its fingerprint matches the machine it runs on; a table of another
machine is never applied. The benchmark suite writes it (``xelink.bench.tune.build_table`` from result
rows, then ``save``); ``xelink.init`` finds the table of its machine (``XELINK_TUNING``).

File format (JSON)::

    {
      "format": "xelink-tuning",
      "version": 1,
      "fingerprint": {"topology": "cpu-2x2", "nranks": 4, "ranks_per_host": [4], "devices": {"cpu CPU rank": 4},
                      "ranks_per_device": [1, 1, 1, 1], "links": ["shm 8"]},
      "entries": [
        {"op": "all_reduce", "dtype": "float32",
         "ranges": [[0, 65536, "xelink:one_shot"], [65536, null, "xelink:ring"]]}
      ],
      "manifest": {...}                       (optional: the run that measured it)
    }

A range ``[lo, hi, algo]`` covers message sizes ``lo <= nbytes < hi`` in bytes; ``hi`` null means no
upper end. Ranges of an entry are sorted and do not overlap; gaps are allowed (lookup gives None
there). ``algo`` is an xelink path (``"xelink:ring"``) or ``"baseline:<backend>"`` (``"baseline:nccl"``,
``"baseline:mpi"``) where the vendor's collective was measured faster, so auto can hand the work to it.

The fingerprint is any JSON string or object the caller uses to identify the machine's layout;
``fingerprint()`` makes the usual one. Two fingerprints match when they are equal as JSON values.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .log import get_logger

__all__ = ["FORMAT", "OWN", "VERSION", "TuningTable", "active", "dtype_name", "find_table", "fingerprint", "load",
           "save_merged", "set_active"]

FORMAT = "xelink-tuning"
VERSION = 1
# Directories are searched for files with this suffix only, so other JSON files can live beside them.
SUFFIX = ".tuning.json"
# Where a baseline wins a range, the entry ``op + OWN`` (e.g. ``"all_reduce/xelink"``) holds the fastest of xelink's
# own paths there: what ``auto`` runs on a backend that cannot dispatch to that baseline (MPI's on CPU ranks).
OWN = "/xelink"

_log = get_logger("tuning")
_active: list = [None]  # the table xelink.init found for this machine


def active() -> "TuningTable | None":
    """The measured tuning table ``xelink.init`` found for this machine (``XELINK_TUNING``), or None."""
    return _active[0]


def set_active(table: "TuningTable | None") -> None:
    """Make ``table`` the one ``algo="auto"`` reads (``xelink.init``; tests)."""
    _active[0] = table


def dtype_name(dtype) -> str:
    """The short name of a torch or numpy dtype, or a name given as a string: ``"float32"``."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    return np.dtype(dtype).name


def fingerprint(topology: str | None, hosts: Sequence[str], placement=None) -> dict:
    """The usual fingerprint of a machine layout: topology name, rank count and ranks per host; with the
    job's placement, also what tells apart two machines whose topology has one name (``"discovered-cuda"``
    for any 2-GPU host): the devices' models, the ranks on each device and the links between them.

    Host names are left out on purpose, so a table measured on one node applies to another node of
    the same kind.

    Args:
        topology: the topology's name, or None when there is none.
        hosts: the host name of each rank (``comm.hosts``).
        placement: the ranks' ``topology.Placement`` (``comm.world_placement``), or None.

    Returns:
        ``{"topology": ..., "nranks": len(hosts), "ranks_per_host": [...]}``, hosts in order of first rank;
        with ``placement`` also ``"devices"`` (``"<kind> <name>"`` -> devices used), ``"ranks_per_device"``
        (devices in order of first rank) and ``"links"`` (the sorted ``"<kind> <GB/s>"`` of the links between
        the devices used).
    """
    if isinstance(hosts, str) or not isinstance(hosts, Sequence) or not hosts:
        raise ValueError(f"fingerprint: hosts={hosts!r} must be a non-empty list of host names, one per rank")
    # Counters keep the order of first appearance: hosts (devices) in order of their first rank.
    fp = {"topology": topology, "nranks": len(hosts), "ranks_per_host": list(collections.Counter(hosts).values())}
    if placement is not None:
        if placement.nranks != len(hosts):
            raise ValueError(f"fingerprint: a placement of {placement.nranks} rank(s) for {len(hosts)} host name(s)")
        topo, per_device = placement.topology, collections.Counter(placement.devices)
        fp["devices"] = dict(collections.Counter(f"{d.kind} {d.name}".strip() for d in map(topo.device, per_device)))
        fp["ranks_per_device"] = list(per_device.values())
        links = (topo.route(a, b)[0] for a in per_device for b in per_device if a != b)
        fp["links"] = sorted({f"{link.kind} {link.bandwidth_gbps:g}" for link in links})
    return fp


def _canonical(fp) -> str:
    return json.dumps(fp, sort_keys=True, separators=(",", ":"))


def _check_fingerprint(fn: str, fp) -> None:
    if not isinstance(fp, (str, Mapping)):
        raise TypeError(f"{fn}: fingerprint={fp!r} must be a str or a dict")
    try:
        _canonical(fp)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: fingerprint={fp!r} must be JSON-ready (str, numbers, lists, dicts)") from None


@dataclasses.dataclass
class TuningTable:
    """The fastest path per (op, dtype) and size range, for the machine named by ``fingerprint``.

    Attributes:
        fingerprint: the machine layout the table was measured on (str or dict).
        entries: ``(op, dtype) -> [(lo, hi, algo), ...]``, sorted, ``hi`` None for no upper end.
        manifest: the manifest of the measuring run, or None.
        source: the file it was loaded from, or None.
    """

    fingerprint: Any
    entries: dict[tuple[str, str], list[tuple[int, int | None, str]]]
    manifest: dict | None = None
    source: str | None = None

    def matches(self, fp) -> bool:
        """Whether this table was measured on the layout ``fp`` (equal as JSON values)."""
        return _canonical(self.fingerprint) == _canonical(fp)

    def lookup(self, op: str, dtype, nbytes: int) -> str | None:
        """The fastest path measured for ``op`` on ``dtype`` at ``nbytes`` bytes, or None if not covered.

        Args:
            op: the op name (``"all_reduce"``).
            dtype: a dtype name, torch dtype or numpy dtype.
            nbytes: the message size in bytes.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"TuningTable.lookup: nbytes={nbytes!r} must be an int >= 0")
        for lo, hi, algo in self.entries.get((op, dtype_name(dtype)), ()):
            if lo <= nbytes and (hi is None or nbytes < hi):
                return algo
        return None

    def splits(self, op: str, dtype, lo: int, hi: int) -> bool:
        """Whether a range of ``op`` on ``dtype`` starts or ends inside sizes ``lo .. hi`` (so that two sizes in
        there may map to different paths)."""
        return any(lo < edge <= hi for a, b, _ in self.entries.get((op, dtype_name(dtype)), ()) for edge in (a, b)
                   if edge is not None)

    def to_dict(self) -> dict:
        out = {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "entries": [{"op": op, "dtype": dtype, "ranges": [list(r) for r in ranges]}
                        for (op, dtype), ranges in sorted(self.entries.items())],
        }
        if self.manifest is not None:
            out["manifest"] = self.manifest
        return out

    def save(self, path) -> None:
        """Write the table to ``path`` (JSON), replacing the file atomically.

        Atomic because a job starting meanwhile may read the file: it sees the old table or the new
        one, never half of one.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


def _parse(data, where: str) -> TuningTable:
    """A table from the decoded JSON ``data``; problems raise ValueError starting with ``where``."""
    def bad(problem: str):
        return ValueError(f"{where}: {problem}")

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, found {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise bad(f"'format' is {data.get('format')!r}, expected {FORMAT!r} (not a tuning table?)")
    if data.get("version") != VERSION:
        raise bad(f"unsupported 'version' {data.get('version')!r} (this xelink reads version {VERSION})")
    if "fingerprint" not in data or not isinstance(data["fingerprint"], (str, dict)):
        raise bad("'fingerprint' is missing or not a string/object")
    if not isinstance(data.get("entries"), list):
        raise bad("'entries' is missing or not a list")
    manifest = data.get("manifest")
    if manifest is not None and not isinstance(manifest, dict):
        raise bad("'manifest' is not an object")
    entries: dict[tuple[str, str], list[tuple[int, int | None, str]]] = {}
    for i, entry in enumerate(data["entries"]):
        if not isinstance(entry, dict):
            raise bad(f"entries[{i}] is not an object")
        op, dtype, ranges = entry.get("op"), entry.get("dtype"), entry.get("ranges")
        if not isinstance(op, str) or not op or not isinstance(dtype, str) or not dtype:
            raise bad(f"entries[{i}]: 'op' and 'dtype' must be non-empty strings, found {op!r}, {dtype!r}")
        name = f"entries[{i}] ({op}, {dtype})"
        if (op, dtype) in entries:
            raise bad(f"{name}: a second entry for the same op and dtype")
        if not isinstance(ranges, list) or not ranges:
            raise bad(f"{name}: 'ranges' must be a non-empty list of [lo, hi, algo]")
        parsed = []
        for j, r in enumerate(ranges):
            if not (isinstance(r, list) and len(r) == 3):
                raise bad(f"{name}: ranges[{j}]={r!r} is not [lo, hi, algo]")
            lo, hi, algo = r
            if isinstance(lo, bool) or not isinstance(lo, int) or lo < 0:
                raise bad(f"{name}: ranges[{j}]: lo={lo!r} must be an int >= 0")
            if hi is not None and (isinstance(hi, bool) or not isinstance(hi, int) or hi <= lo):
                raise bad(f"{name}: ranges[{j}]: hi={hi!r} must be an int > lo={lo} or null")
            if not isinstance(algo, str) or not algo or algo == "auto":
                raise bad(f"{name}: ranges[{j}]: algo={algo!r} must name a path (not 'auto')")
            if parsed and (parsed[-1][1] is None or lo < parsed[-1][1]):
                raise bad(f"{name}: ranges[{j}] starts at {lo}, inside or before the previous range "
                          f"{list(parsed[-1])}; ranges must be sorted and must not overlap")
            parsed.append((lo, hi, algo))
        entries[(op, dtype)] = parsed
    return TuningTable(fingerprint=data["fingerprint"], entries=entries, manifest=manifest)


def load(path) -> TuningTable:
    """Read and validate a tuning table file.

    Raises:
        ValueError: naming the file and the problem, if it is not valid JSON or not a valid table.
        OSError: if it cannot be read.
    """
    where = f"tuning.load: {path}"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    table = _parse(data, where)
    table.source = str(path)
    return table


def save_merged(table: TuningTable, path) -> bool:
    """Save ``table`` at ``path``, keeping the entries of a table already there for the same machine layout.

    Each benchmark family writes the entries it measured (host ops, ``cuda:<op>``, one dtype or another);
    one file then holds them all. For an op and dtype in both, ``table``'s entry wins. A table there of
    another layout is replaced.

    Returns:
        whether entries of the table already at ``path`` were kept.

    Raises:
        ValueError: the file at ``path`` is not a valid table (it is left as it is).
    """
    old = load(path) if Path(path).is_file() else None
    merged = old is not None and old.matches(table.fingerprint)
    if merged:
        table = dataclasses.replace(table, entries={**old.entries, **table.entries})
    table.save(path)
    return merged


def find_table(fingerprint, search_paths: Iterable) -> TuningTable | None:
    """The first table in ``search_paths`` measured on the machine layout ``fingerprint``, or None.

    Args:
        fingerprint: this machine's fingerprint (see ``fingerprint()``).
        search_paths: files and directories, in order of preference. A file is read whatever its
            name; a directory contributes its ``*.tuning.json`` files, in name order. Paths that do
            not exist are skipped; tables of another fingerprint are skipped.

    Raises:
        ValueError: a file read is not a valid table (a broken table is an error, not a silent miss).
    """
    fp = fingerprint  # the argument hides the module's fingerprint(), which is not needed here
    _check_fingerprint("find_table", fp)
    if isinstance(search_paths, (str, os.PathLike)):
        search_paths = [search_paths]  # one path, not a sequence of one-character paths
    for entry in search_paths:
        entry = Path(entry)
        files = sorted(entry.glob("*" + SUFFIX)) if entry.is_dir() else [entry] if entry.is_file() else []
        for file in files:
            table = load(file)
            if table.matches(fp):
                return table
            _log.debug("tuning table %s is for %s, not this machine's %s; skipped",
                       file, _canonical(table.fingerprint), _canonical(fp))
    return None
