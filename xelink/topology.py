"""Machine descriptions: devices, packages, links; loading, validation, saving; placement and groups.

A *topology* says which devices a job can run on and how bytes move between them:

- a **device** is what one rank drives (a GPU, an Intel Max stack, a CPU rank slot); it has an
  injection limit (GB/s it can send in total, over all its links at once) and optionally a separate
  ejection limit (GB/s it can receive in total; the injection limit when not given);
- a **package** is a group of devices joined by a fast local link (the two stacks of an Intel Max card
  over MDFI, one NVLink island, the CPU ranks of one host); a package sits on one **host**;
- a **link** joins two or more endpoints, all devices, all packages or all hosts, and gives every
  pair of them its own channel of ``bandwidth_gbps`` per direction after ``latency_us``. A link that
  joins packages (or hosts) has one channel per package (host) pair, shared by all the devices in them.
  ``per_device_gbps`` optionally caps what one device sends over this link in total (Intel's
  measurement that a stack's XeLink egress saturates at about one link, however many peers it sends to).

Between two devices the most specific link carries the traffic: a link joining the two devices, else
one joining their packages, else one joining their hosts; ``validate`` insists that exactly one such
link exists for every pair. Every figure carries a ``*_source`` string that starts with
``measured here``, ``datasheet``, ``paper`` or ``estimate`` (optionally ``: detail``).

Shipped descriptions live in ``xelink/topologies/*.toml`` (package data, so a wheel has them);
``load(name_or_path)`` reads one by name or any file by path, ``dumps`` writes TOML back, ``discover``
builds one from the running job, and ``from_env_or_discover`` lets ``XELINK_TOPOLOGY`` override.

Ranks and groups: ``place(topology, nranks)`` maps rank r to a device (ranks fill the devices in file
order, package by package); ``packages``, ``package_of``, ``local_index`` and ``cross_peers`` are the
groups algorithms compose; ``Communicator.package_groups`` turns a communicator's packages into
sub-communicators.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from . import log
from .config import integer, opencl_runtime_default
from .errors import ConfigError

__all__ = [
    "Device",
    "Package",
    "Link",
    "Topology",
    "Placement",
    "SOURCE_KINDS",
    "ENV_VAR",
    "available",
    "load",
    "loads",
    "validate",
    "dumps",
    "save",
    "describe",
    "place",
    "packages",
    "package_of",
    "local_index",
    "cross_peers",
    "discover",
    "from_env_or_discover",
    "parse_nvidia_smi_topo",
    "build_cpu_topology",
    "build_cuda_topology",
    "build_xpu_topology",
]

SOURCE_KINDS = ("measured here", "datasheet", "paper", "estimate")
DEVICE_KINDS = ("cpu", "cuda", "xpu")
ENV_VAR = "XELINK_TOPOLOGY"
_log = log.get_logger("topology")


# ---------------------------------------------------------------------------------------------
# The model


@dataclasses.dataclass(frozen=True)
class Device:
    """One device a rank can drive.

    ``injection_gbps`` caps what the device sends in total (all links at once), ``ejection_gbps``
    what it receives in total (None: the same as ``injection_gbps``). GB/s are 1e9 bytes/s.
    """

    id: str
    package: str
    kind: str
    injection_gbps: float
    injection_source: str
    name: str = ""
    ejection_gbps: float | None = None
    ejection_source: str | None = None

    @property
    def egress_gbps(self) -> float:
        return self.injection_gbps

    @property
    def ingress_gbps(self) -> float:
        return self.injection_gbps if self.ejection_gbps is None else self.ejection_gbps


@dataclasses.dataclass(frozen=True)
class Package:
    """Devices joined by a fast local link, on one host (``host=""``: the one host of the machine)."""

    id: str
    devices: tuple[str, ...]
    host: str = ""
    name: str = ""
    size: int | None = None  # declared size, checked against ``devices``


@dataclasses.dataclass(frozen=True)
class Link:
    """A link kind joining endpoints (all devices, all packages or all hosts) pairwise.

    Every ordered pair of distinct endpoints gets a channel of ``bandwidth_gbps`` (per direction)
    after ``latency_us``. ``per_device_gbps``, when set, caps one device's total egress over this link.
    """

    name: str
    kind: str
    joins: tuple[str, ...]
    bandwidth_gbps: float
    bandwidth_source: str
    latency_us: float
    latency_source: str
    per_device_gbps: float | None = None
    per_device_source: str | None = None


@dataclasses.dataclass(frozen=True)
class Topology:
    """A validated machine description (build one with ``load``, ``loads``, ``discover`` or ``validate``).

    Device order (the order ranks fill devices) is package order, then the order inside each package.
    ``path`` is where it was read from (not part of equality).
    """

    name: str
    description: str
    packages: tuple[Package, ...]
    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    package_size: int | None = None
    path: str | None = dataclasses.field(default=None, compare=False)
    _index: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def where(self) -> str:
        return self.path or f"topology {self.name!r}"

    def device(self, device_id: str) -> Device:
        return self._lookup()["devices"][device_id]

    def package(self, package_id: str) -> Package:
        return self._lookup()["packages"][package_id]

    def link(self, name: str) -> Link:
        return self._lookup()["links"][name]

    @property
    def hosts(self) -> list[str]:
        """Host names in package order ("" is the implicit single host)."""
        return list(dict.fromkeys(p.host for p in self.packages))

    def route(self, src: str, dst: str) -> tuple[Link, str, str]:
        """The link that carries bytes from device ``src`` to device ``dst`` and the channel's endpoints.

        Returns ``(link, a, b)``: ``a``/``b`` are the devices, packages or hosts the link joins at that
        level; all traffic with the same ``(link.name, a, b)`` shares one channel.
        """
        idx = self._lookup()
        key = (src, dst)
        got = idx["routes"].get(key)
        if got is None:
            got = _find_route(self, idx, src, dst)
            idx["routes"][key] = got
        return got

    def _lookup(self) -> dict:
        if not self._index:
            self._index.update(_build_index(self))
        return self._index


def _build_index(t: Topology) -> dict:
    dev_pkg = {d.id: d.package for d in t.devices}
    pkg_host = {p.id: p.host for p in t.packages}
    by_level: dict = {"device": {}, "package": {}, "host": {}}
    packages = {p.id for p in t.packages}
    devices = {d.id for d in t.devices}
    for link in t.links:
        level = "device" if link.joins[0] in devices else "package" if link.joins[0] in packages else "host"
        ends = link.joins
        for i, a in enumerate(ends):
            for b in ends[i + 1:]:
                by_level[level].setdefault(frozenset((a, b)), []).append(link)
    return {
        "devices": {d.id: d for d in t.devices},
        "packages": {p.id: p for p in t.packages},
        "links": {l.name: l for l in t.links},
        "dev_pkg": dev_pkg,
        "pkg_host": pkg_host,
        "pairs": by_level,
        "routes": {},
    }


def _find_route(t: Topology, idx: dict, src: str, dst: str):
    if src not in idx["devices"] or dst not in idx["devices"]:
        missing = src if src not in idx["devices"] else dst
        raise ValueError(f"route: {t.where}: no device {missing!r}")
    if src == dst:
        raise ValueError(f"route: {t.where}: {src!r} to itself uses no link")
    pa, pb = idx["dev_pkg"][src], idx["dev_pkg"][dst]
    ha, hb = idx["pkg_host"][pa], idx["pkg_host"][pb]
    for level, a, b in (("device", src, dst), ("package", pa, pb), ("host", ha, hb)):
        if a == b:
            continue
        links = idx["pairs"][level].get(frozenset((a, b)))
        if links:
            return links[0], a, b
    raise ValueError(f"route: {t.where}: no link joins devices {src!r} and {dst!r}")


# ---------------------------------------------------------------------------------------------
# Reading TOML


def _toml_module():
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        try:
            import tomli as tomllib  # the same parser, packaged for Python 3.10
        except ImportError:
            raise ImportError("load: reading topology files needs Python 3.11+ (tomllib) or, on Python "
                              "3.10, the 'tomli' package (pip install tomli)") from None
    return tomllib


def _shipped_dir():
    return importlib.resources.files("xelink") / "topologies"


def available() -> list[str]:
    """Names of the shipped topology descriptions (``load(name)`` reads them)."""
    return sorted(p.name[:-5] for p in _shipped_dir().iterdir() if p.name.endswith(".toml"))


def load(name_or_path: str | os.PathLike) -> Topology:
    """Read and validate a topology: a shipped name (see ``available()``) or a path to a TOML file.

    Raises:
        ConfigError: unknown name, missing file, invalid TOML, a field of the wrong type or a description
            that fails ``validate`` (the message names the file and the problem; a ``ValueError``).
        TypeError: ``name_or_path`` is not a string or path.
    """
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path:
        raise TypeError(f"load: name_or_path={name_or_path!r} must be a topology name or a path")
    looks_like_path = name_or_path.endswith(".toml") or os.sep in name_or_path or "/" in name_or_path
    if looks_like_path or os.path.exists(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"load: topology file {name_or_path!r} does not exist")
        text, where = path.read_text(encoding="utf-8"), str(path)
    else:
        res = _shipped_dir() / f"{name_or_path}.toml"
        if not res.is_file():
            raise ConfigError(f"load: unknown topology {name_or_path!r}; shipped: {', '.join(available())} "
                              f"(or pass a path to a .toml file)")
        text, where = res.read_text(encoding="utf-8"), f"{name_or_path}.toml"
    try:
        return loads(text, path=where, fn="load")
    except (ValueError, TypeError) as exc:  # the file's problem, named by loads: a setting, as the name was
        raise ConfigError(str(exc)) from None


def parse_toml(text: str, where: str, fn: str) -> dict:
    """TOML text as a dict; invalid TOML is a ``ValueError`` naming ``fn`` and ``where`` (the file)."""
    tomllib = _toml_module()
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{fn}: {where}: not valid TOML: {exc}") from None


def loads(text: str, path: str | None = None, fn: str = "loads") -> Topology:
    """Parse and validate a topology from TOML text; ``path`` names it in error messages."""
    where = path or "<string>"
    return validate(_from_dict(parse_toml(text, where, fn), where, fn), fn=fn, path=path)


_TOP_KEYS = {"name", "description", "package_size", "device_defaults", "packages", "devices", "links"}
_PACKAGE_KEYS = {"id", "devices", "host", "name", "size"}
_DEVICE_KEYS = {"id", "kind", "name", "injection_gbps", "injection_source", "ejection_gbps", "ejection_source"}
_LINK_KEYS = {"name", "kind", "joins", "bandwidth_gbps", "bandwidth_source", "latency_us", "latency_source",
              "per_device_gbps", "per_device_source"}


class _Reader:
    """Typed field access with messages that name the file, the entry and the field."""

    def __init__(self, where: str, fn: str):
        self.where, self.fn = where, fn

    def fail(self, msg: str, exc=ValueError):
        raise exc(f"{self.fn}: {self.where}: {msg}")

    def keys(self, table: Mapping, allowed: set, what: str) -> None:
        if not isinstance(table, Mapping):
            self.fail(f"{what} must be a table, got {table!r}", TypeError)
        unknown = sorted(set(table) - allowed)
        if unknown:
            self.fail(f"unknown key {unknown[0]!r} in {what} (known: {', '.join(sorted(allowed))})")

    def str(self, table: Mapping, key: str, what: str, default=None, required=True):
        if key not in table:
            if required and default is None:
                self.fail(f"{what} has no {key!r}")
            return default
        value = table[key]
        if not isinstance(value, str):
            self.fail(f"{what} {key}={value!r} must be a string", TypeError)
        return value

    def number(self, table: Mapping, key: str, what: str, required=True):
        if key not in table:
            if required:
                self.fail(f"{what} has no {key!r}")
            return None
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"{what} {key}={value!r} must be a number", TypeError)
        return float(value)

    def int(self, table: Mapping, key: str, what: str):
        if key not in table:
            return None
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"{what} {key}={value!r} must be an integer", TypeError)
        return value

    def strings(self, table: Mapping, key: str, what: str) -> tuple:
        if key not in table:
            self.fail(f"{what} has no {key!r}")
        value = table[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(f"{what} {key}={value!r} must be a list of strings", TypeError)
        return tuple(value)

    def tables(self, data: Mapping, key: str) -> list:
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            self.fail(f"{key!r} must be an array of tables ([[{key}]])", TypeError)
        return value


def _from_dict(data: Mapping, where: str, fn: str) -> Topology:
    r = _Reader(where, fn)
    r.keys(data, _TOP_KEYS, "the file")
    name = r.str(data, "name", "the file")
    description = r.str(data, "description", "the file", default="", required=False)
    package_size = r.int(data, "package_size", "the file")
    defaults = data.get("device_defaults", {})
    r.keys(defaults, _DEVICE_KEYS - {"id"}, "[device_defaults]")

    packages = []
    for i, p in enumerate(r.tables(data, "packages")):
        what = f"package #{i}"
        r.keys(p, _PACKAGE_KEYS, what)
        pid = r.str(p, "id", what)
        what = f"package {pid!r}"
        packages.append(Package(id=pid, devices=r.strings(p, "devices", what),
                                host=r.str(p, "host", what, default="", required=False),
                                name=r.str(p, "name", what, default="", required=False),
                                size=r.int(p, "size", what)))

    member_of: dict = {}
    for p in packages:
        for d in p.devices:
            if d in member_of:
                r.fail(f"device {d!r} is listed in both package {member_of[d]!r} and package {p.id!r}")
            member_of[d] = p.id

    overrides: dict = {}
    for i, d in enumerate(r.tables(data, "devices")):
        r.keys(d, _DEVICE_KEYS, f"[[devices]] entry #{i}")
        did = r.str(d, "id", f"[[devices]] entry #{i}")
        if did in overrides:
            r.fail(f"duplicate device id {did!r} in [[devices]]")
        if did not in member_of:
            r.fail(f"device {did!r} is described in [[devices]] but listed in no package")
        overrides[did] = d

    devices = []
    for did, pid in member_of.items():
        entry = {**defaults, **overrides.get(did, {})}
        what = f"device {did!r}"
        injection = r.number(entry, "injection_gbps", what)
        ejection = r.number(entry, "ejection_gbps", what, required=False)
        devices.append(Device(
            id=did, package=pid, kind=r.str(entry, "kind", what),
            injection_gbps=injection, injection_source=r.str(entry, "injection_source", what),
            name=r.str(entry, "name", what, default="", required=False),
            ejection_gbps=ejection,
            ejection_source=r.str(entry, "ejection_source", what, required=ejection is not None)))

    links = []
    for i, l in enumerate(r.tables(data, "links")):
        what = f"link #{i}"
        r.keys(l, _LINK_KEYS, what)
        lname = r.str(l, "name", what)
        what = f"link {lname!r}"
        per_dev = r.number(l, "per_device_gbps", what, required=False)
        links.append(Link(
            name=lname, kind=r.str(l, "kind", what), joins=r.strings(l, "joins", what),
            bandwidth_gbps=r.number(l, "bandwidth_gbps", what),
            bandwidth_source=r.str(l, "bandwidth_source", what),
            latency_us=r.number(l, "latency_us", what), latency_source=r.str(l, "latency_source", what),
            per_device_gbps=per_dev,
            per_device_source=r.str(l, "per_device_source", what, required=per_dev is not None)))
    return Topology(name=name, description=description, packages=tuple(packages), devices=tuple(devices),
                    links=tuple(links), package_size=package_size, path=where)


# ---------------------------------------------------------------------------------------------
# Validation


def _check_source(r: _Reader, value, what: str) -> None:
    if value is None:
        r.fail(f"{what} is missing")
    if not isinstance(value, str):
        r.fail(f"{what}={value!r} must be a string", TypeError)
    if not any(value == k or value.startswith(k + ":") for k in SOURCE_KINDS):
        r.fail(f"{what}={value!r} must be one of {', '.join(repr(k) for k in SOURCE_KINDS)}, "
               f"optionally followed by ': detail'")


def _check_positive(r: _Reader, value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        r.fail(f"{what}={value!r} must be a number", TypeError)
    if not (math.isfinite(value) and value > 0):
        r.fail(f"{what}={value!r} must be a positive, finite number")


_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")


def validate(topology: Topology, fn: str = "validate", path: str | None = None) -> Topology:
    """Check a topology and return it; raise ``ValueError``/``TypeError`` naming the file and problem.

    Checks: ids are well formed and unique across devices, packages and hosts; every device is in one
    package; declared package sizes (``package_size``, per-package ``size``) match; device kinds are
    known; bandwidths, latencies and injection limits are positive and finite; every figure has a
    source; every link joins at least two known endpoints of one level (devices, packages or hosts);
    every pair of devices is joined by exactly one most-specific link (none missing, none ambiguous).
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"{fn}: topology={topology!r} is not a Topology")
    if path is not None and topology.path != path:
        topology = dataclasses.replace(topology, path=path, _index={})
    r = _Reader(topology.where, fn)
    if not topology.name:
        r.fail("name is empty")
    if not topology.packages:
        r.fail("declares no packages")

    seen: dict = {}

    def claim(ident, what):
        if not isinstance(ident, str) or not _ID.match(ident):
            r.fail(f"{what} id {ident!r} must be a non-empty string of letters, digits, '_', '.', '-'")
        if ident in seen:
            r.fail(f"duplicate id {ident!r}: used by {seen[ident]} and by {what}")
        seen[ident] = what

    for p in topology.packages:
        claim(p.id, f"package {p.id!r}")
    for d in topology.devices:
        claim(d.id, f"device {d.id!r}")
    hosts = []
    for p in topology.packages:
        if p.host and p.host not in hosts:
            hosts.append(p.host)
    for h in hosts:
        claim(h, f"host {h!r}")
    if hosts and any(not p.host for p in topology.packages):
        bare = next(p.id for p in topology.packages if not p.host)
        r.fail(f"package {bare!r} names no host, but other packages do; give every package a host")

    dev_ids = [d.id for d in topology.devices]
    listed = [d for p in topology.packages for d in p.devices]
    if listed != dev_ids:
        r.fail(f"devices {dev_ids} do not match the package lists {listed} (device order is package order)")
    for d in topology.devices:
        pkg = next((p for p in topology.packages if d.id in p.devices), None)
        if pkg is None or pkg.id != d.package:
            r.fail(f"device {d.id!r} says package {d.package!r}, but is listed in {pkg.id if pkg else None!r}")
        if d.kind not in DEVICE_KINDS:
            r.fail(f"device {d.id!r} kind={d.kind!r} must be one of {', '.join(DEVICE_KINDS)}")
        _check_positive(r, d.injection_gbps, f"device {d.id!r} injection_gbps")
        _check_source(r, d.injection_source, f"device {d.id!r} injection_source")
        if d.ejection_gbps is not None:
            _check_positive(r, d.ejection_gbps, f"device {d.id!r} ejection_gbps")
            _check_source(r, d.ejection_source, f"device {d.id!r} ejection_source")

    if topology.package_size is not None and (isinstance(topology.package_size, bool)
                                              or not isinstance(topology.package_size, int)
                                              or topology.package_size < 1):
        r.fail(f"package_size={topology.package_size!r} must be a positive integer")
    for p in topology.packages:
        if not p.devices:
            r.fail(f"package {p.id!r} has no devices")
        if p.size is not None and p.size != len(p.devices):
            r.fail(f"package {p.id!r} declares size={p.size} but lists {len(p.devices)} device(s)")
        if topology.package_size is not None and len(p.devices) != topology.package_size:
            r.fail(f"package {p.id!r} has {len(p.devices)} device(s) but package_size={topology.package_size} "
                   f"(inconsistent package sizes)")

    levels = {"device": set(dev_ids), "package": {p.id for p in topology.packages}, "host": set(hosts)}
    names = set()
    for link in topology.links:
        what = f"link {link.name!r}"
        if link.name in names:
            r.fail(f"duplicate link name {link.name!r}")
        names.add(link.name)
        if not link.kind:
            r.fail(f"{what} has an empty kind")
        for e in link.joins:
            if not any(e in ids for ids in levels.values()):
                r.fail(f"{what} joins unknown device, package or host {e!r}")
        if len(set(link.joins)) != len(link.joins):
            r.fail(f"{what} lists an endpoint twice in joins={list(link.joins)}")
        if len(link.joins) < 2:
            r.fail(f"{what} joins {list(link.joins)}: a link needs at least two endpoints")
        kinds = {lvl for e in link.joins for lvl, ids in levels.items() if e in ids}
        if len(kinds) != 1:
            r.fail(f"{what} mixes levels ({', '.join(sorted(kinds))}) in joins={list(link.joins)}; "
                   f"a link joins devices, packages or hosts")
        _check_positive(r, link.bandwidth_gbps, f"{what} bandwidth_gbps")
        _check_source(r, link.bandwidth_source, f"{what} bandwidth_source")
        _check_positive(r, link.latency_us, f"{what} latency_us")
        _check_source(r, link.latency_source, f"{what} latency_source")
        if link.per_device_gbps is not None:
            _check_positive(r, link.per_device_gbps, f"{what} per_device_gbps")
            _check_source(r, link.per_device_source, f"{what} per_device_source")

    fresh = dataclasses.replace(topology, _index={})
    idx = fresh._lookup()
    for level, pairs in idx["pairs"].items():
        for pair, links in pairs.items():
            if len(links) > 1:
                a, b = sorted(pair)
                r.fail(f"{level}s {a!r} and {b!r} are joined by both link {links[0].name!r} and link "
                       f"{links[1].name!r}; keep one")
    for i, a in enumerate(dev_ids):
        for b in dev_ids[i + 1:]:
            try:
                _find_route(fresh, idx, a, b)
            except ValueError:
                pa, pb = idx["dev_pkg"][a], idx["dev_pkg"][b]
                if pa == pb:
                    r.fail(f"missing link: devices {a!r} and {b!r} of package {pa!r} are joined by no link")
                r.fail(f"missing link: packages {pa!r} and {pb!r} are joined by no link "
                       f"(devices {a!r} and {b!r} cannot reach each other)")
    return fresh


