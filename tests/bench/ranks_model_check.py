"""The probe and the model check on real ranks: finite positive figures, the rows they should have."""
import math

from xelink import cost
from xelink import topology as T
from xelink.bench import model_check, probe
from xelink.collectives import ALGORITHMS

WORLD_SIZES = (1, 2)
KiB = 1 << 10


def _probe(world):
    return probe.probe(world, **probe.QUICK)


def check_probe_measures_positive_finite_figures(world):
    result = _probe(world)
    assert result == world.allgather_object(result)[0]  # the same on every rank
    finite = lambda x: math.isfinite(x) and x > 0  # noqa: E731
    if world.size > 1:
        (name, got), = result.links.items()  # one host: one shm link joins every pair
        assert got["pair"] == [0, 1] and name == world.topology.links[0].name
        assert finite(got["fit"].gbps) and got["fit"].alpha_us >= 0
        assert finite(result.injection.gbps)
        sw = result.software
        assert set(sw["patterns"]) == {"pingpong", "ring"}
        assert all(p["per_step_us"] > 0 for p in sw["patterns"].values())
        assert sw["call_us"] >= sw["api_us"] > 0 and sw["step_us"] >= 0 and sw["message_us"] >= 0
    else:
        assert result.links == {} and result.injection is None and result.software == {}
    assert len(result.local) == world.size
    assert all(finite(loc["copy"].gbps) and finite(loc["reduce"].gbps) for loc in result.local)
    topo, cal = probe.calibrated(result, world.topology, world.world_placement)
    assert T.loads(T.dumps(topo)) == topo
    assert cost.loads_calibration(cost.dumps_calibration(cal)) == cal
    assert all(s.startswith("measured here: by `xelink bench probe` on ") for s in cal.sources.values())


def check_model_check_prices_and_measures_every_algorithm(world):
    result = _probe(world)
    topo, cal = probe.calibrated(result, world.topology, world.world_placement)
    placement = T.place(topo, world.size)
    sizes = (KiB, 64 * KiB)
    rows = model_check.run_check(world, topo, placement, cal, base_topology=world.topology,
                                 ops=("all_reduce", "all_gather"), sizes=sizes, iters=2, rounds=1, warmup=1)
    want = [(op, a, s) for op in ("all_reduce", "all_gather") for s in sizes for a in cost.ALGOS[op]
            if a in ALGORITHMS[op]]
    assert [(c.row.op, c.row.path.split(":")[1], c.row.size_bytes) for c in rows] == want
    assert all(c.row.wrong == 0 and c.row.time_us > 0 for c in rows)
    by = {(c.row.op, c.row.path, c.row.size_bytes): c for c in rows}
    for op, algo, s in want:
        if s == sizes[0]:
            small, large = by[op, f"xelink:{algo}", sizes[0]], by[op, f"xelink:{algo}", sizes[1]]
            assert large.predicted_us > small.predicted_us or (world.size == 1 and large.predicted_us >= small.predicted_us)
    if world.size > 1:
        assert all(c.ratio is not None and c.ratio > 0 and c.within is not None for c in rows)
        assert all(c.predicted_us > c.links_only_us for c in rows)  # the software terms count
    else:
        assert all(c.within is None for c in rows)
    text = model_check.format_check(rows)
    assert len(text.splitlines()) == len(rows) + 1 and "pred/meas" in text
    line = model_check.summary(rows)
    assert line.startswith("summary: ") and ("rows within ±30%" in line or world.size == 1)
