"""algo="auto": a measured tuning table of this machine wins; one of another machine is ignored."""
import json
import socket

import pytest
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


def test_auto_prices_with_a_measured_calibration_else_the_backends_software_terms(tmp_path, monkeypatch):
    """The cost model behind auto adds software per call, step and message: XELINK_CALIBRATION's file where
    it is set (``xelink bench links --calibration-out``), else cost.SOFTWARE's estimate for CPU ranks; without
    either a step would cost only link latency and bytes."""
    from xelink import cost

    seen = []
    real = cost.best
    monkeypatch.setattr(cost, "best", lambda *a: seen.append(a[5]) or real(*a))
    path = tmp_path / "here.toml"
    path.write_text(cost.dumps_calibration(cost.Calibration(name="measured-here", step_us=7.0,
                                                                sources={"step_us": "measured here: a test"})))
    for env, want in ((None, cost.SOFTWARE["cpu"]), (str(path), "measured-here")):
        if env is None:
            monkeypatch.delenv("XELINK_CALIBRATION", raising=False)
        else:
            monkeypatch.setenv("XELINK_CALIBRATION", env)
        world = xelink.init()
        try:
            choose(world, "all_reduce", 12345, torch.float64)
        finally:
            xelink.finalize()
        got = seen[-1]
        assert (got is want) if env is None else (got.name == want and got.step_us == 7.0), got
        assert cost.active_calibration() is None  # finalize drops it


def test_a_bad_calibration_file_fails_init_by_name(tmp_path, monkeypatch):
    """A missing file, a bad value, or a calibration of another machine (a device this topology lacks, which
    auto's first call refused, after init had passed) fail init, naming the variable and the cause."""
    from xelink import cost

    bad = tmp_path / "bad.toml"
    bad.write_text("step_us = 'fast'\n")
    other = tmp_path / "other.toml"
    other.write_text(cost.dumps_calibration(cost.Calibration(
        name="another-box", devices={"gpu7": cost.DeviceLocal(copy_gbps=900.0)},
        sources={"gpu7.copy_gbps": "measured elsewhere"})))
    for path, why in ((tmp_path / "missing.toml", "does not exist"), (bad, "no .name."), (other, "device 'gpu7'")):
        monkeypatch.setenv("XELINK_CALIBRATION", str(path))
        with pytest.raises(xelink.errors.LaunchError, match=rf"init: XELINK_CALIBRATION=.*{why}"):
            xelink.init()
        assert not xelink.is_initialized()


def test_the_cpu_software_terms_keep_auto_on_direct_for_small_all_reduces():
    """4 ranks of one host: with cost.SOFTWARE's terms the model keeps the one-shot all-reduce to 64 KiB (on the
    2-core CI host 3.5-4.6x faster than two_shot at 16-64 KiB); link latency and bytes alone chose two_shot
    from 16 KiB."""
    from xelink import cost

    topo = T.build_cpu_topology([socket.gethostname()] * 4)
    placement = T.place(topo, 4)
    cal = cost.SOFTWARE["cpu"]
    assert [cost.best(topo, placement, "all_reduce", n, None, cal) for n in (1 << 10, 16 << 10, 64 << 10)] == \
        ["direct"] * 3
    assert cost.best(topo, placement, "all_reduce", 16 << 10) == "two_shot"
    assert cost.best(topo, placement, "all_reduce", 4 << 20, None, cal) == "two_shot"


def test_an_oversubscribed_host_keeps_auto_on_direct_longer():
    """More ranks than cores: a rank waits for its peers to be scheduled, so cost.oversubscribed scales the software
    terms (a step by the ranks per core, a message by its square: the 4-rank probe on 2 cores measured 5.0 / 8.8 us
    against 2.6 / 2.3 on 2 ranks). On 4 ranks at 2 a core auto then keeps the one-shot all-reduce at 256 KiB (2.4x
    faster than two_shot there on the 2-core CI host), on 8 at 4 a core to 1 MiB; larger sizes stay two_shot."""
    from xelink import cost

    soft = cost.SOFTWARE["cpu"]
    assert cost.oversubscribed(soft, 1.0) is soft and cost.oversubscribed(soft, 0.5) is soft  # a core or more a rank
    for bad in (0, -2.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match=r"oversubscribed: ratio=.* must be a finite number > 0"):
            cost.oversubscribed(soft, bad)
    with pytest.raises(TypeError, match=r"oversubscribed: cal=None is not a Calibration"):
        cost.oversubscribed(None, 2.0)
    two = cost.oversubscribed(soft, 2.0)
    assert (two.call_us, two.step_us, two.message_us) == (soft.call_us, 2 * soft.step_us, 4 * soft.message_us)
    host = socket.gethostname()
    for n, ratio, direct_to, two_shot_from in ((4, 2.0, 256 << 10, 1 << 20), (8, 4.0, 1 << 20, 4 << 20)):
        topo = T.build_cpu_topology([host] * n)
        placement = T.place(topo, n)
        cal = cost.oversubscribed(soft, ratio)
        assert cost.best(topo, placement, "all_reduce", direct_to, None, cal) == "direct", n
        assert cost.best(topo, placement, "all_reduce", direct_to, None, soft) == "two_shot", n  # as before
        assert cost.best(topo, placement, "all_reduce", two_shot_from, None, cal) == "two_shot", n


def test_ranks_per_core_counts_the_cpus_a_hosts_ranks_may_use():
    from xelink import cost
    from xelink.runtime import ranks_per_core

    assert ranks_per_core([("a", (0, 1))] * 4) == 2.0  # unbound: every rank sees both cores
    assert ranks_per_core([("a", (0,)), ("a", (1,))]) == 1.0  # bound to a core each
    assert ranks_per_core([("a", (0,)), ("a", (0,))]) == 2.0  # bound to the same core
    assert ranks_per_core([("a", (0, 1, 2, 3)), ("b", (0,)), ("b", (0,)), ("b", (0,))]) == 3.0  # the busiest host
    assert ranks_per_core([("a", tuple(range(8)))]) == 1.0  # never below 1
    with pytest.raises(ValueError, match=r"set_active_oversubscription: ratio=0.5 must be >= 1"):
        cost.set_active_oversubscription(0.5)
    xelink.init()
    try:
        assert cost.active_oversubscription() == 1.0  # one process
    finally:
        xelink.finalize()
    assert cost.active_oversubscription() == 1.0