# ---------------------------------------------------------------------------------------------
# Writing TOML


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"dumps: {v!r} cannot be written (figures must be finite)")
        return repr(v)  # repr round-trips exactly and is valid TOML ("19.0", "1e-05")
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"dumps: cannot write {v!r} as TOML")


def _table(header: str, fields: list) -> list[str]:
    lines = [header]
    lines += [f"{k} = {_toml_value(v)}" for k, v in fields if v is not None and v != ""]
    return lines + [""]


def dumps(topology: Topology) -> str:
    """The topology as TOML text that ``loads`` reads back to an equal ``Topology``.

    Every device is written out in full (no ``[device_defaults]``), so the text is explicit.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"dumps: topology={topology!r} is not a Topology")
    lines = [f"name = {_toml_value(topology.name)}"]
    if topology.description:
        lines.append(f"description = {_toml_value(topology.description)}")
    if topology.package_size is not None:
        lines.append(f"package_size = {topology.package_size}")
    lines.append("")
    for p in topology.packages:
        lines += _table("[[packages]]", [("id", p.id), ("host", p.host), ("name", p.name), ("size", p.size),
                                         ("devices", list(p.devices))])
    for d in topology.devices:
        lines += _table("[[devices]]", [
            ("id", d.id), ("kind", d.kind), ("name", d.name),
            ("injection_gbps", float(d.injection_gbps)), ("injection_source", d.injection_source),
            ("ejection_gbps", None if d.ejection_gbps is None else float(d.ejection_gbps)),
            ("ejection_source", d.ejection_source)])
    for l in topology.links:
        lines += _table("[[links]]", [
            ("name", l.name), ("kind", l.kind), ("joins", list(l.joins)),
            ("bandwidth_gbps", float(l.bandwidth_gbps)), ("bandwidth_source", l.bandwidth_source),
            ("latency_us", float(l.latency_us)), ("latency_source", l.latency_source),
            ("per_device_gbps", None if l.per_device_gbps is None else float(l.per_device_gbps)),
            ("per_device_source", l.per_device_source)])
    return "\n".join(lines).rstrip("\n") + "\n"


def save(topology: Topology, path: str | os.PathLike) -> None:
    """Write ``dumps(topology)`` to ``path``."""
    Path(path).write_text(dumps(topology), encoding="utf-8")


def _columns(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _num(v) -> str:
    return "-" if v is None else f"{v:g}"


def describe(topology: Topology) -> str:
    """A readable summary: devices, packages, links (with bandwidth, latency, caps) and figure sources."""
    if not isinstance(topology, Topology):
        raise TypeError(f"describe: topology={topology!r} is not a Topology")
    t = topology
    hosts = [h for h in t.hosts if h]
    out = [f"topology {t.name}" + (f" ({t.path})" if t.path else ""),
           f"  {t.description}" if t.description else "",
           f"  {len(t.devices)} device(s) in {len(t.packages)} package(s) on {max(1, len(hosts))} host(s)", "devices:"]
    out += _columns([["id", "package", "kind", "inject GB/s", "eject GB/s", "name"]] +
                    [[d.id, d.package, d.kind, _num(d.injection_gbps), _num(d.ingress_gbps), d.name]
                     for d in t.devices])
    out.append("packages:")
    out += _columns([["id", "host", "devices"]] +
                    [[p.id, p.host or "-", ", ".join(p.devices)] for p in t.packages])
    out.append("links:")
    out += _columns([["name", "kind", "joins", "GB/s", "latency us", "per-device GB/s"]] +
                    [[l.name, l.kind, ", ".join(l.joins), _num(l.bandwidth_gbps), _num(l.latency_us),
                      _num(l.per_device_gbps)] for l in t.links])
    sources: dict = {}
    for d in t.devices:
        sources.setdefault(f"injection: {d.injection_source}", []).append(d.id)
        if d.ejection_source:
            sources.setdefault(f"ejection: {d.ejection_source}", []).append(d.id)
    for l in t.links:
        sources.setdefault(f"bandwidth: {l.bandwidth_source}", []).append(l.name)
        sources.setdefault(f"latency: {l.latency_source}", []).append(l.name)
        if l.per_device_source:
            sources.setdefault(f"per-device: {l.per_device_source}", []).append(l.name)
    out.append("sources:")
    for text, who in sources.items():
        names = ", ".join(who) if len(who) <= 3 else f"{who[0]} ... {who[-1]} ({len(who)})"
        out.append(f"  {names}: {text}")
    return "\n".join(line for line in out if line != "")


# ---------------------------------------------------------------------------------------------
# Placement and groups


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which device each rank drives: ``devices[r]`` is rank r's device id in ``topology``.

    Groups (all pure functions of the placement, computed once):
      - ``packages()``: the ranks of each package that holds ranks, in rank order, packages ordered by
        their first rank;
      - ``package_of(r)``: index of r's package in that list; ``local_index(r)``: r's position in it;
      - ``cross_peers(r)``: for every other package, its rank with r's local index, if it has one.
        With uneven packages (3 + 2 ranks) the rank with local index 2 has no peer in the 2-rank
        package, so it is simply absent from that rank's ``cross_peers`` (and its cross group in
        ``Communicator.package_groups`` holds only the packages that have that index).
    """

    topology: Topology
    devices: tuple[str, ...]
    _groups: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def nranks(self) -> int:
        return len(self.devices)

    def device(self, rank: int) -> Device:
        return self.topology.device(self.devices[self._rank(rank, "device")])

    def packages(self) -> list[list[int]]:
        return [list(g) for g in self._cached()]

    def package_of(self, rank: int) -> int:
        rank = self._rank(rank, "package_of")
        return next(i for i, g in enumerate(self._cached()) if rank in g)

    def local_index(self, rank: int) -> int:
        rank = self._rank(rank, "local_index")
        return self._cached()[self.package_of(rank)].index(rank)

    def cross_peers(self, rank: int) -> list[int]:
        rank = self._rank(rank, "cross_peers")
        mine, li = self.package_of(rank), self.local_index(rank)
        return [g[li] for i, g in enumerate(self._cached()) if i != mine and li < len(g)]

    def _rank(self, rank, fn: str) -> int:
        rank = integer(fn, "rank", rank)
        if not 0 <= rank < self.nranks:
            raise ValueError(f"{fn}: rank={rank} is out of range for a placement of {self.nranks} rank(s)")
        return rank

    def _cached(self) -> tuple:
        if not self._groups:
            groups: dict = {}
            for r, d in enumerate(self.devices):
                groups.setdefault(self.topology.device(d).package, []).append(r)
            object.__setattr__(self, "_groups", tuple(tuple(g) for g in groups.values()))
        return self._groups


