"""Topology descriptions: shipped files, validation errors, TOML round trip, placement and groups, discovery."""
import sys
import types
from pathlib import Path

import pytest

from xelink import topology as T
from xelink.errors import ConfigError

SHIPPED = ["cpu-2x2", "intel-arc-b60x4", "intel-max-1550x6", "nvidia-h200x2", "nvidia-h200x8", "two-hosts-4gpu"]

# A small valid description; the broken ones below are edits of it.
GOOD = """\
name = "small"
description = "2 packages x 2 devices"
package_size = 2

[device_defaults]
kind = "cpu"
injection_gbps = 10.0
injection_source = "estimate"

[[packages]]
id = "p0"
devices = ["d0", "d1"]

[[packages]]
id = "p1"
devices = ["d2", "d3"]

[[links]]
name = "local0"
kind = "shm"
joins = ["d0", "d1"]
bandwidth_gbps = 10.0
bandwidth_source = "estimate"
latency_us = 1.0
latency_source = "estimate"

[[links]]
name = "local1"
kind = "shm"
joins = ["d2", "d3"]
bandwidth_gbps = 10.0
bandwidth_source = "estimate"
latency_us = 1.0
latency_source = "estimate"

[[links]]
name = "fabric"
kind = "net"
joins = ["p0", "p1"]
bandwidth_gbps = 5.0
bandwidth_source = "datasheet: made up for the test"
latency_us = 4.0
latency_source = "estimate"
"""


