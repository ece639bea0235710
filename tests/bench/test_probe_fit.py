"""The probe's alpha-beta fit and the calibrated topology it writes (no ranks needed)."""
import pytest

from xelink import cost
from xelink import topology as T
from xelink.bench.probe import Fit, ProbeResult, calibrated, fit_alpha_beta


def test_fit_recovers_alpha_and_beta_exactly():
    points = [(s, 20e-6 + s / 5e9) for s in (8, 65536, 1 << 20, 4 << 20)]
    f = fit_alpha_beta(points)
    assert f.alpha_us == pytest.approx(20.0, rel=1e-6) and f.gbps == pytest.approx(5.0, rel=1e-6)
    assert f.seconds(1 << 20) == pytest.approx(20e-6 + (1 << 20) / 5e9, rel=1e-9)


def test_fit_keeps_alpha_non_negative_and_beta_positive():
    # Noise that would give a negative intercept: refitted through the origin.
    f = fit_alpha_beta([(1000, 5e-5), (1 << 20, 1e-4), (4 << 20, 8e-4)])
    assert f.alpha_us == 0.0 and f.gbps > 0
    # The largest sizes set beta: a cache-resident middle point barely moves it.
    g = fit_alpha_beta([(8, 2e-5), (1 << 20, 5e-5), (16 << 20, 4e-3)])
    assert g.gbps == pytest.approx(16 * 2**20 / 4e-3 / 1e9, rel=0.05)
    # A larger size that took less time (noise) still gives a positive bandwidth.
    h = fit_alpha_beta([(1 << 20, 5e-4), (4 << 20, 4e-4)])
    assert h.gbps > 0 and h.alpha_us >= 0
    with pytest.raises(ValueError, match=r"fit_alpha_beta: .* need positive times"):
        fit_alpha_beta([(8, 0.0)])


def test_a_probe_result_makes_a_valid_calibrated_topology_and_calibration():
    base = T.load("cpu-2x2")
    placement = T.place(base, 4)
    pp = Fit(25.0, 3.0, ((8, 25e-6), (1 << 20, 3.7e-4)))
    result = ProbeResult(
        nranks=4, hosts=["vm"] * 4, device="cpu", date="2026-01-02",
        links={"shm0": {"pair": [0, 1], "fit": pp, "latency_us": 25.0},
               "fabric": {"pair": [0, 2], "fit": Fit(30.0, 2.0, pp.points), "latency_us": 28.0}},
        injection=Fit(10.0, 1.5, pp.points),
        software={"patterns": {"ring": {"lengths": [1, 4]}}, "call_us": 400.0, "step_us": 50.0, "message_us": 100.0,
                  "intercept_us": 390.0, "api_us": 10.0},
        local=[{"copy": Fit(1.0, 8.0 + r, pp.points), "reduce": Fit(1.0, 6.0, pp.points)} for r in range(4)])
    topo, cal = calibrated(result, base, placement)
    assert topo.name == "cpu-2x2-probed" and topo.link("shm0").latency_us == 25.0
    assert topo.link("fabric").bandwidth_gbps == 2.0 and topo.link("fabric").latency_us == 28.0
    assert topo.link("shm1").bandwidth_gbps == 8.0  # no rank pair crosses it: not probed
    assert {d.injection_gbps for d in topo.devices} == {1.5}
    stamp = "measured here: by `xelink bench probe` on 2026-01-02, vm, 4 rank(s)"
    assert topo.link("shm0").latency_source.startswith(stamp)
    assert T.loads(T.dumps(topo)) == topo  # the same schema as the shipped descriptions
    assert (cal.call_us, cal.step_us, cal.message_us) == (400.0, 50.0, 100.0)
    assert cal.device_local("cpu3") == cost.DeviceLocal(11.0, 6.0) and cal.local.copy_gbps == 9.5
    assert all(s.startswith(stamp) for s in cal.sources.values())
    assert cost.loads_calibration(cost.dumps_calibration(cal)) == cal
    p = cost.predict(topo, 4, "all_gather", "ring", 1 << 20, cal)
    assert p.overhead_s == pytest.approx(400e-6 + 3 * (50e-6 + 2 * 100e-6), rel=1e-12)


def _comm(device):
    import torch

    return type("Comm", (), {"device": torch.device(device)})()


def test_probe_sizes_follow_the_device_kind():
    from xelink.bench import probe as P

    assert P.defaults(_comm("cpu"), False) == {} and P.defaults(_comm("cpu"), True) == P.QUICK
    gpu, quick = P.defaults(_comm("cuda"), False), P.defaults(_comm("cuda"), True)
    # GPU sizes reach past a datacenter GPU's L2 cache (60 MB on H200) for the bandwidths.
    assert max(gpu["pingpong_sizes"]) >= 128 << 20 and max(gpu["local_sizes"]) >= 256 << 20
    assert quick["iters"] == P.QUICK["iters"] and max(quick["pingpong_sizes"]) >= 32 << 20
    assert P.is_cuda(_comm("cuda")) and not P.is_cuda(_comm("cpu"))


def test_gpu_software_fit_from_barrier_chains():
    # CUDA ranks time chains of GPU barriers (one pattern): the step is the slope less the link latency.
    from xelink.bench import probe as P

    base = T.load("cpu-2x2")
    placement = T.place(base, 4)
    times = {f"chain|barrier|{k}": (10 + 3 * k) * 1e-6 for k in (1, 6)}
    sw = P._software(times, (1, 6), base, placement, 2.0, P._gpu_patterns)
    link = max(base.route(placement.devices[0], placement.devices[p])[0].latency_us for p in (1, 2, 3))
    assert list(sw["patterns"]) == ["barrier"] and sw["patterns"]["barrier"]["messages"] == 3
    assert sw["step_us"] == pytest.approx(max(3.0 - link, 0.0), abs=1e-9) and sw["message_us"] == 0.0
    assert sw["call_us"] == pytest.approx(12.0, rel=1e-9)


def test_copy_engine_probe_is_named_in_the_sources():
    from xelink.bench import probe as P

    base = T.load("cpu-2x2")
    placement = T.place(base, 2)
    pp = Fit(2.0, 300.0, ((8, 2e-6), (1 << 20, 5e-6)))
    result = P.ProbeResult(nranks=2, hosts=["h"] * 2, device="cuda:0", date="2026-01-02",
                           links={"shm0": {"pair": [0, 1], "fit": pp, "latency_us": 2.0}}, injection=None,
                           software={}, local=[{"copy": pp, "reduce": pp}] * 2, method="xelink:copy_engine",
                           baseline_pairs=[{"pair": [0, 1], "fit": Fit(5.0, 200.0, pp.points), "latency_us": 6.0}])
    topo, _ = calibrated(result, base, placement)
    assert "pulls from rank 1's memory with the copy engine" in topo.link("shm0").bandwidth_source
    text = P.format_result(result)
    assert "copy engine" in text and "baseline NCCL send/recv ping-pong rank 0 <-> 1: latency 6.0 us" in text
