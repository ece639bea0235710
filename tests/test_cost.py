"""The alpha-beta cost model: the Intel Max predictions, exact traffic and times, growth, bad inputs, CLI."""
import dataclasses
import importlib

import pytest

from xelink import cli, cost
from xelink import topology as T

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def intel():
    return T.load("intel-max-1550x6")


@pytest.fixture(scope="module")
def flat():
    return T.load("nvidia-h200x8")


def _chunks(n, k):
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _uneven():
    text = T.dumps(T.load("cpu-2x2")).replace('devices = ["cpu2", "cpu3"]', 'devices = ["cpu2", "cpu3", "cpu4"]')
    text = text.replace("package_size = 2\n", "")
    text += ('\n[[devices]]\nid = "cpu4"\nkind = "cpu"\ninjection_gbps = 8.0\ninjection_source = "estimate"\n'
             '\n[[links]]\nname = "shm1b"\nkind = "shm"\njoins = ["cpu2", "cpu4"]\nbandwidth_gbps = 8.0\n'
             'bandwidth_source = "estimate"\nlatency_us = 2.4\nlatency_source = "estimate"\n'
             '\n[[links]]\nname = "shm1c"\nkind = "shm"\njoins = ["cpu3", "cpu4"]\nbandwidth_gbps = 8.0\n'
             'bandwidth_source = "estimate"\nlatency_us = 2.4\nlatency_source = "estimate"\n')
    return T.loads(text)  # packages of 2 and 3 devices


# ---------------------------------------------------------------------------------------------
# What the issue asks the model to predict for 12 Intel Max stacks


@pytest.mark.parametrize("nbytes", [16 * MiB, 96 * MiB, GiB])
def test_intel_topology_aware_all_gather_beats_the_ring_for_large_messages(intel, nbytes):
    ring = cost.predict(intel, 12, "all_gather", "ring", nbytes)
    topo = cost.predict(intel, 12, "all_gather", "topo", nbytes)
    assert topo.time_s < ring.time_s
    # The ring's 11 steps each wait on a 19 GB/s XeLink hop (5 us); topo sends 5 shards through each
    # stack's 19 GB/s XeLink egress at once, then, as the implementation does, the 6 shards it holds (its
    # own and the 5 it received) over 152 GB/s MDFI (2 us).
    s = nbytes / 12
    assert ring.time_s == pytest.approx(11 * (5e-6 + s / 19e9), rel=1e-5)
    assert topo.time_s == pytest.approx(5e-6 + 5 * s / 19e9 + 2e-6 + 6 * s / 152e9, rel=1e-5)
    if nbytes >= GiB:  # latency no longer matters: 11 / (5 + 6 * 19 / 152)
        assert ring.time_s / topo.time_s == pytest.approx(11 / (5 + 6 * 19 / 152), rel=0.002)
    assert cost.best(intel, 12, "all_gather", nbytes) == "topo"
    # each shard crosses XeLink once per remote card (5 of them); the ring carries it over 6 of 11 hops
    assert topo.link_bytes["xelink"] == 5 * nbytes
    assert ring.link_bytes["xelink"] == 6 * nbytes - sum(_chunks(nbytes, 12)[r] for r in range(0, 12, 2))


@pytest.mark.parametrize("nbytes", [8, KiB, 4 * KiB, 24 * KiB])
def test_intel_direct_all_reduce_beats_the_ring_for_small_messages(intel, nbytes):
    ring = cost.predict(intel, 12, "all_reduce", "ring", nbytes)
    direct = cost.predict(intel, 12, "all_reduce", "direct", nbytes)
    assert direct.time_s < ring.time_s
    assert len(ring.steps) == 22 and len(direct.steps) == 1
    assert ring.time_s / direct.time_s > 5


def test_intel_direct_all_reduce_loses_for_large_messages(intel):
    assert cost.predict(intel, 12, "all_reduce", "direct", 96 * MiB).time_s > \
        cost.predict(intel, 12, "all_reduce", "ring", 96 * MiB).time_s
    assert cost.best(intel, 12, "all_reduce", KiB) == "direct"


def test_intel_hierarchical_reduce_scatter_crosses_xelink_once_per_card(intel):
    nbytes = 96 * MiB
    hier = cost.predict(intel, 12, "reduce_scatter", "hierarchical", nbytes)
    push = cost.predict(intel, 12, "reduce_scatter", "dest_split", nbytes)
    # every chunk's package partial crosses once per remote card; the push sends it from every stack
    assert hier.link_bytes["xelink"] == 5 * nbytes and push.link_bytes["xelink"] == 10 * nbytes
    assert cost.best(intel, 12, "reduce_scatter", nbytes) == "hierarchical"


def test_the_model_knows_every_implemented_algorithm():
    from xelink.collectives import ALGORITHMS

    for op, algos in ALGORITHMS.items():
        assert set(algos) <= set(cost.ALGOS[op]), (op, algos)


# ---------------------------------------------------------------------------------------------
# Exact traffic and time on a flat topology


@pytest.mark.parametrize("nbytes", [8 * MiB, 8 * MiB + 5, 3])
def test_ring_all_reduce_traffic_per_link_is_exact(flat, nbytes):
    n = 8
    c = _chunks(nbytes, n)
    p = cost.predict(flat, n, "all_reduce", "ring", nbytes)
    expect = {f"nvswitch gpu{r}->gpu{(r + 1) % n}": 2 * nbytes - c[r] - c[(r + 1) % n] for r in range(n)}
    expect = {k: v for k, v in expect.items() if v}
    assert p.traffic == expect
    assert sum(p.traffic.values()) == 2 * (n - 1) * nbytes
    assert p.link_bytes == {"nvswitch": 2 * (n - 1) * nbytes}


