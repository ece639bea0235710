"""bench/kernel_timing.py's host-time rows (CPU: rows from given samples; the timing itself needs a GPU)."""
import pytest
import torch

from xelink.bench import plots
from xelink.bench.kernel_timing import HOST_MARGIN_US, host_rows, host_summary, host_timing


def _rows():
    samples = {"torch:matmul": [20e-6, 21e-6, 19e-6], "xelink:cuda": [25e-6, 26e-6, 24e-6],
               "xelink:triton": [40e-6, 41e-6, 39e-6]}
    wrong = {name: 0 for name in samples}
    return host_rows("gemm:host", samples, wrong, "torch:matmul", size_bytes=3 * 2 * 2048 ** 2, count=2048 ** 2,
                     dtype=torch.bfloat16, extra={"shape": "2048x2048x2048"})


def test_host_rows_report_host_time_torch_and_the_difference():
    rows = {r.path: r for r in _rows()}
    base, cuda, triton = rows["torch:matmul"], rows["xelink:cuda"], rows["xelink:triton"]
    assert base.baseline is None and base.extra["host_us"] == pytest.approx(20.0)
    assert cuda.time_us == pytest.approx(25.0) and cuda.baseline == "torch:matmul"
    assert cuda.baseline_us == pytest.approx(20.0) and cuda.ratio == pytest.approx(0.8)
    assert cuda.extra["host_diff_us"] == pytest.approx(5.0) and cuda.extra["host_ok"]
    assert triton.extra["host_diff_us"] == pytest.approx(20.0) and not triton.extra["host_ok"]
    assert HOST_MARGIN_US == 10.0
    assert all(r.algbw_GBps is None and r.extra["shape"] == "2048x2048x2048" for r in rows.values())
    text = host_summary(list(rows.values()))
    assert "xelink:cuda" in text and "ok the +10 us target" in text and "over the +10 us target" in text
    assert len(text.splitlines()) == 2  # one line per xelink path; the baseline's time is on each


def test_host_difference_is_paired_by_round():
    # A machine drifting between rounds (torch 10 -> 30 us) with xelink 8 us behind torch in every round: the
    # difference of the medians says +12 us, the median of the rounds' differences +8 us.
    samples = {"torch:matmul": [10e-6, 20e-6, 30e-6, 30e-6, 30e-6], "xelink:cuda": [18e-6, 28e-6, 38e-6, 38e-6, 38e-6]}
    rows = {r.path: r for r in host_rows("gemm:host", samples, {n: 0 for n in samples}, "torch:matmul", size_bytes=8,
                                         count=1, dtype=torch.bfloat16, extra={})}
    cuda = rows["xelink:cuda"]
    assert cuda.extra["host_us"] == pytest.approx(38.0) and cuda.extra["torch_host_us"] == pytest.approx(30.0)
    assert cuda.extra["host_diff_us"] == pytest.approx(8.0) and cuda.extra["host_ok"]


def test_host_rows_take_another_baseline_where_given():
    # A pair of launches against torch's pair: its own baseline row, not torch's one-launch row.
    samples = {"torch:matmul": [20e-6] * 3, "torch:matmul+copy": [30e-6] * 3, "xelink:pair": [36e-6] * 3,
               "xelink:cuda": [24e-6] * 3}
    rows = {r.path: r for r in host_rows("gemm:host", samples, {n: 0 for n in samples}, "torch:matmul", size_bytes=8,
                                         count=1, dtype=torch.bfloat16, extra={},
                                         bases={"xelink:pair": "torch:matmul+copy"})}
    assert rows["torch:matmul+copy"].baseline is None and "host_diff_us" not in rows["torch:matmul+copy"].extra
    assert rows["xelink:pair"].baseline == "torch:matmul+copy" and rows["xelink:pair"].extra["host_diff_us"] == \
        pytest.approx(6.0)
    assert rows["xelink:cuda"].baseline == "torch:matmul" and rows["xelink:cuda"].extra["host_diff_us"] == \
        pytest.approx(4.0)


def test_host_rows_plot(tmp_path):
    if not plots.available():
        pytest.skip("matplotlib is not installed")
    (png,) = plots.plot_kernels(_rows(), tmp_path, "gemm")
    assert png.exists() and png.stat().st_size > 0


def test_host_timing_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU families time it")
    with pytest.raises((RuntimeError, AssertionError)):
        host_timing({"x": lambda: None}, {"x": lambda out: 0}, calls=1, rounds=1)


def test_kernel_report_collects_rows_and_notes():
    from xelink.bench.kernel_timing import KernelReport

    report = KernelReport()
    report.add("row")
    report.notes.append("note")
    assert report.rows == ["row"] and report.notes == ["note"]
