"""The alpha-beta cost model: the Intel Max predictions, exact traffic and times, growth, bad inputs, CLI."""
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
    # stack's 19 GB/s XeLink egress at once, then 5 shards over 152 GB/s MDFI (2 us).
    s = nbytes / 12
    assert ring.time_s == pytest.approx(11 * (5e-6 + s / 19e9), rel=1e-5)
    assert topo.time_s == pytest.approx(5e-6 + 5 * s / 19e9 + 2e-6 + 5 * s / 152e9, rel=1e-5)
    if nbytes >= GiB:  # latency no longer matters: 11 / (5 + 5 * 19 / 152)
        assert ring.time_s / topo.time_s == pytest.approx(11 / (5 + 5 * 19 / 152), rel=0.002)
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
    assert rows[1][-2] == "1.97x"  # topo vs ring at 96 MiB


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
