"""The benchmark harness core: bandwidth factors, timing, co-measurement, rows, table, JSONL, CSV."""
import csv
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import xelink
from xelink.bench import (JsonlWriter, Row, algbw, busbw, co_measure, format_table, make_row, manifest,
                          read_jsonl, summarize, time_cuda_events, time_fn, write_csv)


# -- bandwidth ----------------------------------------------------------------------------------

@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 4, 2 * 3 / 4),
    ("all_reduce", 1, 0.0),
    ("all_reduce", 3, 2 * 2 / 3),
    ("all_gather", 8, 7 / 8),
    ("all_gather_into_tensor", 8, 7 / 8),
    ("reduce_scatter", 5, 4 / 5),
    ("reduce_scatter_tensor", 5, 4 / 5),
    ("all_to_all", 2, 1 / 2),
    ("all_to_all_single", 2, 1 / 2),
    ("broadcast", 6, 1.0),
    ("reduce", 6, 1.0),
])
def test_busbw_uses_the_nccl_tests_factors(op, n, factor):
    assert algbw(4_000_000, 0.002) == pytest.approx(2.0)  # 4 MB in 2 ms = 2 GB/s
    assert busbw(op, 4_000_000, 0.002, n) == pytest.approx(2.0 * factor)


def test_busbw_rejects_an_unknown_op_by_name():
    with pytest.raises(ValueError, match=r"busbw: unknown op 'allreduce'"):
        busbw("allreduce", 100, 1.0, 2)
    with pytest.raises(ValueError, match=r"busbw: n=0"):
        busbw("all_reduce", 100, 1.0, 0)
    with pytest.raises(ValueError, match=r"algbw: seconds=0"):
        algbw(100, 0)


# -- timing -------------------------------------------------------------------------------------