def _write(tmp_path: Path, text: str, name: str = "machine.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _sizes_topology(sizes) -> T.Topology:
    """Packages of the given sizes; devices of a package over 'shm', packages over one 'fabric' link."""
    lines = ['name = "shape"', "", "[device_defaults]", 'kind = "cpu"', "injection_gbps = 10.0",
             'injection_source = "estimate"', ""]
    k = 0
    for p, n in enumerate(sizes):
        devs = [f"d{k + i}" for i in range(n)]
        k += n
        lines += ["[[packages]]", f'id = "p{p}"', f"devices = {devs!r}".replace("'", '"'), ""]
        if n > 1:
            lines += ["[[links]]", f'name = "shm{p}"', 'kind = "shm"', f"joins = {devs!r}".replace("'", '"'),
                      "bandwidth_gbps = 10.0", 'bandwidth_source = "estimate"', "latency_us = 1.0",
                      'latency_source = "estimate"', ""]
    if len(sizes) > 1:
        pk = [f"p{p}" for p in range(len(sizes))]
        lines += ["[[links]]", 'name = "fabric"', 'kind = "net"', f"joins = {pk!r}".replace("'", '"'),
                  "bandwidth_gbps = 5.0", 'bandwidth_source = "estimate"', "latency_us = 2.0",
                  'latency_source = "estimate"']
    return T.loads("\n".join(lines), path="shape.toml")


# ---------------------------------------------------------------------------------------------
# Shipped files


def test_available_lists_the_shipped_files():
    assert T.available() == SHIPPED
    on_disk = sorted(p.stem for p in (Path(T.__file__).parent / "topologies").glob("*.toml"))
    assert on_disk == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_topology_loads_validates_and_round_trips(name):
    t = T.load(name)
    assert t.name == name
    assert T.validate(t) == t
    again = T.loads(T.dumps(t))
    assert again == t
    assert T.dumps(again) == T.dumps(t)
    for d in t.devices:
        assert d.injection_gbps > 0 and d.injection_source.split(":")[0] in T.SOURCE_KINDS
    for link in t.links:
        assert link.bandwidth_source.split(":")[0] in T.SOURCE_KINDS
        assert link.latency_source.split(":")[0] in T.SOURCE_KINDS
    # every pair of devices has a route
    for a in t.devices:
        for b in t.devices:
            if a.id != b.id:
                assert t.route(a.id, b.id)[0] in t.links


def test_shipped_shapes():
    intel = T.load("intel-max-1550x6")
    assert len(intel.devices) == 12 and len(intel.packages) == 6
    assert all(len(p.devices) == 2 for p in intel.packages)
    assert intel.route("xpu0", "xpu1")[0].kind == "mdfi"
    link, a, b = intel.route("xpu1", "xpu2")
    assert (link.kind, a, b) == ("xelink", "card0", "card1")
    assert link.per_device_gbps == 19.0 and link.per_device_source.startswith("paper")
    h2 = T.load("nvidia-h200x2")
    assert h2.link("nvlink").bandwidth_gbps == 390.0
    assert h2.link("nvlink").bandwidth_source.startswith("measured here")
    assert len(T.load("nvidia-h200x8").packages) == 1
    two = T.load("two-hosts-4gpu")
    assert two.hosts == ["host-a", "host-b"]
    link, a, b = two.route("a.gpu1", "b.gpu2")
    assert (link.kind, a, b) == ("network", "host-a", "host-b")
    assert [len(p.devices) for p in T.load("intel-arc-b60x4").packages] == [1, 1, 1, 1]
    assert [p.devices for p in T.load("cpu-2x2").packages] == [("cpu0", "cpu1"), ("cpu2", "cpu3")]


def test_load_by_path_and_unknown_names(tmp_path):
    path = _write(tmp_path, GOOD)
    t = T.load(path)
    assert t.name == "small" and t.path == str(path)
    assert T.load(str(path)) == t
    with pytest.raises(ValueError, match=r"load: unknown topology 'nope'; shipped: cpu-2x2, .*intel-max-1550x6"):
        T.load("nope")
    with pytest.raises(ValueError, match=r"load: topology file '.*missing.toml' does not exist"):
        T.load(str(tmp_path / "missing.toml"))
    with pytest.raises(TypeError, match=r"load: name_or_path=3 must be a topology name or a path"):
        T.load(3)


def test_reading_toml_needs_tomllib_or_tomli(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ImportError, match=r"Python 3.11\+ \(tomllib\) or, on Python 3.10, the 'tomli' package"):
        T.load(_write(tmp_path, GOOD))


# ---------------------------------------------------------------------------------------------
# Broken descriptions


BROKEN = [
    # (edit of GOOD, exception type, message pattern)
    (lambda s: s.replace('joins = ["d0", "d1"]', 'joins = ["d0", "d9"]'),
     ValueError, r"link 'local0' joins unknown device, package or host 'd9'"),
    (lambda s: s[:s.index('[[links]]\nname = "fabric"')],
     ValueError, r"missing link: packages 'p0' and 'p1' are joined by no link \(devices 'd0' and 'd2'"),
    (lambda s: s.replace('[[links]]\nname = "local1"', '[[links]]\nname = "local1"\nkind = "x"', 1)
     .replace('kind = "x"\nkind = "shm"\njoins = ["d2", "d3"]', 'kind = "shm"\njoins = ["p0", "p1"]'),
     ValueError, r"packages 'p0' and 'p1' are joined by both link 'local1' and link 'fabric'"),
    (lambda s: s.replace('name = "local1"\nkind = "shm"\njoins = ["d2", "d3"]',
                         'name = "local1"\nkind = "shm"\njoins = ["d0", "d1"]'),
     ValueError, r"devices 'd0' and 'd1' are joined by both link 'local0' and link 'local1'"),
    (lambda s: s.replace("bandwidth_gbps = 5.0", "bandwidth_gbps = 0"),
     ValueError, r"link 'fabric' bandwidth_gbps=0.0 must be a positive, finite number"),
    (lambda s: s.replace("bandwidth_gbps = 5.0", "bandwidth_gbps = -5.0"),
     ValueError, r"link 'fabric' bandwidth_gbps=-5.0 must be a positive, finite number"),
    (lambda s: s.replace("latency_us = 4.0", "latency_us = -1"),
     ValueError, r"link 'fabric' latency_us=-1.0 must be a positive, finite number"),
    (lambda s: s.replace("latency_us = 4.0", "latency_us = 0.0"),
     ValueError, r"link 'fabric' latency_us=0.0 must be a positive, finite number"),
    (lambda s: s.replace("bandwidth_gbps = 5.0", "bandwidth_gbps = inf"),
     ValueError, r"link 'fabric' bandwidth_gbps=inf must be a positive, finite number"),
    (lambda s: s.replace("injection_gbps = 10.0", "injection_gbps = 0.0"),
     ValueError, r"device 'd0' injection_gbps=0.0 must be a positive, finite number"),
    (lambda s: s.replace('devices = ["d2", "d3"]', 'devices = ["d2", "d3", "d4"]'),
     ValueError, r"package 'p1' has 3 device\(s\) but package_size=2 \(inconsistent package sizes\)"),
    (lambda s: s.replace('id = "p1"\n', 'id = "p1"\nsize = 3\n'),
     ValueError, r"package 'p1' declares size=3 but lists 2 device\(s\)"),
    (lambda s: s.replace('devices = ["d2", "d3"]', 'devices = ["d2", "d1"]'),
     ValueError, r"device 'd1' is listed in both package 'p0' and package 'p1'"),
    (lambda s: s.replace('id = "p1"', 'id = "p0"'),
     ValueError, r"duplicate id 'p0': used by package 'p0' and by package 'p0'"),
    (lambda s: s.replace('id = "p1"', 'id = "d0"'),
     ValueError, r"duplicate id 'd0': used by package 'd0' and by device 'd0'"),
    (lambda s: s.replace('name = "local1"', 'name = "local0"'),
     ValueError, r"duplicate link name 'local0'"),
    (lambda s: s.replace('bandwidth_source = "datasheet: made up for the test"', 'bandwidth_source = "vendor"'),
     ValueError, r"link 'fabric' bandwidth_source='vendor' must be one of 'measured here', 'datasheet', "
                 r"'paper', 'estimate'"),
    (lambda s: s.replace('bandwidth_source = "datasheet: made up for the test"\n', ''),
     ValueError, r"link 'fabric' has no 'bandwidth_source'"),
    (lambda s: s.replace("bandwidth_gbps = 5.0", 'bandwidth_gbps = "fast"'),
     TypeError, r"link 'fabric' bandwidth_gbps='fast' must be a number"),
    (lambda s: s.replace("bandwidth_gbps = 5.0", "bandwith_gbps = 5.0"),
     ValueError, r"unknown key 'bandwith_gbps' in link #2"),
    (lambda s: s.replace('kind = "cpu"', 'kind = "tpu"'),
     ValueError, r"device 'd0' kind='tpu' must be one of cpu, cuda, xpu"),
    (lambda s: s.replace('joins = ["p0", "p1"]', 'joins = ["p0", "d2"]'),
     ValueError, r"link 'fabric' mixes levels \(device, package\)"),
    (lambda s: s.replace('joins = ["p0", "p1"]', 'joins = ["p0"]'),
     ValueError, r"link 'fabric' joins \['p0'\]: a link needs at least two endpoints"),
    (lambda s: s.replace('joins = ["p0", "p1"]', 'joins = ["p0", "p0"]'),
     ValueError, r"link 'fabric' lists an endpoint twice"),
    (lambda s: s.replace('[[links]]\nname = "local1"\nkind = "shm"\njoins = ["d2", "d3"]',
                         '[[links]]\nname = "local1"\nkind = "shm"\njoins = ["d0", "d2"]'),
     ValueError, r"missing link: devices 'd2' and 'd3' of package 'p1' are joined by no link"),
    (lambda s: s.replace('id = "p0"\n', 'id = "p0"\nhost = "h0"\n'),
     ValueError, r"package 'p1' names no host, but other packages do"),
    (lambda s: s + '\n[[devices]]\nid = "d7"\ninjection_gbps = 3.0\n',
     ValueError, r"device 'd7' is described in \[\[devices\]\] but listed in no package"),
    (lambda s: s.replace('name = "small"', 'name = "small"\nname = "again"'),
     ValueError, r"not valid TOML"),
    (lambda s: s.replace('package_size = 2', 'package_size = "two"'),
     TypeError, r"the file package_size='two' must be an integer"),
]


@pytest.mark.parametrize("edit, exc, pattern", BROKEN)
def test_broken_descriptions_are_rejected_naming_the_file_and_problem(tmp_path, edit, exc, pattern):
    text = edit(GOOD)
    assert text != GOOD
    path = _write(tmp_path, text, "broken.toml")
    with pytest.raises(ConfigError, match=r"^load: .*broken\.toml: " + pattern):  # a file's problem is a
        T.load(path)  # setting's, a ValueError whatever its kind (the command line prints it as one line)
    with pytest.raises(exc, match=r"^loads: <string>: " + pattern) as info:  # text: the argument's problem
        T.loads(text)
    assert type(info.value) is exc


def test_good_description_is_accepted(tmp_path):
    t = T.load(_write(tmp_path, GOOD))
    assert [d.id for d in t.devices] == ["d0", "d1", "d2", "d3"]
    assert t.device("d2").package == "p1"
    assert t.route("d1", "d3")[1:] == ("p0", "p1")


def test_validate_names_the_topology_without_a_file():
    t = T.loads(GOOD)
    bad = T.Topology(name="handmade", description="", packages=t.packages, devices=t.devices,
                     links=t.links[:2], package_size=2)
    with pytest.raises(ValueError, match=r"^validate: topology 'handmade': missing link: packages 'p0' and 'p1'"):
        T.validate(bad)
    with pytest.raises(TypeError, match=r"validate: topology='x' is not a Topology"):
        T.validate("x")


# ---------------------------------------------------------------------------------------------
# TOML writing


def test_dumps_round_trips_awkward_strings(tmp_path):
    t = T.loads(GOOD)
    odd = 'quote " backslash \\ tab \t newline \n unicode µs \x01 end'
    t2 = T.Topology(name="odd", description=odd, packages=t.packages, devices=t.devices, links=t.links,
                    package_size=2)
    text = T.dumps(t2)
    back = T.loads(text)
    assert back == t2 and back.description == odd
    T.save(t2, tmp_path / "odd.toml")
    assert T.load(tmp_path / "odd.toml") == t2


def test_dumps_writes_every_device_explicitly():
    text = T.dumps(T.loads(GOOD))
    assert "[device_defaults]" not in text
    assert text.count("[[devices]]") == 4
    assert 'bandwidth_source = "datasheet: made up for the test"' in text


# ---------------------------------------------------------------------------------------------
# Placement and groups


def _groups(p: T.Placement):
    n = p.nranks
    return (T.packages(p), [T.package_of(p, r) for r in range(n)], [T.local_index(p, r) for r in range(n)],
            [T.cross_peers(p, r) for r in range(n)])


def test_flat_placement():
    p = T.place(T.load("nvidia-h200x8"), 8)
    assert p.devices == tuple(f"gpu{i}" for i in range(8))
    pk, of, li, cross = _groups(p)
    assert pk == [list(range(8))]
    assert of == [0] * 8 and li == list(range(8)) and cross == [[]] * 8


def test_2x2_placement():
    p = T.place(T.load("cpu-2x2"), 4)
    assert _groups(p) == ([[0, 1], [2, 3]], [0, 0, 1, 1], [0, 1, 0, 1], [[2], [3], [0], [1]])


def test_3x2_and_4x2_placement():
    p = T.place(_sizes_topology([2, 2, 2]), 6)
    assert _groups(p) == ([[0, 1], [2, 3], [4, 5]], [0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 0, 1],
                          [[2, 4], [3, 5], [0, 4], [1, 5], [0, 2], [1, 3]])
    p = T.place(_sizes_topology([2, 2, 2, 2]), 8)
    pk, of, li, cross = _groups(p)
    assert pk == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cross[0] == [2, 4, 6] and cross[7] == [1, 3, 5]
    p = T.place(T.load("intel-max-1550x6"), 12)
    assert T.cross_peers(p, 3) == [1, 5, 7, 9, 11]


def test_uneven_3_plus_2_placement():
    p = T.place(_sizes_topology([3, 2]), 5)
    pk, of, li, cross = _groups(p)
    assert pk == [[0, 1, 2], [3, 4]]
    assert of == [0, 0, 0, 1, 1] and li == [0, 1, 2, 0, 1]
    # local index 2 does not exist in the 2-rank package: rank 2 has no cross peer there
    assert cross == [[3], [4], [], [0], [1]]


def test_partial_fill_and_ranks_per_device():
    t = T.load("cpu-2x2")
    assert _groups(T.place(t, 3))[0] == [[0, 1], [2]]
    assert _groups(T.place(t, 1))[0] == [[0]]
    p = T.place(t, 8, ranks_per_device=2)
    assert p.devices == ("cpu0", "cpu0", "cpu1", "cpu1", "cpu2", "cpu2", "cpu3", "cpu3")
    assert T.packages(p) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert T.cross_peers(p, 1) == [5]


def test_explicit_devices_per_rank():
    t = T.load("cpu-2x2")
    p = T.place(t, 4, devices=["cpu0", "cpu2", "cpu1", "cpu3"])
    assert T.packages(p) == [[0, 2], [1, 3]]
    assert T.cross_peers(p, 0) == [1]
    with pytest.raises(ValueError, match=r"place: device 'cpu9' is not in cpu-2x2.toml"):
        T.place(t, 1, devices=["cpu9"])
    with pytest.raises(ValueError, match=r"place: 2 ranks on device 'cpu0' but ranks_per_device=1"):
        T.place(t, 2, devices=["cpu0", "cpu0"])
    with pytest.raises(ValueError, match=r"place: devices lists 1 device\(s\) for nranks=2"):
        T.place(t, 2, devices=["cpu0"])


def test_placement_errors():
    t = T.load("cpu-2x2")
    with pytest.raises(ValueError, match=r"place: 5 ranks but topology 'cpu-2x2' has 4 device\(s\) and "
                                         r"ranks_per_device=1 \(at most 4 ranks\)"):
        T.place(t, 5)
    with pytest.raises(ValueError, match=r"place: 9 ranks .* ranks_per_device=2 \(at most 8 ranks\)"):
        T.place(t, 9, ranks_per_device=2)
    with pytest.raises(ValueError, match=r"place: nranks=0 must be >= 1"):
        T.place(t, 0)
    with pytest.raises(TypeError, match=r"place: nranks='4' must be an int"):
        T.place(t, "4")
    with pytest.raises(TypeError, match=r"place: topology='cpu-2x2' is not a Topology"):
        T.place("cpu-2x2", 4)
    p = T.place(t, 4)
    with pytest.raises(ValueError, match=r"package_of: rank=4 is out of range for a placement of 4 rank\(s\)"):
        T.package_of(p, 4)
    with pytest.raises(TypeError, match=r"cross_peers: rank=1.0 must be an int"):
        T.cross_peers(p, 1.0)
    with pytest.raises(TypeError, match=r"packages: placement=4 is not a Placement"):
        T.packages(4)


# ---------------------------------------------------------------------------------------------
# Discovery (pure builders, the nvidia-smi parser, NVML through a stand-in module)

# Mimics `nvidia-smi topo -m` on a 2 x H200 machine: GPU matrix, NIC columns, affinity columns, legend.
SMI_2GPU = """\
\t\x1b[4mGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tPXB\tSYS\t0-47,96-143\t0\t\tN/A
GPU1\tNV18\t X \tSYS\tPXB\t48-95,144-191\t1\t\tN/A
NIC0\tPXB\tSYS\t X \tSYS\t\t\t\t
NIC1\tSYS\tPXB\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""

SMI_4GPU_MIXED = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV4     SYS     SYS     0-15            0
GPU1    NV4      X      SYS     SYS     0-15            0
GPU2    SYS     SYS      X      NV4     16-31           1
GPU3    SYS     SYS     NV4      X      16-31           1
"""


def test_parse_nvidia_smi_topo_two_gpus_nv18():
    got = T.parse_nvidia_smi_topo(SMI_2GPU)
    assert got["gpus"] == ["GPU0", "GPU1"]
    assert got["nvlink"] == {(0, 1): 18}
    assert got["paths"] == {(0, 1): "NV18"}


def test_parse_nvidia_smi_topo_islands():
    got = T.parse_nvidia_smi_topo(SMI_4GPU_MIXED)
    assert got["nvlink"] == {(0, 1): 4, (2, 3): 4}
    assert got["paths"][(0, 2)] == "SYS"


def test_parse_nvidia_smi_topo_rejects_other_text():
    with pytest.raises(ValueError, match=r"parse_nvidia_smi_topo: no header row starting with GPU0"):
        T.parse_nvidia_smi_topo("No devices were found\n")
    with pytest.raises(ValueError, match=r"header names 2 GPU\(s\) but 1 GPU row\(s\) follow"):
        T.parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X \tNV18\n")
    with pytest.raises(TypeError, match=r"parse_nvidia_smi_topo: text must be a str"):
        T.parse_nvidia_smi_topo(b"GPU0")


def test_build_cuda_topology_from_the_parser():
    parsed = T.parse_nvidia_smi_topo(SMI_2GPU)
    uuids = {0: "GPU-aaa", 1: "GPU-bbb"}
    probe = {"source": "nvidia-smi topo -m",
             "nvlink": {(uuids[a], uuids[b]): n for (a, b), n in parsed["nvlink"].items()}}
    records = [{"host": "h", "uuid": "GPU-aaa", "name": "NVIDIA H200"},
               {"host": "h", "uuid": "GPU-bbb", "name": "NVIDIA H200"}]
    t = T.build_cuda_topology(records, {"h": probe})
    assert [p.devices for p in t.packages] == [("gpu0", "gpu1")]
    link = t.route("gpu0", "gpu1")[0]
    assert (link.kind, link.bandwidth_gbps) == ("nvlink", 450.0)
    assert "NV18" in link.bandwidth_source and link.bandwidth_source.startswith("estimate")
    assert T.loads(T.dumps(t)) == t
    assert [d.id for d in t.devices] == list(T.place(t, 2).devices)


def test_build_cuda_topology_islands_hosts_and_no_probe():
    parsed = T.parse_nvidia_smi_topo(SMI_4GPU_MIXED)
    u = [f"GPU-{i}" for i in range(4)]
    probe = {"source": "nvidia-smi topo -m", "nvlink": {(u[a], u[b]): n for (a, b), n in parsed["nvlink"].items()}}
    records = [{"host": "n1", "uuid": x, "name": "A"} for x in u] + [{"host": "n2", "uuid": "GPU-x", "name": "A"},
                                                                     {"host": "n2", "uuid": "GPU-y", "name": "A"}]
    t = T.build_cuda_topology(records, {"n1": probe, "n2": {"source": None, "error": "no nvidia-smi"}})
    assert [p.devices for p in t.packages] == [("gpu0", "gpu1"), ("gpu2", "gpu3"), ("gpu4",), ("gpu5",)]
    assert t.route("gpu0", "gpu1")[0].kind == "nvlink"
    assert t.route("gpu1", "gpu2")[0].kind == "pcie"
    assert t.route("gpu4", "gpu5")[0].kind == "pcie"
    assert t.route("gpu0", "gpu5")[0].kind == "network"
    assert "n2: NVLink unknown (no nvidia-smi)" in t.description
    t = T.build_cuda_topology(records[4:], {"n2": {"source": "NVML", "nvlink": {}}})
    assert "n2: NVML reports no NVLink between its GPUs" in t.description
    assert T.loads(T.dumps(t)) == t


def test_build_cpu_topology():
    t = T.build_cpu_topology(["a", "a", "b", "a"])
    assert [p.devices for p in t.packages] == [("rank0", "rank1", "rank3"), ("rank2",)]
    assert t.hosts == ["a", "b"]
    assert t.route("rank0", "rank3")[0].kind == "shm"
    assert t.route("rank0", "rank2")[1:] == ("a", "b")
    one = T.build_cpu_topology(["only"])
    assert len(one.devices) == 1 and one.links == ()
    assert T.loads(T.dumps(t)) == t


def test_build_xpu_topology_uses_shipped_figures_for_a_known_product():
    name = T.load("intel-max-1550x6").devices[0].name
    records = [{"host": "h", "index": i, "name": name} for i in range(4)]
    probe = {"source": "dpctl", "units": [{"name": name, "card": i // 2} for i in range(4)],
             "peer": {(a, b): True for a in range(4) for b in range(a + 1, 4)}}
    t = T.build_xpu_topology(records, {"h": probe})
    assert [p.devices for p in t.packages] == [("xpu0", "xpu1"), ("xpu2", "xpu3")]
    assert t.route("xpu0", "xpu1")[0].bandwidth_gbps == 152.0
    xe = t.route("xpu1", "xpu2")[0]
    assert (xe.kind, xe.bandwidth_gbps, xe.per_device_gbps) == ("xelink", 19.0, 19.0)
    # No dpctl: every unit is its own package, joined by PCIe, and the description says why.
    t = T.build_xpu_topology(records[:2], {"h": {"source": None, "error": "dpctl is not installed"}})
    assert len(t.packages) == 2 and t.route("xpu0", "xpu1")[0].kind == "pcie"
    assert "cards unknown (dpctl is not installed)" in t.description


def test_nvml_probe_counts_direct_and_switched_links(monkeypatch):
    # A stand-in for nvidia-ml-py: GPU0-GPU1 joined by 2 direct links, GPU2 and GPU3 on a switch. NVML
    # spells UUIDs "GPU-<hex>", torch "<hex>": discovery keeps torch's spelling so the two match.
    remotes = {0: ["b1", "b1"], 1: ["b0", "b0"], 2: ["sw", "sw", "sw"], 3: ["sw", "sw", "sw"]}
    pci = lambda bus: types.SimpleNamespace(busId=bus.encode())  # noqa: E731
    fake = types.SimpleNamespace(
        NVML_NVLINK_MAX_LINKS=4, NVML_FEATURE_ENABLED=1, NVMLError=RuntimeError,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetUUID=lambda h: f"GPU-{h}a".encode(),
        nvmlDeviceGetPciInfo=lambda h: pci(f"b{h}"),
        nvmlDeviceGetNvLinkState=lambda h, l: 1 if l < len(remotes[h]) else 0,
        nvmlDeviceGetNvLinkRemotePciInfo=lambda h, l: pci(remotes[h][l]))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    got = T._probe_nvlink()
    assert got == {"source": "NVML", "nvlink": {("0a", "1a"): 2, ("2a", "3a"): 3}}


def test_from_env_or_discover_prefers_the_variable(tmp_path):
    assert T.from_env_or_discover(None, env={"XELINK_TOPOLOGY": "cpu-2x2"}) == T.load("cpu-2x2")
    path = _write(tmp_path, GOOD)
    assert T.from_env_or_discover(None, env={"XELINK_TOPOLOGY": str(path)}).name == "small"
    with pytest.raises(ValueError, match=r"^XELINK_TOPOLOGY='nope': load: unknown topology 'nope'"):
        T.from_env_or_discover(None, env={"XELINK_TOPOLOGY": "nope"})


def test_describe_lists_devices_packages_links_and_sources():
    text = T.describe(T.load("intel-max-1550x6"))
    assert "12 device(s) in 6 package(s)" in text
    assert "xelink  xelink  card0, card1, card2, card3, card4, card5  19" in text
    assert "per-device: paper: reference link model" in text


class _FakeSycl:
    """Stands in for a dpctl.SyclDevice."""

    def __init__(self, name, filter_string, composite=None, stacks=0):
        self.name, self.filter_string, self.composite_device, self._stacks = name, filter_string, composite, stacks

    def create_sub_devices(self, partition):
        if not self._stacks:
            raise ValueError("not partitionable")
        return [object()] * self._stacks

    def can_access_peer(self, other):
        return True


def test_dpctl_probe_flat_and_composite(monkeypatch):
    name = "Intel(R) Data Center GPU Max 1550"
    cards = [_FakeSycl(name, f"level_zero:gpu:c{i}") for i in range(2)]
    flat = [_FakeSycl(name, f"level_zero:gpu:{i}", composite=cards[i // 2]) for i in range(4)]
    monkeypatch.setitem(sys.modules, "dpctl", types.SimpleNamespace(get_devices=lambda **kw: flat))
    probe = T._probe_dpctl()
    assert [u["card"] for u in probe["units"]] == [0, 0, 1, 1]
    records = [{"host": "h", "index": i, "name": name} for i in range(4)]
    t = T.build_xpu_topology(records, {"h": probe})
    assert [p.devices for p in t.packages] == [("xpu0", "xpu1"), ("xpu2", "xpu3")]
    assert t.route("xpu1", "xpu2")[0].kind == "xelink"
    # COMPOSITE hierarchy: each device is a whole card with 2 stacks as sub-devices.
    composite = [_FakeSycl(name, f"level_zero:gpu:{i}", stacks=2) for i in range(2)]
    monkeypatch.setitem(sys.modules, "dpctl", types.SimpleNamespace(get_devices=lambda **kw: composite))
    probe = T._probe_dpctl()
    t = T.build_xpu_topology(records[:2], {"h": probe})
    assert [p.name for p in t.packages] == ["card 0 (2 stacks driven as one device)",
                                           "card 1 (2 stacks driven as one device)"]
    monkeypatch.setitem(sys.modules, "dpctl", None)
    assert T._probe_dpctl() == {"source": None, "error": "dpctl is not installed (pip install xelink[sycl])"}