def place(topology: Topology, nranks: int, ranks_per_device: int = 1, *,
          devices: Sequence[str] | None = None) -> Placement:
    """Map ranks to devices: rank r drives device ``r // ranks_per_device`` in file order.

    Args:
        topology: a validated ``Topology``.
        nranks: number of ranks (>= 1).
        ranks_per_device: how many ranks may share one device (as ``init(ranks_per_device=)``).
        devices: an explicit device id per rank instead of filling in order (e.g. for a launcher that
            placed ranks round-robin across hosts).

    Raises:
        ValueError: more ranks than ``len(devices) * ranks_per_device`` (naming both numbers), or an
            explicit ``devices`` list that names unknown devices or overfills one.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"place: topology={topology!r} is not a Topology")
    nranks, ranks_per_device = (integer("place", name, value, 1) for name, value in
                                (("nranks", nranks), ("ranks_per_device", ranks_per_device)))
    ndev = len(topology.devices)
    if devices is not None:
        devices = tuple(devices)
        if len(devices) != nranks:
            raise ValueError(f"place: devices lists {len(devices)} device(s) for nranks={nranks}")
        known = {d.id for d in topology.devices}
        for d in devices:
            if d not in known:
                raise ValueError(f"place: device {d!r} is not in {topology.where}")
            if devices.count(d) > ranks_per_device:
                raise ValueError(f"place: {devices.count(d)} ranks on device {d!r} but ranks_per_device="
                                 f"{ranks_per_device}")
        return Placement(topology, devices)
    if nranks > ndev * ranks_per_device:
        raise ValueError(
            f"place: {nranks} ranks but topology {topology.name!r} has {ndev} device(s) and "
            f"ranks_per_device={ranks_per_device} (at most {ndev * ranks_per_device} ranks); launch fewer "
            f"ranks, pass ranks_per_device, or use a larger topology")
    return Placement(topology, tuple(topology.devices[r // ranks_per_device].id for r in range(nranks)))


def _check_placement(placement, fn: str) -> Placement:
    if not isinstance(placement, Placement):
        raise TypeError(f"{fn}: placement={placement!r} is not a Placement (make one with place())")
    return placement


def packages(placement: Placement) -> list[list[int]]:
    """The ranks of each package (that holds ranks), in rank order; see ``Placement``."""
    return _check_placement(placement, "packages").packages()


def package_of(placement: Placement, rank: int) -> int:
    """Index (into ``packages(placement)``) of the package of ``rank``."""
    return _check_placement(placement, "package_of").package_of(rank)


def local_index(placement: Placement, rank: int) -> int:
    """Position of ``rank`` among the ranks of its package."""
    return _check_placement(placement, "local_index").local_index(rank)


def cross_peers(placement: Placement, rank: int) -> list[int]:
    """The ranks of other packages with ``rank``'s local index; packages without that index are skipped."""
    return _check_placement(placement, "cross_peers").cross_peers(rank)