def test_ring_all_gather_traffic_and_time_are_exact(flat):
    n, nbytes = 8, 64 * MiB
    p = cost.predict(flat, n, "all_gather", "ring", nbytes)
    assert set(p.traffic.values()) == {(n - 1) * nbytes // n}
    assert sum(p.traffic.values()) == (n - 1) * nbytes
    link = flat.link("nvswitch")
    step = link.latency_us * 1e-6 + (nbytes / n) / (link.bandwidth_gbps * 1e9)
    assert p.time_s == pytest.approx((n - 1) * step, rel=1e-12)
    assert p.bottleneck.startswith("link nvswitch")


def test_direct_all_gather_shares_the_injection_bandwidth(flat, intel):
    nbytes = 64 * MiB
    p = cost.predict(flat, 8, "all_gather", "direct", nbytes)
    # each GPU sends its shard to 7 peers at once through its 450 GB/s injection limit
    assert p.time_s == pytest.approx(3e-6 + 7 * (nbytes / 8) / 450e9, rel=1e-12)
    assert p.bottleneck.startswith("injection of gpu")
    q = cost.predict(intel, 12, "all_gather", "direct", 96 * MiB)
    # a stack sends to 10 stacks of other cards through its 19 GB/s XeLink egress
    assert q.time_s == pytest.approx(5e-6 + 10 * (8 * MiB) / 19e9, rel=1e-12)
    assert q.bottleneck.startswith("xelink egress of xpu")


def test_network_channel_is_shared_by_the_host(flat):
    t = T.load("two-hosts-4gpu")
    nbytes = 64 * MiB
    p = cost.predict(t, 8, "all_gather", "direct", nbytes)
    # host-a -> host-b carries 4 shards x 4 GPUs at 200 GB/s; each GPU's NIC cap: 4 shards at 50 GB/s
    assert p.traffic["infiniband host-a->host-b"] == 16 * nbytes // 8
    assert p.time_s == pytest.approx(5e-6 + 16 * (nbytes / 8) / 200e9, rel=1e-12)


@pytest.mark.parametrize("name", T.available())
@pytest.mark.parametrize("op", cost.OPS)
def test_time_grows_with_size(name, op):
    t = T.load(name)
    for algo in cost.ALGOS[op]:
        times = [cost.predict(t, len(t.devices), op, algo, s).time_s for s in (KiB, 64 * KiB, MiB, 64 * MiB)]
        assert times == sorted(times) and times[0] < times[-1], (algo, times)


@pytest.mark.parametrize("op", cost.OPS)
def test_one_rank_and_zero_bytes_cost_nothing(intel, op):
    for algo in cost.ALGOS[op]:
        assert cost.predict(intel, 1, op, algo, MiB).time_s == 0.0
        p = cost.predict(intel, 12, op, algo, 0)
        assert (p.time_s, p.traffic, p.steps) == (0.0, {}, ())


@pytest.mark.parametrize("topo", ["intel-max-1550x6", "cpu-2x2", "uneven"])
@pytest.mark.parametrize("algo", cost.ALGOS["all_gather"])
def test_every_all_gather_delivers_each_shard_once(topo, algo):
    t = _uneven() if topo == "uneven" else T.load(topo)
    n, nbytes = len(t.devices), 1000003
    c = _chunks(nbytes, n)
    got = [0] * n
    for step in cost.schedule(T.place(t, n), "all_gather", algo, nbytes):
        for tr in step:
            got[tr.dst] += tr.nbytes
    assert got == [nbytes - c[r] for r in range(n)]


@pytest.mark.parametrize("op", cost.OPS)
def test_uneven_packages_are_served(op):
    t = _uneven()
    assert [len(g) for g in T.packages(T.place(t, 5))] == [2, 3]
    for algo in cost.ALGOS[op]:
        p = cost.predict(t, 5, op, algo, MiB)
        assert p.time_s > 0 and sum(p.link_bytes.values()) > 0


def test_ranks_sharing_a_device_copy_locally():
    t = T.load("cpu-2x2")
    p = cost.predict(t, T.place(t, 8, ranks_per_device=2), "all_gather", "ring", 8 * MiB)
    # ring hops 0->1, 2->3, ... stay on one device; only 4 hops cross a link
    assert len(p.traffic) == 4


# ---------------------------------------------------------------------------------------------
# Bad inputs


def test_bad_inputs_raise_named_errors(intel):
    with pytest.raises(ValueError, match=r"predict: op='all_sum' is not one of all_reduce, all_gather"):
        cost.predict(intel, 12, "all_sum", "ring", 1)
    with pytest.raises(ValueError, match=r"predict: algo='topo' is not an algorithm of op='all_reduce' "
                                         r"\(choose from ring, direct, two_shot, hierarchical\)"):
        cost.predict(intel, 12, "all_reduce", "topo", 1)
    with pytest.raises(ValueError, match=r"predict: nbytes=-1 must be >= 0"):
        cost.predict(intel, 12, "all_gather", "ring", -1)
    with pytest.raises(TypeError, match=r"predict: nbytes=1.5 must be an int"):
        cost.predict(intel, 12, "all_gather", "ring", 1.5)
    with pytest.raises(ValueError, match=r"predict: place: 13 ranks but topology 'intel-max-1550x6' has 12"):
        cost.predict(intel, 13, "all_gather", "ring", 1)
    with pytest.raises(TypeError, match=r"predict: topology='intel-max-1550x6' is not a Topology"):
        cost.predict("intel-max-1550x6", 12, "all_gather", "ring", 1)
    with pytest.raises(ValueError, match=r"predict: the placement is of topology 'cpu-2x2', not 'intel-max-1550x6'"):
        cost.predict(intel, T.place(T.load("cpu-2x2"), 4), "all_gather", "ring", 1)
    with pytest.raises(ValueError, match=r"best: |predict_all: op='gather' is not one of"):
        cost.best(intel, 12, "gather", 1)
    with pytest.raises(ValueError, match=r"predict_all: algos='ring' must be a non-empty list"):
        cost.predict_all(intel, 12, "all_gather", 1, algos="ring")
    with pytest.raises(TypeError, match=r"schedule: placement=12 is not a Placement"):
        cost.schedule(12, "all_gather", "ring", 1)


def test_parse_size():
    assert [cost.parse_size(s) for s in ("4096", "24K", "24KiB", "96M", "96mib", "1G")] == \
        [4096, 24 * KiB, 24 * KiB, 96 * MiB, 96 * MiB, GiB]
    with pytest.raises(ValueError, match=r"parse_size: '12X' is not a size such as 4096, 24K, 96MiB or 1G"):
        cost.parse_size("12X")


# ---------------------------------------------------------------------------------------------
# The commands


def test_cost_command_prints_times_and_ratios(capsys):
    assert cli.main(["cost", "--topology", "intel-max-1550x6", "--sizes", "1K", "96M"]) == 0
    out = capsys.readouterr().out
    assert "all_gather on intel-max-1550x6: 12 rank(s) in 6 package(s)" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("1 KiB", "96 MiB"))]
    assert rows[0][-1] == "direct" and rows[1][-1] == "topo"
    assert rows[1][-2] == "1.93x"  # topo vs ring at 96 MiB (docs/topology.md derives it)