class FakeClock:
    """A clock that advances only when work 'runs', so durations are exact."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_fn_warms_up_then_times_each_call():
    clock, calls, syncs = FakeClock(), [], []

    def work():
        calls.append(clock.now)
        clock.now += 0.5 + len(calls)  # the k-th call takes 0.5 + k seconds

    samples = time_fn(work, warmup=2, iters=3, sync=lambda: syncs.append(1), timer=clock)
    assert samples == [3.5, 4.5, 5.5]
    assert len(calls) == 5 and len(syncs) == 5  # sync after warm-up calls too
    with pytest.raises(ValueError, match=r"time_fn: iters=0 must be >= 1"):
        time_fn(work, warmup=0, iters=0)
    with pytest.raises(TypeError, match=r"time_fn: warmup=1.5 must be an int"):
        time_fn(work, warmup=1.5, iters=1)


def test_time_cuda_events_says_it_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the CPU-only message is not reachable")
    with pytest.raises(RuntimeError, match=r"time_cuda_events: needs a CUDA device"):
        time_cuda_events(lambda: None, warmup=0, iters=1)


def test_co_measure_interleaves_variants_and_calls_the_barrier_before_each_block():
    log = []
    variants = {"ours": lambda: log.append("ours"), "base": lambda: log.append("base")}
    samples = co_measure(variants, warmup=1, iters=2, rounds=3, barrier=lambda: log.append("barrier"),
                         after_block=lambda name: log.append(f"checked {name}"),
                         before_block=lambda name: log.append(f"poisoned {name}"))
    block = {name: [f"poisoned {name}", "barrier", name, name, f"checked {name}"] for name in variants}
    assert log == ["ours", "base"] + (block["ours"] + block["base"]) * 3
    assert {name: len(s) for name, s in samples.items()} == {"ours": 6, "base": 6}
    assert all(t >= 0 for s in samples.values() for t in s)


def test_co_measure_reduces_each_sample_and_takes_a_timing_function():
    clock = FakeClock()

    def work(seconds):
        def run():
            clock.now += seconds
        return run

    def timing(fn, iters):
        return time_fn(fn, warmup=0, iters=iters, timer=clock)

    seen = []

    def reduce_max(t):  # stands in for rank_max(comm): the slowest rank took 10 s longer
        seen.append(t)
        return t + 10

    samples = co_measure({"a": work(1.0), "b": work(2.0)}, warmup=0, iters=2, rounds=2, timing=timing,
                         reduce_max=reduce_max)
    assert samples == {"a": [11.0] * 4, "b": [12.0] * 4}
    assert seen == [1.0, 1.0, 2.0, 2.0] * 2


def test_co_measure_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"co_measure: variants=\{\} must be a non-empty dict"):
        co_measure({}, warmup=0, iters=1, rounds=1)
    with pytest.raises(TypeError, match=r"co_measure: variants\['x'\]=3 is not callable"):
        co_measure({"x": 3}, warmup=0, iters=1, rounds=1)
    with pytest.raises(ValueError, match=r"co_measure: rounds=0 must be >= 1"):
        co_measure({"x": lambda: None}, warmup=0, iters=1, rounds=0)


def test_summarize_known_samples():
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0])
    assert s == {"median": 6.0, "min": 1.0, "p10": 2.0, "p90": 10.0, "mean": 6.0, "n": 11}
    even = summarize([1.0, 2.0, 3.0, 4.0])
    assert even["median"] == 2.5 and even["p10"] == pytest.approx(1.3) and even["p90"] == pytest.approx(3.7)
    with pytest.raises(ValueError, match=r"summarize: samples is empty"):
        summarize([])


# -- rows ---------------------------------------------------------------------------------------

def _rows():
    ours = make_row("all_reduce", "xelink:ring", [100e-6, 80e-6, 120e-6], size_bytes=1 << 20, count=1 << 18,
                    dtype=torch.float32, nranks=4, baseline="mpi:Allreduce",
                    baseline_samples=[200e-6, 150e-6, 250e-6], predicted_us=90.0, extra={"mode": "eager"})
    base = make_row("all_reduce", "mpi:Allreduce", [200e-6, 150e-6, 250e-6], size_bytes=1 << 20, count=1 << 18,
                    dtype=np.float32, nranks=4, wrong=3)
    return ours, base


def test_make_row_fills_times_bandwidths_and_ratio():
    ours, base = _rows()
    assert ours.dtype == "float32" and base.dtype == "float32"
    assert ours.time_us == pytest.approx(100.0) and ours.min_us == pytest.approx(80.0)
    assert ours.algbw_GBps == pytest.approx((1 << 20) / 100e-6 / 1e9)
    assert ours.busbw_GBps == pytest.approx(ours.algbw_GBps * 1.5)
    assert ours.baseline_us == pytest.approx(200.0) and ours.ratio == pytest.approx(2.0)
    assert base.baseline is None and base.ratio is None and base.wrong == 3
    gemm = make_row("gemm", "xelink:triton", [1e-3], size_bytes=10, count=5, dtype="bfloat16", nranks=1)
    assert gemm.busbw_GBps is None and gemm.algbw_GBps == pytest.approx(10 / 1e-3 / 1e9)


def test_a_row_must_name_the_path_that_ran():
    with pytest.raises(ValueError, match=r"Row: path='xelink:auto' must name the algorithm that ran"):
        make_row("all_reduce", "xelink:auto", [1e-6], size_bytes=4, count=1, dtype="float32", nranks=2)
    with pytest.raises(ValueError, match=r"make_row: baseline_samples given but baseline=None"):
        make_row("all_reduce", "xelink:ring", [1e-6], size_bytes=4, count=1, dtype="float32", nranks=2,
                 baseline_samples=[1e-6])


def test_format_table_has_the_nccl_tests_columns():
    ours, base = _rows()
    text = format_table([ours, base])
    lines = text.splitlines()
    assert len(lines) == 3
    for column in ["size(B)", "count", "type", "path", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
                   "base(us)", "ratio", "pred(us)", "pred/meas"]:
        assert column in lines[0]
    assert lines[1].split() == ["all_reduce", "1048576", "262144", "float32", "xelink:ring", "100.00", "10.486",
                                "15.729", "0", "200.00", "2.00", "90.00", "0.90"]
    assert lines[2].split() == ["all_reduce", "1048576", "262144", "float32", "mpi:Allreduce", "200.00", "5.243",
                                "7.864", "3", "-", "-", "-", "-"]
    assert "pred(us)" not in format_table([base])


# -- output -------------------------------------------------------------------------------------

def test_jsonl_round_trip_carries_the_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("XELINK_TEST_KNOB", "7")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    ours, base = _rows()
    path = tmp_path / "sub" / "results.jsonl"
    with JsonlWriter(path) as out:
        out.write(ours)
        out.write(base)
    objects = read_jsonl(path)
    assert [Row.from_dict(o) for o in objects] == [ours, base]
    m = objects[0]["manifest"]
    assert objects[1]["manifest"] == m
    assert m["commit"] == "unknown" or len(m["commit"]) == 40
    assert m["versions"]["torch"] == torch.__version__ and m["versions"]["xelink"] == xelink.__version__
    assert m["versions"]["numpy"] == np.__version__ and m["versions"]["python"].count(".") == 2
    assert m["env"]["XELINK_TEST_KNOB"] == "7" and m["env"]["NCCL_ALGO"] == "Ring"
    assert "UNRELATED_VARIABLE" not in m["env"]
    assert m["timestamp"].endswith("+00:00") and m["command"]
    with JsonlWriter(path, {"run": 2}, append=True) as out:
        out.write(base)
    assert [o["manifest"] for o in read_jsonl(path)][1:] == [m, {"run": 2}]


def test_manifest_from_a_communicator_and_a_command():
    class Launch:
        launcher = "mpich"

    class Topology:
        name = "2x2"

    class Comm:
        hosts, size, device, launch, topology = ["a", "a", "b", "b"], 4, torch.device("cpu"), Launch(), Topology()

    m = manifest(Comm(), command="mpiexec -n 4 python bench.py", extra={"family": "collectives"})
    assert (m["hosts"], m["world_size"], m["device"], m["launcher"], m["topology"]) == (
        ["a", "a", "b", "b"], 4, "cpu", "mpich", "2x2")
    assert m["command"] == "mpiexec -n 4 python bench.py" and m["extra"] == {"family": "collectives"}
    json.dumps(m, allow_nan=False)  # JSON-ready as a whole
    with pytest.raises(TypeError, match=r"manifest: extra=\[1\] must be a dict"):
        manifest(extra=[1])


def test_manifest_does_not_initialise_mpi():
    code = ("import sys, xelink.bench as b; m = b.manifest(); "
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI imported'; assert m['versions']['mpi'] is None")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_read_jsonl_names_a_broken_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{broken\n')
    with pytest.raises(ValueError, match=r"read_jsonl: .*r\.jsonl: line 2 is not valid JSON"):
        read_jsonl(path)


def test_write_csv(tmp_path):
    ours, base = _rows()
    path = tmp_path / "r.csv"
    write_csv([ours, base], path)
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert [g["path"] for g in got] == ["xelink:ring", "mpi:Allreduce"]
    assert math.isclose(float(got[0]["time_us"]), ours.time_us) and got[1]["baseline"] == ""
    assert json.loads(got[0]["extra"]) == {"mode": "eager"} and got[1]["wrong"] == "3"


def test_poison_unlike_leaves_no_element_equal_to_the_expected():
    from xelink.bench.harness import poison_unlike

    for want in (torch.arange(7, dtype=torch.float32), torch.arange(7, dtype=torch.int32) - 3,
                 torch.tensor([True, False]), np.arange(5, dtype=np.float32), np.arange(5, dtype=np.int64)):
        out = want.copy() if isinstance(want, np.ndarray) else want.clone()
        poison_unlike(out, want)
        assert not (out == want).any(), (want, out)