# ---------------------------------------------------------------------------------------------
# Discovery

# Figures for discovered links when nothing better is known. Each carries its reason; a shipped file
# of the same device (by product name) supplies better ones where it has them.
_CPU_SHM = (8.0, "estimate: MPI shared-memory Send/Recv, measured 8 GB/s on a 2-core CI host", 2.4,
            "estimate: MPI shared-memory ping-pong, measured 2.4 us on a 2-core CI host")
_NETWORK = (25.0, "estimate: one 200 Gb/s NIC per host", 5.0, "estimate: RDMA latency incl. software")
_PCIE = (25.0, "estimate: PCIe 4.0 x16 peer copy", 10.0, "estimate: PCIe peer write incl. software")
_NVLINK_PER_LINK_GBPS = 25.0  # NVLink 3 and 4 lanes: 25 GB/s per direction each (datasheets)
_NVLINK_LAT = (3.0, "estimate: one-shot all-reduce of 1 KiB on 2 x H200 took 6.6 us (ANCHORS.md)")


def _host_ids(hosts: Sequence[str]) -> dict:
    return {h: f"host{i}" for i, h in enumerate(dict.fromkeys(hosts))}


def build_cpu_topology(hosts: Sequence[str]) -> Topology:
    """CPU ranks: one package per host (ranks of a host share memory), hosts joined by a network.

    ``hosts[r]`` is rank r's host name. Devices are ``rank<r>``; packages are ``host<i>`` in order of
    first appearance (their ``host`` field is the real host name). Figures are estimates.
    """
    ids = _host_ids(hosts)
    members: dict = {}
    for r, h in enumerate(hosts):
        members.setdefault(h, []).append(f"rank{r}")
    pkgs = tuple(Package(id=ids[h], devices=tuple(m), host=h if len(ids) > 1 else "", name=f"ranks on {h}")
                 for h, m in members.items())
    devs = tuple(Device(id=d, package=ids[h], kind="cpu", name="CPU rank", injection_gbps=_CPU_SHM[0],
                        injection_source=_CPU_SHM[1]) for h, m in members.items() for d in m)
    links = [Link(f"shm-{ids[h]}", "shm", tuple(m), *_CPU_SHM) for h, m in members.items() if len(m) > 1]
    if len(ids) > 1:
        links.append(Link("network", "network", tuple(members), *_NETWORK))
    desc = f"discovered: {len(hosts)} CPU rank(s) on {len(ids)} host(s); one package per host"
    return validate(Topology(name="discovered-cpu", description=desc, packages=pkgs, devices=devs,
                             links=tuple(links)), fn="discover")