def test_cost_command_all_ops(capsys):
    assert cli.main(["cost", "--topology", "cpu-2x2", "--op", "all", "--sizes", "1M", "--nranks", "3"]) == 0
    out = capsys.readouterr().out
    for op in cost.OPS:
        assert f"{op} on cpu-2x2: 3 rank(s) in 2 package(s)" in out


def test_topology_command_prints_and_saves(capsys, tmp_path):
    path = tmp_path / "saved.toml"
    assert cli.main(["topology", "--name", "two-hosts-4gpu", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert "topology two-hosts-4gpu" in out and "infiniband" in out and f"saved to {path}" in out
    assert T.load(path) == T.load("two-hosts-4gpu")


# ---------------------------------------------------------------------------------------------
# The topology-aware all-gather as xelink.collectives implements it


def test_topo_all_gather_crosses_first_then_replicates_what_each_rank_holds():
    t = T.load("cpu-2x2")
    c = _chunks(4000, 4)
    first, second = cost.schedule(T.place(t, 4), "all_gather", "topo", 4000)
    # step 1: only across packages, to the rank with the sender's local index
    assert sorted((x.src, x.dst, x.nbytes) for x in first) == [(0, 2, c[0]), (1, 3, c[1]), (2, 0, c[2]), (3, 1, c[3])]
    # step 2: every rank sends its own shard and the one it received to its package partner
    assert sorted((x.src, x.dst, x.nbytes) for x in second) == sorted(
        [(0, 1, c[0]), (0, 1, c[2]), (1, 0, c[1]), (1, 0, c[3]), (2, 3, c[2]), (2, 3, c[0]), (3, 2, c[3]), (3, 2, c[1])])


# ---------------------------------------------------------------------------------------------
# Calibration: software overhead and local copy/reduce terms

CAL = cost.Calibration(name="t", call_us=100.0, step_us=20.0, message_us=5.0,
                       local=cost.DeviceLocal(copy_gbps=10.0, reduce_gbps=5.0))


@pytest.fixture(scope="module")
def cpu():
    return T.load("cpu-2x2")  # every link 2.4 us, 8 GB/s; devices inject 8 GB/s


def test_no_calibration_and_an_empty_one_change_nothing(intel, cpu):
    for t, n in ((intel, 12), (cpu, 4), (cpu, 3)):
        for op in cost.OPS:
            for algo in cost.ALGOS[op]:
                for nbytes in (0, 1000, 8 * MiB + 3):
                    a = cost.predict(t, n, op, algo, nbytes)
                    b = cost.predict(t, n, op, algo, nbytes, cost.Calibration())
                    assert (a.time_s, a.steps, a.traffic, a.bottleneck) == (b.time_s, b.steps, b.traffic, b.bottleneck)
                    assert a.overhead_s == a.local_s == 0.0 and a.calibration is None and b.calibration == "none"


def test_ring_all_gather_pays_call_step_message_and_the_own_shard_copy(cpu):
    nbytes = 4 * MiB
    p = cost.predict(cpu, 4, "all_gather", "ring", nbytes, CAL)
    shard = nbytes / 4
    link = 2.4e-6 + shard / 8e9
    # one call, 3 steps of (step + 2 messages + the link), and the copy of the own shard into the output
    assert p.time_s == pytest.approx(100e-6 + 3 * (20e-6 + 2 * 5e-6 + link) + shard / 10e9, rel=1e-12)
    assert p.overhead_s == pytest.approx(100e-6 + 3 * 30e-6, rel=1e-12)
    assert p.latency_s == pytest.approx(3 * 2.4e-6, rel=1e-12)
    assert p.local_s == pytest.approx(shard / 10e9, rel=1e-12)
    assert p.calibration == "t" and len(p.steps) == 4  # the copy shows as a step of 0 bytes
    assert sum(s.time_s for s in p.steps) + 100e-6 == pytest.approx(p.time_s, rel=1e-12)


def test_ring_all_reduce_copies_in_and_out_and_sums_what_it_receives(cpu):
    nbytes = 4 * MiB
    p = cost.predict(cpu, 4, "all_reduce", "ring", nbytes, CAL)
    c = nbytes / 4
    step = 20e-6 + 2 * 5e-6 + 2.4e-6 + c / 8e9
    # 3 reduce-scatter steps each followed by summing one chunk; 3 all-gather steps; clone in, copy out
    expect = 100e-6 + 6 * step + 3 * c / 5e9 + 2 * nbytes / 10e9
    assert p.time_s == pytest.approx(expect, rel=1e-12)


def test_direct_all_reduce_sums_while_it_reads_peer_memory(cpu):
    nbytes = 4 * MiB
    p = cost.predict(cpu, 4, "all_reduce", "direct", nbytes, CAL)
    # one step: 3 peer reads (messages of the reader only); the transfers (4 buffers on the 8 GB/s fabric
    # channel from one package to the other) overlap the first copy and the 3 sums; copy in before, out after
    comm = 2.4e-6 + 4 * nbytes / 8e9
    local = nbytes / 10e9 + 3 * nbytes / 5e9
    assert local > comm
    assert p.time_s == pytest.approx(100e-6 + 20e-6 + 3 * 5e-6 + max(comm, local) + 2 * nbytes / 10e9, rel=1e-12)
    assert p.bottleneck.startswith("local work of cpu")
    fast = dataclasses.replace(CAL, local=cost.DeviceLocal(copy_gbps=1e6, reduce_gbps=1e6))
    q = cost.predict(cpu, 4, "all_reduce", "direct", nbytes, fast)
    assert q.time_s == pytest.approx(135e-6 + comm + 2 * nbytes / 1e15, rel=1e-9)  # links set the step


def test_two_shot_and_dest_split_reduce_their_own_chunk(cpu):
    nbytes = 4 * MiB
    c = nbytes / 4
    shot = 20e-6 + 6 * 5e-6 + 2.4e-6 + 4 * c / 8e9  # 3 sends + 3 receives per rank; 4 chunks on the fabric
    p = cost.predict(cpu, 4, "all_reduce", "two_shot", nbytes, CAL)
    assert p.time_s == pytest.approx(100e-6 + 2 * shot + 2 * c / 10e9 + 3 * c / 5e9, rel=1e-12)
    q = cost.predict(cpu, 4, "reduce_scatter", "dest_split", nbytes, CAL)
    assert q.time_s == pytest.approx(100e-6 + shot + 2 * c / 10e9 + 3 * c / 5e9, rel=1e-12)


def test_the_slowest_device_sets_the_local_time(cpu):
    slow = dataclasses.replace(CAL, devices={"cpu3": cost.DeviceLocal(copy_gbps=1.0, reduce_gbps=5.0)})
    a = cost.predict(cpu, 4, "all_gather", "direct", 4 * MiB, CAL)
    b = cost.predict(cpu, 4, "all_gather", "direct", 4 * MiB, slow)
    assert b.time_s - a.time_s == pytest.approx(MiB / 1e9 - MiB / 10e9, rel=1e-9)
    with pytest.raises(ValueError, match=r"predict: calibration 't' describes device 'gpu9', which topology "
                                         r"'cpu-2x2' does not have"):
        cost.predict(cpu, 4, "all_gather", "direct", 1, dataclasses.replace(CAL, devices={"gpu9": cost.DeviceLocal()}))
    with pytest.raises(TypeError, match=r"predict: calibration=\{\} is not a Calibration"):
        cost.predict(cpu, 4, "all_gather", "direct", 1, {})


def test_ranks_sharing_a_device_pay_a_copy_with_a_calibration(cpu):
    placement = T.place(cpu, 8, ranks_per_device=2)
    a = cost.predict(cpu, placement, "all_gather", "ring", 8 * MiB)
    b = cost.predict(cpu, placement, "all_gather", "ring", 8 * MiB, cost.Calibration(local=cost.DeviceLocal(1.0, 1.0)))
    assert b.time_s > a.time_s and b.traffic == a.traffic


@pytest.mark.parametrize("op", cost.OPS)
def test_calibrated_time_grows_with_size_and_turns_bandwidth_bound(cpu, op):
    for algo in cost.ALGOS[op]:
        preds = [cost.predict(cpu, 4, op, algo, s, CAL) for s in (KiB, 64 * KiB, MiB, 64 * MiB)]
        times = [p.time_s for p in preds]
        assert times == sorted(times) and times[0] < times[-1], (algo, times)
        assert preds[0].bandwidth_fraction < 0.5 < preds[-1].bandwidth_fraction, algo
        assert cost.predict(cpu, 4, op, algo, 0, CAL).time_s == 0.0
        assert cost.predict(cpu, 1, op, algo, MiB, CAL).time_s == 0.0


def test_best_and_table_take_a_calibration(cpu):
    # The links alone favour the ring's 6 steps at 256 KiB; a millisecond per step favours one step.
    pricey = dataclasses.replace(CAL, step_us=1000.0)
    assert cost.best(cpu, 4, "all_reduce", 256 * KiB) == "ring"
    assert cost.best(cpu, 4, "all_reduce", 256 * KiB, calibration=pricey) == "direct"
    out = cost.table(cpu, 4, "all_reduce", [256 * KiB], calibration=pricey)
    assert "calibration t" in out and out.splitlines()[-1].split()[-1] == "direct"


CAL_TOML = '''
name = "probe-x"
description = "measured"
topology = "cpu-2x2"
call_us = 120.5
call_source = "measured here: by `xelink bench probe` on 2026-01-01, vm"
step_us = 0
step_source = "measured here"
message_us = 30.0
message_source = "estimate: a guess"

[device_defaults]
copy_gbps = 12.0
copy_source = "measured here: copy"
reduce_gbps = 9.0
reduce_source = "measured here: add"

[[devices]]
id = "cpu1"
copy_gbps = 6.0
copy_source = "measured here: copy on cpu1"
'''


def test_calibration_files_load_and_round_trip(tmp_path):
    cal = cost.loads_calibration(CAL_TOML)
    assert (cal.name, cal.call_us, cal.step_us, cal.message_us) == ("probe-x", 120.5, 0.0, 30.0)
    assert cal.device_local("cpu0") == cost.DeviceLocal(12.0, 9.0)
    assert cal.device_local("cpu1") == cost.DeviceLocal(6.0, 9.0)  # reduce from the defaults
    assert cal.sources["cpu1.copy_gbps"] == "measured here: copy on cpu1"
    path = tmp_path / "cal.toml"
    cost.save_calibration(cal, path)
    assert cost.load_calibration(path) == cal
    assert cost.loads_calibration(cost.dumps_calibration(cal)) == cal


@pytest.mark.parametrize("edit, exc, message", [
    (("call_us = 120.5", "call_us = -1.0"), ValueError, r"call_us=-1.0 must be a non-negative, finite number"),
    (("copy_gbps = 12.0", "copy_gbps = 0"), ValueError, r"\[device_defaults\] copy_gbps=0 must be a positive"),
    (('message_source = "estimate: a guess"', 'message_source = "a guess"'), ValueError,
     r"message_source='a guess' must be one of 'measured here', 'datasheet', 'paper', 'estimate'"),
    (('step_source = "measured here"\n', ''), ValueError, r"step_source=None must be one of"),
    (("call_us = 120.5", "call_us = 120.5\ncall_ms = 1"), ValueError, r"unknown key 'call_ms' in the file"),
    (('id = "cpu1"', 'id = "cpu1"\nspeed = 1'), ValueError, r"unknown key 'speed' in device 'cpu1'"),
    (("copy_gbps = 6.0", 'copy_gbps = "fast"'), TypeError, r"device 'cpu1' copy_gbps='fast' must be a number"),
    (('name = "probe-x"', 'name = ""'), ValueError, r"the file has no 'name'"),
    (("[[devices]]", "[[devices]]\nid = \"cpu1\"\n[[devices]]"), ValueError, r"duplicate device id 'cpu1'"),
    (("[device_defaults]", "[device_defaults"), ValueError, r"not valid TOML"),
])
def test_broken_calibrations_are_rejected_by_name(edit, exc, message):
    with pytest.raises(exc, match=r"loads_calibration: <string>: .*" + message):
        cost.loads_calibration(CAL_TOML.replace(*edit))
    with pytest.raises(ValueError, match=r"load_calibration: calibration file 'nowhere.toml' does not exist"):
        cost.load_calibration("nowhere.toml")


# ---------------------------------------------------------------------------------------------
# Distributed GEMM: the collective, the GEMM, and the overlap


@pytest.mark.parametrize("name", T.available())
@pytest.mark.parametrize("op", cost.DIST_GEMM_OPS)
def test_every_dist_gemm_algorithm_is_priced(name, op):
    t = T.load(name)
    n = len(t.devices)
    for algo in cost.DIST_GEMM_ALGOS[op]:
        p = cost.predict_dist_gemm(t, n, op, algo, 1024 * n, 2048, 4096)
        assert p.compute_s == pytest.approx(2 * 1024 * n * 2048 * 4096 / (cost.GEMM_TFLOPS[t.devices[0].kind] * 1e12))
        assert p.time_s >= p.compute_s > 0 and p.steps and sum(p.link_bytes.values()) > 0, algo
        assert (p.op, p.algo, p.nranks) == (op, algo, n)
        # sequential is the collective then the GEMM, exactly
        if algo == "sequential":
            coll = {"all_gather_matmul": "all_gather", "matmul_reduce_scatter": "reduce_scatter"}.get(op, "all_reduce")
            nbytes = 1024 * n * (4096 if coll == "all_gather" else 2048) * 2
            best = cost.best(t, n, coll, nbytes)
            assert p.time_s == pytest.approx(cost.predict(t, n, coll, best, nbytes).time_s + p.compute_s, rel=1e-12)


@pytest.mark.parametrize("name", T.available())
@pytest.mark.parametrize("op", cost.DIST_GEMM_OPS)
@pytest.mark.parametrize("shape", [(6144, 1024, 1024), (12288, 8192, 8192), (24576, 8192, 4096)])
def test_pipelining_the_ring_never_loses_to_the_ring_then_the_gemm(name, op, shape):
    # pipelined runs the ring's own steps, so it can only hide time; with comm it hides some
    t = T.load(name)
    n = len(t.devices)
    seq = cost.predict_dist_gemm(t, n, op, "sequential", *shape, collective_algo="ring")
    pip = cost.predict_dist_gemm(t, n, op, "pipelined", *shape)
    assert seq.time_s > seq.compute_s
    assert seq.time_s > pip.time_s >= pip.compute_s


@pytest.mark.parametrize("op", cost.DIST_GEMM_OPS)
def test_two_ranks_hide_one_step_behind_the_gemm(op):
    t = T.load("nvidia-h200x2")
    M = N = K = 8192
    seq = cost.predict_dist_gemm(t, 2, op, "sequential", M, N, K)
    pip = cost.predict_dist_gemm(t, 2, op, "pipelined", M, N, K)
    top = cost.predict_dist_gemm(t, 2, op, "topo", M, N, K)
    gemm = 2 * M * N * K / 766e12
    step = 3e-6 + M * (K if op == "all_gather_matmul" else N) * 2 / 2 / 390e9
    # (the all-reduce: the one-shot direct one, a single latency for both halves)
    assert seq.time_s == pytest.approx(gemm + (2 * step - 3e-6 if op == "matmul_all_reduce" else step), rel=1e-9)
    if op == "matmul_all_reduce":  # the reduce-scatter hides, the all-gather of the sum cannot
        assert pip.time_s == pytest.approx(gemm + step, rel=1e-9)
    else:  # one step, shorter than the GEMM of the own half: hidden
        assert step < gemm / 2 and pip.time_s == pytest.approx(gemm, rel=1e-12)
        assert pip.bottleneck == "GEMM"
    assert top.time_s == pytest.approx(pip.time_s, rel=1e-12)  # one package: the same single exchange


def test_ranks_sharing_a_gpu_share_its_gemm_rate():
    t = T.load("nvidia-h200x2")
    one = cost.predict_dist_gemm(t, 2, "all_gather_matmul", "topo", 8192, 8192, 8192)
    shared = cost.predict_dist_gemm(t, T.place(t, 2, 2), "all_gather_matmul", "topo", 8192, 8192, 8192)
    assert shared.compute_s == pytest.approx(2 * one.compute_s) and shared.link_bytes == {}


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_topo_beats_the_flat_pipeline_across_slow_xelink(intel, op):
    M = N = K = 6144
    pip = cost.predict_dist_gemm(intel, 12, op, "pipelined", M, N, K)
    top = cost.predict_dist_gemm(intel, 12, op, "topo", M, N, K)
    assert top.time_s < 0.8 * pip.time_s
    # each shard (or partial) crosses XeLink once per remote card, as the topo collectives; the ring
    # carries it over 6 of its 11 hops
    coll = M * (K if op == "all_gather_matmul" else N) * 2
    assert top.link_bytes["xelink"] == (10 if op == "matmul_all_reduce" else 5) * coll
    assert pip.link_bytes["xelink"] == (12 if op == "matmul_all_reduce" else 6) * coll - (
        coll if op == "matmul_all_reduce" else coll // 2)
    # the paper's comparison: materialise with the topo gather, then the GEMM, against a flat gather
    flat = cost.predict_dist_gemm(intel, 12, "all_gather_matmul", "sequential", M, N, K, collective_algo="direct")
    topo = cost.predict_dist_gemm(intel, 12, "all_gather_matmul", "sequential", M, N, K, collective_algo="topo")
    assert 1.2 < flat.time_s / topo.time_s < 1.5


@pytest.mark.parametrize("op", cost.DIST_GEMM_OPS)
def test_dist_gemm_on_uneven_packages_and_one_rank(op):
    t = _uneven()
    for algo in cost.DIST_GEMM_ALGOS[op]:
        p = cost.predict_dist_gemm(t, 5, op, algo, 640, 512, 512, 4)
        assert p.time_s >= p.compute_s > 0 and sum(p.link_bytes.values()) > 0
        one = cost.predict_dist_gemm(t, 1, op, algo, 640, 512, 512, 4)
        assert one.time_s == one.compute_s == pytest.approx(2 * 640 * 512 * 512 / 0.05e12) and one.steps == ()


def test_topo_rounds_deliver_every_shard_and_block_once():
    from xelink.cost import _gather_rounds, _scatter_rounds

    for t, n in ((T.load("intel-max-1550x6"), 12), (_uneven(), 5), (T.load("cpu-2x2"), 3)):
        pl = T.place(t, n)
        rounds = _gather_rounds(pl, "topo", 7)
        assert [sum(got.get(r, 0) for _, got in rounds) for r in range(n)] == [n - 1] * n
        # a shard arrives once at every rank (from its owner or the landing rank of its package)
        assert sum(len(ph.transfers) for ph, _ in rounds) >= n * (n - 1)
        rs = _scatter_rounds(pl, "topo", 7)
        assert all(need[r] <= n - 1 for _, need in rs for r in need)
        got = [0] * n  # every destination receives one partial per package, its own package's per member
        for ph, _ in rs:
            for tr in ph.transfers:
                got[tr.dst] += 1
        assert all(g >= len(pl.packages()) - 1 for g in got)


def test_dist_gemm_calibration_adds_the_software_terms(cpu):
    base = cost.predict_dist_gemm(cpu, 4, "all_gather_matmul", "sequential", 1024, 1024, 1024, 4)
    cal = cost.predict_dist_gemm(cpu, 4, "all_gather_matmul", "sequential", 1024, 1024, 1024, 4, CAL)
    assert cal.time_s > base.time_s and cal.calibration == CAL.name and cal.overhead_s > 0
    pip = cost.predict_dist_gemm(cpu, 4, "all_gather_matmul", "pipelined", 64, 64, 64, 4, CAL)
    assert pip.time_s > cost.predict_dist_gemm(cpu, 4, "all_gather_matmul", "pipelined", 64, 64, 64, 4).time_s


def test_fused_all_gather_matmul_is_priced_in_the_order_it_reads(intel, flat):
    # On 12 stacks in packages of 2 the fused kernel reads in topo's order, so it is priced as topo; on
    # one package (the flat topology) it reads, and is priced, as pipelined.
    f = cost.predict_dist_gemm
    for M, N, K in ((6144, 6144, 6144), (1200, 96, 4096)):
        fused = f(intel, 12, "all_gather_matmul", "fused", M, N, K)
        assert fused.time_s == pytest.approx(f(intel, 12, "all_gather_matmul", "topo", M, N, K).time_s)
        assert fused.time_s != pytest.approx(f(intel, 12, "all_gather_matmul", "pipelined", M, N, K).time_s)
        assert f(flat, 8, "all_gather_matmul", "fused", M, N, K).time_s == pytest.approx(
            f(flat, 8, "all_gather_matmul", "pipelined", M, N, K).time_s)


def test_fused_reduce_scatter_is_priced_in_the_order_it_sends(intel, flat):
    # The fused GEMM + reduce-scatter sends its tiles owner by owner from the next rank on, on any topology:
    # priced as pipelined (topo's order differs on packages); the all-reduce adds the ring all-gather.
    f = cost.predict_dist_gemm
    for M, N, K in ((6144, 6144, 6144), (1200, 96, 4096)):
        for op in ("matmul_reduce_scatter", "matmul_all_reduce"):
            for topo, n in ((intel, 12), (flat, 8)):
                fused = f(topo, n, op, "fused", M, N, K)
                assert fused.time_s == pytest.approx(f(topo, n, op, "pipelined", M, N, K).time_s), (op, n)
                assert fused.algo == "fused" and fused.time_s >= fused.compute_s


def test_dist_gemm_bad_inputs_raise_named_errors(intel):
    f = cost.predict_dist_gemm
    with pytest.raises(ValueError, match=r"predict_dist_gemm: op='gemm' is not one of all_gather_matmul, "):
        f(intel, 12, "gemm", "topo", 12, 1, 1)
    with pytest.raises(ValueError, match=r"predict_dist_gemm: algo='ring' is not an algorithm of "
                                         r"op='matmul_reduce_scatter' \(choose from sequential, pipelined, topo, fused\)"):
        f(intel, 12, "matmul_reduce_scatter", "ring", 12, 1, 1)
    with pytest.raises(ValueError, match=r"predict_dist_gemm: M=100 is not divisible by the 12 rank\(s\)"):
        f(intel, 12, "all_gather_matmul", "topo", 100, 1, 1)
    with pytest.raises(ValueError, match=r"predict_dist_gemm: N=0 must be >= 1"):
        f(intel, 12, "matmul_reduce_scatter", "topo", 12, 0, 1)
    with pytest.raises(TypeError, match=r"predict_dist_gemm: K=1.5 must be an int"):
        f(intel, 12, "matmul_reduce_scatter", "topo", 12, 1, 1.5)
    with pytest.raises(ValueError, match=r"predict_dist_gemm: dtype_bytes=0 must be a positive int"):
        f(intel, 12, "matmul_all_reduce", "topo", 12, 1, 1, dtype_bytes=0)
    with pytest.raises(ValueError, match=r"predict_dist_gemm: gemm_tflops=-1 must be a positive"):
        f(intel, 12, "matmul_all_reduce", "topo", 12, 1, 1, gemm_tflops=-1)
    with pytest.raises(ValueError, match=r"predict_dist_gemm: collective_algo='ring' applies to algo='sequential'"):
        f(intel, 12, "all_gather_matmul", "topo", 12, 1, 1, collective_algo="ring")
    with pytest.raises(ValueError, match=r"predict_dist_gemm: collective_algo='two_shot' is not an algorithm of "
                                         r"all_gather"):
        f(intel, 12, "all_gather_matmul", "sequential", 12, 1, 1, collective_algo="two_shot")
    with pytest.raises(ValueError, match=r"predict_dist_gemm: place: 13 ranks"):
        f(intel, 13, "all_gather_matmul", "topo", 13, 1, 1)
    with pytest.raises(ValueError, match=r"dist_gemm_table: op='all_gather' is not one of"):
        cost.dist_gemm_table(intel, 12, "all_gather", [(12, 1, 1)])
    with pytest.raises(ValueError, match=r"parse_shape: '8x8' is not a shape"):
        cost.parse_shape("8x8")
    assert cost.parse_shape("8192") == (8192,) * 3 and cost.parse_shape("16384x8192x4096") == (16384, 8192, 4096)


def test_cost_command_prices_dist_gemm(capsys):
    assert cli.main(["cost", "--topology", "intel-max-1550x6", "--op", "all_gather_matmul",
                     "--shapes", "6144", "12288x12288x12288"]) == 0
    out = capsys.readouterr().out
    assert "all_gather_matmul on intel-max-1550x6: 12 rank(s) in 6 package(s)" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("6144x", "12288x"))]
    assert rows[0][0] == "6144x6144x6144" and rows[0][-1] == "topo" and len(rows) == 2


# -- context-parallel attention ----------------------------------------------------------------

def _pairs_brute(pieces_q, pieces_k, causal):
    return sum(1 for qs, ql in pieces_q for q in range(qs, qs + ql) for ks, kl in pieces_k
               for k in range(ks, ks + kl) if not causal or k <= q)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_cp_attention_work_is_the_visible_pairs(layout, causal):
    """Compute-bound (links made free): the time is the slowest rank's visible (query, key) pairs at
    4 * head_dim flops each; zigzag balances the causal work, contiguous does not."""
    from xelink.dist import schedule

    topo = T.load("nvidia-h200x8")
    n, S, B, H, D, rate = 4, 1003, 2, 4, 64, 1.0  # S not divisible by the block count
    pieces = [schedule.cp_pieces(S, n, layout, r) for r in range(n)]
    worst = max(sum(_pairs_brute(pieces[r], pieces[o], causal) for o in range(n)) for r in range(n))
    for algo in cost.CP_ATTENTION_ALGOS:
        p = cost.predict_cp_attention(topo, n, algo, seq_len=S, batch=B, heads=H, head_dim=D, causal=causal,
                                      layout=layout, attn_tflops=rate * 1e-6)  # 1 MFLOP/s: links are free
        assert p.op == "cp_attention" and p.algo == algo and p.bottleneck == "attention"
        assert p.compute_s == pytest.approx(4 * B * H * D * worst / 1e6, rel=1e-12)
        assert p.time_s == pytest.approx(p.compute_s, rel=1e-9)
    if causal:
        share = [sum(_pairs_brute(pieces[r], pieces[o], True) for o in range(n)) for r in range(n)]
        spread = max(share) / min(share)
        assert spread < 1.01 if layout == "zigzag" else spread > 3


def test_cp_attention_ring_hides_the_transfers_until_the_link_is_slower():
    topo = T.load("nvidia-h200x2")
    # 64K positions: a rank's own block takes longer than moving the other's KV, so nothing is exposed.
    flops = 4 * 32 * 128 * 65536 ** 2  # non-causal MHA
    p = cost.predict_cp_attention(topo, 2, "ring", seq_len=65536)
    assert p.time_s == pytest.approx(flops / 2 / (cost.ATTN_TFLOPS["cuda"] * 1e12), rel=1e-9)
    # 2K positions: the own block (half a rank's work) is shorter than the transfer, which shows.
    short = cost.predict_cp_attention(topo, 2, "ring", seq_len=2048)
    move = sum(st.time_s for st in short.steps)
    assert short.time_s == pytest.approx(move + short.compute_s / 2, rel=1e-9) and short.time_s > short.compute_s
    free = cost.predict_cp_attention(topo, 2, "ring", seq_len=2048, attn_tflops=1e9)  # attention ~free
    assert free.bottleneck != "attention" and free.time_s == pytest.approx(move, rel=1e-6)


def test_cp_attention_auto_takes_the_faster_by_the_model():
    import types

    cpa = importlib.import_module("xelink.dist.cp_attention")  # the module (xelink.dist re-exports the op)

    def comm(topo_name, n):
        topo = T.load(topo_name)
        return types.SimpleNamespace(topology=topo, placement=T.place(topo, n), packages=[list(range(n))])

    problem = dict(seq_len=16384, batch=1, heads=32, kv_heads=32, head_dim=128, causal=True, layout="zigzag",
                   dtype_bytes=2)
    for name, n in (("nvidia-h200x8", 8), ("two-hosts-4gpu", 8)):
        c = comm(name, n)
        times = {a: cost.predict_cp_attention(c.topology, c.placement, a, **problem).time_s for a in cpa.CP_ALGOS}
        assert cpa.auto_algo(c, 1 << 20, problem=problem) == min(times, key=times.get)
    assert cpa.auto_algo(comm("nvidia-h200x8", 8), 1 << 20, problem=problem) == "ring"  # the links at 8 GPUs
    assert cpa.auto_algo(comm("two-hosts-4gpu", 8), 1 << 20, problem=problem) == "all_gather"  # the ring's IB hop
    # Too large to gather: ring whatever the model says; no placement: all_gather.
    assert cpa.auto_algo(comm("two-hosts-4gpu", 8), cpa.AUTO_GATHER_BYTES, problem=problem) == "ring"
    assert cpa.auto_algo(types.SimpleNamespace(placement=None), 1 << 20, problem=problem) == "all_gather"


def test_cp_attention_model_bad_inputs_raise_named_errors():
    topo = T.load("nvidia-h200x2")
    f = cost.predict_cp_attention
    with pytest.raises(ValueError, match=r"predict_cp_attention: algo='fused' is not one of ring, all_gather"):
        f(topo, 2, "fused", seq_len=8)
    with pytest.raises(ValueError, match=r"predict_cp_attention: layout='striped' is not one of"):
        f(topo, 2, "ring", seq_len=8, layout="striped")
    with pytest.raises(ValueError, match=r"predict_cp_attention: seq_len=0 must be an int >= 1"):
        f(topo, 2, "ring", seq_len=0)
    with pytest.raises(ValueError, match=r"predict_cp_attention: heads=6 is not a multiple of kv_heads=4"):
        f(topo, 2, "ring", seq_len=8, heads=6, kv_heads=4)
    with pytest.raises(ValueError, match=r"predict_cp_attention: attn_tflops=0 must be > 0"):
        f(topo, 2, "ring", seq_len=8, attn_tflops=0)


def test_cost_command_prices_cp_attention(capsys):
    assert cli.main(["cost", "--topology", "nvidia-h200x8", "--op", "cp_attention", "--causal",
                     "--seq-lens", "16384", "131072", "--kv-heads", "8"]) == 0
    out = capsys.readouterr().out
    assert "cp_attention on nvidia-h200x8: 8 rank(s) in 1 package(s); 32 heads (8 KV), head dim 128, causal" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("16384", "131072"))]
    assert len(rows) == 2 and all(r[-1] in cost.CP_ATTENTION_ALGOS for r in rows)
    p = {a: cost.predict_cp_attention(T.load("nvidia-h200x8"), 8, a, seq_len=131072, kv_heads=8, causal=True)
         for a in cost.CP_ATTENTION_ALGOS}
    assert rows[1][-1] == min(p, key=lambda a: p[a].time_s)
