"""algo="auto": a measured tuning table of this machine wins; one of another machine is ignored."""
import json
import socket

import torch

import xelink
from xelink import topology as T
from xelink.tuning import fingerprint
from xelink.collectives.dispatch import choose


def _here():
    """The fingerprint xelink.init gives this one-process CPU job (the discovered topology, placed)."""
    hosts = [socket.gethostname()]
    topo = T.build_cpu_topology(hosts)
    return fingerprint(topo.name, hosts, T.place(topo, 1))


def _table(path, fp):
    path.write_text(json.dumps({
        "format": "xelink-tuning", "version": 1, "fingerprint": fp,
        "entries": [{"op": "all_reduce", "dtype": "float32",
                     "ranges": [[0, 4096, "xelink:two_shot"], [4096, None, "xelink:hierarchical"]]}]}))


def test_auto_follows_the_matching_tuning_table(tmp_path, monkeypatch):
    _table(tmp_path / "here.tuning.json", _here())
    monkeypatch.setenv("XELINK_TUNING", str(tmp_path))
    world = xelink.init()
    try:
        assert choose(world, "all_reduce", 1000, torch.float32) == "two_shot"
        assert choose(world, "all_reduce", 1 << 20, torch.float32) == "hierarchical"
        # Not in the table (another dtype): the cost model decides, among xelink's own algorithms.
        assert choose(world, "all_reduce", 1000, torch.float64) in xelink.collectives.ALGORITHMS["all_reduce"]
    finally:
        xelink.finalize()


def test_auto_ignores_a_table_of_another_machine(tmp_path, monkeypatch):
    _table(tmp_path / "other.tuning.json", fingerprint("nvidia-h200x8", ["gpu-node"] * 8))
    # The fingerprint of xelink before it named devices and links: the same topology name and rank count,
    # but it cannot tell this machine from another of that name (a 2-GPU host from 2 ranks on one GPU).
    _table(tmp_path / "coarse.tuning.json", fingerprint("discovered-cpu", [socket.gethostname()]))
    monkeypatch.setenv("XELINK_TUNING", str(tmp_path))
    world = xelink.init()
    try:
        from xelink.tuning import active

        assert active() is None
        assert choose(world, "all_reduce", 1000, torch.float32) in xelink.collectives.ALGORITHMS["all_reduce"]
    finally:
        xelink.finalize()


def test_auto_takes_xelinks_fastest_where_the_tables_winner_is_a_baseline_it_cannot_run(tmp_path, monkeypatch):
    """On CPU ranks MPI's own collective can win a range but cannot be dispatched to: the table's own entry
    (tuning.OWN) names xelink's fastest there, not the cost model's guess."""
    fp = _here()
    (tmp_path / "here.tuning.json").write_text(json.dumps({
        "format": "xelink-tuning", "version": 1, "fingerprint": fp,
        "entries": [{"op": "all_reduce", "dtype": "float32",
                     "ranges": [[0, 4096, "xelink:ring"], [4096, None, "baseline:mpi"]]},
                    {"op": "all_reduce/xelink", "dtype": "float32",
                     "ranges": [[0, 4096, "xelink:ring"], [4096, None, "xelink:two_shot"]]}]}))
    monkeypatch.setenv("XELINK_TUNING", str(tmp_path))
    world = xelink.init()
    try:
        assert choose(world, "all_reduce", 1000, torch.float32) == "ring"
        assert choose(world, "all_reduce", 1 << 20, torch.float32) == "two_shot"
    finally:
        xelink.finalize()


def test_auto_honours_a_table_edge_inside_a_power_of_two_class(tmp_path, monkeypatch):
    """A sweep at non-power-of-two sizes puts a range edge inside a size class: sizes on either side of it
    get their own range's path in any call order (the class cache would give the first one's to both)."""
    fp = _here()
    (tmp_path / "here.tuning.json").write_text(json.dumps({
        "format": "xelink-tuning", "version": 1, "fingerprint": fp,
        "entries": [{"op": "all_reduce", "dtype": "float32",
                     "ranges": [[0, 3000, "xelink:ring"], [3000, None, "xelink:two_shot"]]}]}))
    monkeypatch.setenv("XELINK_TUNING", str(tmp_path))
    world = xelink.init()
    try:
        sizes = [2048, 3500, 2999, 3000, 4095, 2049, 1 << 20, 100]
        want = ["ring", "two_shot", "ring", "two_shot", "two_shot", "ring", "two_shot", "ring"]
        assert [choose(world, "all_reduce", n, torch.float32) for n in sizes] == want
        assert [choose(world, "all_reduce", n, torch.float32) for n in reversed(sizes)] == want[::-1]
    finally:
        xelink.finalize()