_NV = re.compile(r"^NV(\d+)$")


def parse_nvidia_smi_topo(text: str) -> dict:
    """Parse ``nvidia-smi topo -m``: the GPUs and the NVLink count of each pair.

    Returns ``{"gpus": ["GPU0", ...], "nvlink": {(i, j): n}, "paths": {(i, j): "NV18" | "SYS" | ...}}``
    with ``i < j`` GPU indices; ``nvlink`` holds only the pairs joined by NVLink. Columns for NICs and
    CPU/NUMA affinity are ignored.

    Raises:
        ValueError: the text has no GPU matrix.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_nvidia_smi_topo: text must be a str, got {type(text).__name__}")
    lines = [ln.replace("\x1b[4m", "").replace("\x1b[0m", "") for ln in text.splitlines()]
    at = next((i for i, ln in enumerate(lines) if re.match(r"^\s+GPU0\b", ln)), None)
    if at is None:
        raise ValueError("parse_nvidia_smi_topo: no header row starting with GPU0 found")
    cols = lines[at].split()
    gpu_cols = [c for c in cols if re.fullmatch(r"GPU\d+", c)]
    ngpu = len(gpu_cols)
    paths: dict = {}
    nvlink: dict = {}
    rows = 0
    for ln in lines[at + 1:]:
        parts = ln.split()
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]) or len(parts) < ngpu + 1:
            continue
        i = int(parts[0][3:])
        rows += 1
        for j, cell in enumerate(parts[1:ngpu + 1]):
            if i == j:
                continue
            a, b = min(i, j), max(i, j)
            paths[(a, b)] = cell
            m = _NV.match(cell)
            if m:
                nvlink[(a, b)] = int(m.group(1))
    if rows != ngpu:
        raise ValueError(f"parse_nvidia_smi_topo: header names {ngpu} GPU(s) but {rows} GPU row(s) follow")
    return {"gpus": gpu_cols, "nvlink": nvlink, "paths": paths}


def _uuid(value) -> str:
    """One spelling of a GPU UUID: torch prints ``b330b5a7-...``, NVML and nvidia-smi ``GPU-b330b5a7-...``."""
    text = str(value).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _probe_nvlink() -> dict:
    """NVLink counts between this host's GPUs by UUID: NVML if importable, else ``nvidia-smi``."""
    try:
        import pynvml  # nvidia-ml-py; optional
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            found = _probe_nvml(pynvml)
            if found["nvlink"]:
                return found
            # Seen on a sandboxed 2 x H200 host: NVML answers but reports no NVLink; nvidia-smi still does.
            _log.info("discover: NVML reports no NVLink; asking nvidia-smi")
        except pynvml.NVMLError as exc:
            _log.info("discover: NVML probe failed (%s); trying nvidia-smi", exc)
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"source": None, "error": "neither NVML (pip install nvidia-ml-py) nor nvidia-smi is available"}
    try:
        topo = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=True).stdout
        ids = subprocess.run([exe, "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        parsed = parse_nvidia_smi_topo(topo)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"source": None, "error": f"nvidia-smi failed: {exc}"}
    uuid = {int(i): _uuid(u) for i, u in (ln.split(",", 1) for ln in ids.splitlines() if "," in ln)}
    pairs = {(uuid[a], uuid[b]): n for (a, b), n in parsed["nvlink"].items() if a in uuid and b in uuid}
    return {"source": "nvidia-smi topo -m", "nvlink": pairs}


def _probe_nvml(pynvml) -> dict:
    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        uuids = [_uuid(_text(pynvml.nvmlDeviceGetUUID(h))) for h in handles]
        bus = {_text(pynvml.nvmlDeviceGetPciInfo(h).busId).lower(): u for h, u in zip(handles, uuids)}
        pairs: dict = {}
        switch_links: dict = {}
        for h, u in zip(handles, uuids):
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = _text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).lower()
                except pynvml.NVMLError:
                    continue
                if remote in bus and bus[remote] != u:
                    key = tuple(sorted((u, bus[remote])))
                    pairs[key] = pairs.get(key, 0) + 1
                elif remote not in bus:
                    # The far end is an NVSwitch: every switched GPU reaches every other at its link count.
                    switch_links[u] = switch_links.get(u, 0) + 1
        # Each direct link was seen from both ends.
        pairs = {k: v // 2 for k, v in pairs.items()}
        sw = sorted(switch_links)
        for i, a in enumerate(sw):
            for b in sw[i + 1:]:
                pairs[(a, b)] = pairs.get((a, b), 0) + min(switch_links[a], switch_links[b])
        return {"source": "NVML", "nvlink": pairs}
    finally:
        pynvml.nvmlShutdown()


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _components(nodes: list, edges: set) -> list[list]:
    comps, seen = [], set()
    for n in nodes:
        if n in seen:
            continue
        comp, todo = [], [n]
        seen.add(n)
        while todo:
            x = todo.pop(0)
            comp.append(x)
            for y in nodes:
                if y not in seen and frozenset((x, y)) in edges:
                    seen.add(y)
                    todo.append(y)
        comps.append(sorted(comp, key=nodes.index))
    return comps


def _discovered(name: str, what: str, host_id: dict, pkgs, devs, links, notes) -> Topology:
    """The validated topology of a GPU discovery: a network joins the hosts when there are several."""
    if len(host_id) > 1:
        links = [*links, Link("network", "network", tuple(host_id), *_NETWORK)]
    desc = f"discovered: {what} on {len(host_id)} host(s)"
    if notes:
        desc += "; " + "; ".join(notes)
    return validate(Topology(name=name, description=desc, packages=tuple(pkgs), devices=tuple(devs),
                             links=tuple(links)), fn="discover")


def build_cuda_topology(records: Sequence[Mapping], probes: Mapping[str, Mapping]) -> Topology:
    """NVIDIA GPUs: packages are NVLink islands of one host; PCIe joins islands, a network joins hosts.

    Args:
        records: per rank, ``{"host", "uuid", "name"}`` of the GPU it drives.
        probes: per host, ``_probe_nvlink()``'s result: ``{"nvlink": {(uuid_a, uuid_b): links}}`` or
            ``{"source": None, "error": why}`` when NVLink could not be probed (then every GPU is its own
            package and the description says why).

    GPUs appear in order of the first rank that drives them; NVLink bandwidth is links x 25 GB/s.
    """
    hosts = [r["host"] for r in records]
    host_id = _host_ids(hosts)
    gpus: dict = {}  # (host, uuid) -> (device id, name)
    for r in records:
        key = (r["host"], r["uuid"])
        if key not in gpus:
            gpus[key] = (f"gpu{len(gpus)}", r.get("name", ""))
    pkgs, devs, links, notes = [], [], [], []
    for host, hid in host_id.items():
        local = [k for k in gpus if k[0] == host]
        probe = probes.get(host, {})
        nv = {frozenset(p): n for p, n in (probe.get("nvlink") or {}).items()}
        if probe.get("source") is None:
            notes.append(f"{host}: NVLink unknown ({probe.get('error', 'not probed')})")
        elif not nv and len(local) > 1:
            notes.append(f"{host}: {probe['source']} reports no NVLink between its GPUs")
        uuids = [u for _, u in local]
        islands = _components(uuids, set(nv))
        host_pkgs = []
        for k, island in enumerate(islands):
            pid = f"{hid}.nvl{k}"
            ids = [gpus[(host, u)][0] for u in island]
            host_pkgs.append(pid)
            pkgs.append(Package(id=pid, devices=tuple(ids), host=host if len(host_id) > 1 else "",
                                name=f"NVLink island {k} on {host}"))
            counts = {nv[frozenset((a, b))] for i, a in enumerate(island) for b in island[i + 1:]
                      if frozenset((a, b)) in nv}
            full = all(frozenset((a, b)) in nv for i, a in enumerate(island) for b in island[i + 1:])
            total = 0.0
            if len(island) > 1 and full and len(counts) == 1:
                n = counts.pop()
                total = n * _NVLINK_PER_LINK_GBPS
                links.append(Link(f"nvlink-{pid}", "nvlink", tuple(ids), total,
                                  f"estimate: NV{n} from {probe['source']}, {n} x 25 GB/s per direction",
                                  *_NVLINK_LAT))
            else:
                for i, a in enumerate(island):
                    for b in island[i + 1:]:
                        n = nv.get(frozenset((a, b)))
                        if n:
                            total = max(total, n * _NVLINK_PER_LINK_GBPS)
                            links.append(Link(f"nvlink-{gpus[(host, a)][0]}-{gpus[(host, b)][0]}", "nvlink",
                                              (gpus[(host, a)][0], gpus[(host, b)][0]), n * _NVLINK_PER_LINK_GBPS,
                                              f"estimate: NV{n} from {probe['source']}, {n} x 25 GB/s per "
                                              f"direction", *_NVLINK_LAT))
            for u in island:
                devs.append(Device(id=gpus[(host, u)][0], package=pid, kind="cuda", name=gpus[(host, u)][1],
                                   injection_gbps=max(total, _PCIE[0]),
                                   injection_source="estimate: the GPU's widest link (NVLink total or PCIe)"))
        if len(host_pkgs) > 1:
            links.append(Link(f"pcie-{hid}", "pcie", tuple(host_pkgs), *_PCIE))
    return _discovered("discovered-cuda", f"{len(gpus)} NVIDIA GPU(s)", host_id, pkgs, devs, links, notes)


def _product_key(name: str) -> str:
    """``"Intel(R) Data Center GPU Max 1550"`` and ``"Intel Data Center GPU Max 1550 (one stack)"`` alike."""
    name = re.sub(r"\((r|tm)\)", "", name.lower())
    name = re.sub(r"\([^)]*\)", "", name)
    return " ".join(name.split())


def _shipped_figures(product: str) -> dict:
    """Link figures by link kind from a shipped topology whose devices are this product."""
    key = _product_key(product)
    for name in available():
        try:
            t = load(name)
        except (ValueError, TypeError):
            continue
        if key and any(_product_key(d.name) == key for d in t.devices):
            return {l.kind: l for l in t.links} | {"_device": t.devices[0]}
    return {}


def build_xpu_topology(records: Sequence[Mapping], probes: Mapping[str, Mapping]) -> Topology:
    """Intel GPUs from dpctl: packages are cards, devices the units ranks drive (stacks or cards).

    Args:
        records: per rank, ``{"host", "index", "name"}``: the torch ``xpu`` index it drives.
        probes: per host, ``{"units": [{"name", "card", "stacks"}], "peer": {(i, j): bool}}`` from
            ``_probe_dpctl`` (``units`` in Level Zero order, ``card`` the index of the card a unit belongs
            to, ``stacks`` its sub-devices when the unit is a whole card), or
            ``{"source": None, "error": why}``.

    Units of one card are joined by ``mdfi``; cards by ``xelink`` where peer access works, else ``pcie``.
    Figures come from a shipped topology of the same product where one exists, else estimates.
    """
    hosts = [r["host"] for r in records]
    host_id = _host_ids(hosts)
    units: dict = {}
    for r in records:
        key = (r["host"], r["index"])
        if key not in units:
            units[key] = f"xpu{len(units)}"
    pkgs, devs, links, notes = [], [], [], []
    for host, hid in host_id.items():
        probe = probes.get(host, {})
        info = probe.get("units")
        if info is None:
            notes.append(f"{host}: cards unknown ({probe.get('error', 'not probed')})")
        used = [k for k in units if k[0] == host]
        cards: dict = {}
        for _, index in used:
            card = info[index]["card"] if info and index < len(info) else f"u{index}"
            cards.setdefault(card, []).append(index)
        product = next((r.get("name", "") for r in records if r["host"] == host), "")
        fig = _shipped_figures(product)
        card_pkgs = []
        for card, members in cards.items():
            pid = f"{hid}.card{card}"
            ids = tuple(units[(host, i)] for i in members)
            card_pkgs.append(pid)
            stacks = info[members[0]].get("stacks", 0) if info and members[0] < len(info) else 0
            label = f"card {card}" + (f" ({stacks} stacks driven as one device)" if stacks > 1 else "")
            pkgs.append(Package(id=pid, devices=ids, host=host if len(host_id) > 1 else "", name=label))
            ref = fig.get("_device")
            for i, did in zip(members, ids):
                devs.append(Device(id=did, package=pid, kind="xpu", name=product,
                                   injection_gbps=ref.injection_gbps if ref else _PCIE[0],
                                   injection_source=ref.injection_source if ref else _PCIE[1]))
            if len(ids) > 1:
                mdfi = fig.get("mdfi")
                figures = ((mdfi.bandwidth_gbps, mdfi.bandwidth_source, mdfi.latency_us, mdfi.latency_source)
                           if mdfi else (150.0, "estimate: stack-to-stack link", 2.0, "estimate"))
                links.append(Link(f"mdfi-{pid}", "mdfi", ids, *figures))
        if len(card_pkgs) > 1:
            peer = probe.get("peer") or {}
            xelink = fig.get("xelink")
            # Cards reach each other over XeLink only where the driver grants peer access between them.
            firsts = [cards[c][0] for c in cards]
            all_peer = all(peer.get((min(a, b), max(a, b)), False) for i, a in enumerate(firsts) for b in firsts[i + 1:])
            if all_peer and xelink:
                links.append(Link(f"xelink-{hid}", "xelink", tuple(card_pkgs), xelink.bandwidth_gbps,
                                  xelink.bandwidth_source, xelink.latency_us, xelink.latency_source,
                                  xelink.per_device_gbps, xelink.per_device_source))
            else:
                links.append(Link(f"pcie-{hid}", "pcie", tuple(card_pkgs), *_PCIE))
    return _discovered("discovered-xpu", f"{len(units)} Intel GPU unit(s)", host_id, pkgs, devs, links, notes)


def _probe_dpctl() -> dict:
    """This host's Level Zero GPU units (as torch ``xpu`` numbers them) and the card each belongs to."""
    opencl_runtime_default()  # (dpctl reads it once, as it loads: the CPU runtime stays visible to xelink.sycl)
    try:
        import dpctl  # optional: the sycl extra
    except ImportError:
        return {"source": None, "error": "dpctl is not installed (pip install xelink[sycl])"}
    dpctl_errors = tuple({ValueError, RuntimeError, getattr(dpctl, "SyclDeviceCreationError", RuntimeError),
                          getattr(dpctl, "SyclSubDeviceCreationError", RuntimeError)})
    try:
        devices = dpctl.get_devices(backend="level_zero", device_type="gpu")
    except dpctl_errors as exc:
        return {"source": None, "error": f"dpctl found no Level Zero GPU ({exc})"}
    if not devices:
        return {"source": None, "error": "dpctl sees no Level Zero GPU"}
    units, cards = [], {}
    for d in devices:
        # FLAT hierarchy (the default): each stack is a device and its composite device is the card.
        # COMPOSITE: the device is the card, and its stacks are sub-devices one rank drives together.
        composite = getattr(d, "composite_device", None)
        key = composite.filter_string if composite is not None else d.filter_string
        card = cards.setdefault(key, len(cards))
        try:
            stacks = len(d.create_sub_devices(partition="next_partitionable"))
        except dpctl_errors:
            stacks = 0
        units.append({"name": d.name, "card": card, "stacks": stacks})
    peer = {}
    for i, a in enumerate(devices):
        for j in range(i + 1, len(devices)):
            try:
                peer[(i, j)] = bool(a.can_access_peer(devices[j]))
            except (AttributeError, ValueError, TypeError):
                peer[(i, j)] = False
    return {"source": "dpctl", "units": units, "peer": peer}


def discover(comm) -> Topology:
    """The topology of the running job, from what every rank can see.

    - CPU ranks: one package per host (``comm.hosts``), a ``shm`` link inside each host, a ``network``
      link between hosts; figures are estimates.
    - NVIDIA: GPUs driven by the ranks, grouped into NVLink islands per host from NVML (nvidia-ml-py)
      or ``nvidia-smi topo -m``; PCIe between islands, a network between hosts. Without NVML and
      nvidia-smi every GPU is its own package and the description says why.
    - Intel: dpctl's Level Zero devices grouped into cards; without dpctl every unit is its own package
      and the description says why.

    Devices are listed in the order of the first rank that drives them, so ``place(topology, comm.size,
    ranks_per_device)`` reproduces the binding when ranks fill devices in order (the default of mpiexec
    and torchrun); otherwise pass ``place(..., devices=...)``.

    Returns:
        A validated ``Topology`` (``dumps`` saves it).

    Collective: every rank of ``comm`` must call this.
    """
    kind = getattr(comm.device, "type", "cpu")
    local_first = comm.local_rank == 0
    if kind == "cuda":
        import torch

        index = comm.device.index or 0
        props = torch.cuda.get_device_properties(index)
        rec = {"host": comm.host, "uuid": _uuid(getattr(props, "uuid", f"cuda{index}")), "name": props.name}
        probe = _probe_nvlink() if local_first else None
    elif kind == "xpu":
        import torch

        index = comm.device.index or 0
        rec = {"host": comm.host, "index": index, "name": torch.xpu.get_device_name(index)}
        probe = _probe_dpctl() if local_first else None
    else:
        rec, probe = {"host": comm.host}, None
    got = comm.allgather_object((rec, probe))
    records = [r for r, _ in got]
    probes = {r["host"]: p for r, p in got if p is not None}
    if kind == "cuda":
        if any(p.get("source") is None for p in probes.values()):
            _log.warning("discover: NVLink topology unknown on some host; each GPU is its own package")
        return build_cuda_topology(records, probes)
    if kind == "xpu":
        if any(p.get("source") is None for p in probes.values()):
            _log.warning("discover: Intel card layout unknown (dpctl missing?); each unit is its own package")
        return build_xpu_topology(records, probes)
    return build_cpu_topology([r["host"] for r in records])


def from_env_or_discover(comm, env: Mapping[str, str] | None = None) -> Topology:
    """``load($XELINK_TOPOLOGY)`` when that variable is set (a shipped name or a path), else ``discover(comm)``.

    This is the one place xelink reads ``XELINK_TOPOLOGY``. Every rank must see the same value (as
    launchers arrange).

    Collective when it discovers: every rank of ``comm`` must call this.
    """
    value = (os.environ if env is None else env).get(ENV_VAR, "").strip()
    if value:
        try:
            return load(value)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{ENV_VAR}={value!r}: {exc}") from None
    return discover(comm)
