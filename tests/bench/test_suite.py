"""The suite's output and argument handling without ranks: plots, CSV, the families' options, the CLI."""
import csv
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import xelink
from xelink import cli
from xelink.bench import make_row, plots, suite
from xelink.bench.harness import Progress
from xelink.bench.families.links import format_matrix, matrices
from xelink.bench.probe import Fit

PNG = b"\x89PNG\r\n\x1a\n"


def _sweep_rows():
    rows = []
    for size in (1024, 65536, 1 << 20):
        t = 20e-6 + size / 2e9
        base = make_row("all_reduce", "mpi:all_reduce", [t * 1.5], size_bytes=size, count=size // 4, dtype="float32",
                        nranks=4)
        rows.append(make_row("all_reduce", "xelink:ring", [t], size_bytes=size, count=size // 4, dtype="float32",
                             nranks=4, baseline="mpi:all_reduce", baseline_samples=[t * 1.5], predicted_us=t * 0.9e6))
        rows.append(base)
    return rows


def _png(path):
    data = path.read_bytes()
    return data[:8] == PNG and len(data) > 5000


def test_plot_sweep_writes_one_png_per_op(tmp_path):
    written = plots.plot_sweep(_sweep_rows(), tmp_path / "p", "collectives")
    assert [p.name for p in written] == ["collectives-all_reduce-float32.png"]
    assert _png(written[0])


def test_plot_kernels_and_the_link_heatmap(tmp_path):
    rows = [make_row("gemm", path, [1e-3], size_bytes=10, count=4, dtype="bfloat16", nranks=1,
                     baseline=None if path == "torch:matmul" else "torch:matmul",
                     baseline_samples=None if path == "torch:matmul" else [2e-3], extra={"shape": shape, "gflops": 3.0})
            for shape in ("128x128x128", "256x256x256") for path in ("xelink:reference", "torch:matmul")]
    (png,) = plots.plot_kernels(rows, tmp_path, "gemm")
    assert png.name == "gemm-gemm.png" and _png(png)
    pairs = [{"pair": [0, 1], "latency_us": 12.5, "fit": Fit(1.0, 3.25, ())},
             {"pair": [1, 2], "latency_us": 20.0, "fit": Fit(1.0, 1.5, ())}]
    lat, bw = matrices(3, pairs)
    assert lat[1][0] == 12.5 and bw[2][1] == 1.5 and lat[0][2] is None and lat[1][1] is None
    heat = plots.plot_link_matrix(lat, bw, tmp_path / "links-matrix.png", "links")
    assert _png(heat)
    text = format_matrix(lat, "latency", ".1f")
    assert text.splitlines()[2].split() == ["0", "-", "12.5", "-"]


def test_size_labels():
    assert [plots.size_label(s) for s in (8, 1024, 1536, 1 << 20, 3 << 30)] == ["8", "1K", "1.5K", "1M", "3G"]


def test_progress_prints_a_line_per_step_on_rank_0_only(capsys):
    p = Progress("collectives", 2)
    p.step("all_reduce 1 KiB")
    quiet = Progress("collectives", 2, show=False)
    quiet.step("x")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("[collectives 1/2") and err[0].endswith("] all_reduce 1 KiB")
    assert quiet.done == 1


def _ctx(tmp_path, family, argv):
    args = suite.family_parser(family).parse_args(argv)
    return suite.Context(SimpleNamespace(rank=0, size=1), family, args)


def test_outputs_table_jsonl_csv_and_plots(tmp_path, capsys):
    ctx = _ctx(tmp_path, "collectives", ["--out", str(tmp_path), "--csv", "--plots"])
    ctx.manifest = lambda extra=None: {"family": "collectives"}
    suite.write_outputs(ctx, _sweep_rows())
    out = capsys.readouterr().out
    assert "pred/meas" in out.splitlines()[0] and "xelink:ring" in out
    lines = (tmp_path / "collectives.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["manifest"] == {"family": "collectives"}
    with open(tmp_path / "collectives.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 6 and got[0]["path"] == "xelink:ring" and float(got[0]["predicted_us"]) > 0
    assert (tmp_path / "collectives.txt").read_text().startswith("op ")
    assert _png(tmp_path / "collectives-all_reduce-float32.png")


def test_family_options():
    args = suite.family_parser("collectives").parse_args(["--quick", "--sizes", "1K", "2M", "--csv", "x.csv"])
    assert args.quick and args.sizes == [1024, 2 << 20] and args.csv == "x.csv" and args.plots is None
    args = suite.family_parser("links").parse_args(["--plots", "figs", "--topology-out", "t.toml"])
    assert args.plots == "figs" and args.topology_out == "t.toml" and args.csv is None
    with pytest.raises(SystemExit):
        suite.family_parser("collectives").parse_args(["--ops", "all_to_none"])
    argv = suite._family_argv("collectives", SimpleNamespace(quick=True, csv=False, no_plots=False, plots=None,
                                                              calibration=None, topology=None, tune="t.json"),
                              suite.Path("res"))
    assert argv[:3] == ["--out", "res", "--quick"] and argv[-2:] == ["--tune", "t.json"]


def test_collectives_take_the_folders_links_files_only_when_links_run_in_the_launch(tmp_path):
    # an earlier run's files may be another rank count's (a KeyError and an MPI abort mid-sweep)
    for f in ("calibration.toml", "topology.toml"):
        (tmp_path / f).write_text("")
    args = SimpleNamespace(quick=True, csv=False, no_plots=True, plots=None, calibration=None, topology=None, tune=None)
    with_links = suite._family_argv("collectives", args, tmp_path, links_here=True)
    assert "--calibration" in with_links and "--topology" in with_links
    assert "--calibration" not in suite._family_argv("collectives", args, tmp_path, links_here=False)


def _xelink(*args):
    return subprocess.run([sys.executable, "-m", "xelink", *args], capture_output=True, text=True, timeout=120)


def test_gpu_family_is_skipped_on_cpu_with_the_reason():
    r = _xelink("bench", "gpu-collectives")
    assert r.returncode == 2 and "gpu-collectives: skipped: needs one CUDA GPU per rank" in r.stderr


def test_gpu_options_are_refused_by_the_cpu_reference_run():
    r = _xelink("bench", "attention", "--impl", "cuda")
    assert r.returncode != 0 and "unrecognized arguments on cpu ranks" in r.stderr and "--impl cuda" in r.stderr
    # every family's CUDA-only group, as typed (the distributed GEMM's graph calls were taken and dropped on CPU)
    for name, argv, want in (("dist-gemm", ["--graph-calls", "3"], ["--graph-calls 3"]),
                             ("decode", ["--model", "tiny", "--no-transformers"],
                              ["--model tiny", "--no-transformers"]),
                             ("gemv", ["--sweep"], ["--sweep gemv"]), ("gemm", [], []),
                             ("attention", ["--only", "decode", "--warm-jobs", "2"],
                              ["--only decode", "--warm-jobs 2"])):
        assert suite.cuda_only_given(name, suite.family_parser(name).parse_args(argv)) == want, name


def test_collectives_refuse_a_topology_of_another_machine():
    """--topology prices this job's rows: a file without this job's devices (here a 2x2 model of named GPUs) is
    refused naming it and the device, not a KeyError traceback from the cost model."""
    topo = Path(xelink.__file__).parent / "topologies" / "cpu-2x2.toml"
    r = _xelink("bench", "collectives", "--quick", "--topology", str(topo))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert f"xelink bench collectives: --topology '{topo}'" in r.stderr and "has no device 'rank0'" in r.stderr


def _usage_error(capsys, *args) -> str:
    """stderr of ``xelink *args`` run in this process, which must stop with exit status 2 (argparse's
    usage error) before any set-up (a subprocess a call cost the suite 3-4 s of imports each)."""
    with pytest.raises(SystemExit) as info:
        cli.main(list(args))
    assert info.value.code == 2, args
    return capsys.readouterr().err


def test_all_refuses_an_unknown_family(capsys):
    assert "unknown families ['gemmm']" in _usage_error(capsys, "bench", "all", "--only", "links,gemmm")
    assert "--only ',' names no family" in _usage_error(capsys, "bench", "all", "--only", ",")
    assert not xelink.is_initialized()
    # a subset runs in the suite's order (links first: the collectives take its calibration), each family once
    assert suite.all_families("collectives,links,collectives") == ("links", "collectives")
    assert suite.all_families(None) == suite.ALL_ORDER


def test_output_paths_and_bad_values_are_usage_errors_before_any_measurement(tmp_path, capsys):
    # A results path that cannot be written fails at once (exit 2, the option named), not after the run with the
    # results lost; bad sizes and windows are usage errors too, not tracebacks mid-run.
    blocker = tmp_path / "file"
    blocker.write_text("")
    for argv, want in ((["bench", "collectives", "--quick", "--out", str(blocker / "x")], "--out '"),
                       (["bench", "collectives", "--quick", "--tune", str(blocker / "t.json")], "--tune '"),
                       (["bench", "gemm", "--quick", "--jsonl", str(tmp_path)], "is a folder, not a file"),
                       (["bench", "all", "--quick", "--out", str(blocker / "r")], "--out '"),
                       (["bench", "cp-attention", "--quick", "--window", "0"], "--window: 0 must be >= 1"),
                       (["bench", "cp-attention", "--quick", "--shapes", "0"], "N, H and D must be >= 1"),
                       (["bench", "sycl-collectives", "--quick", "--counts", "-5"], "--counts: -5 must be >= 0"),
                       (["bench", "collectives", "--quick", "--sizes", "1K", "0"], "--sizes: '0' must be at least 1"),
                       (["bench", "collectives", "--quick", "--sizes", "1x"], "--sizes: parse_size: '1x' is not a"),
                       (["demo", "-n", "-1"], "-n: -1 must be >= 0")):
        assert want in _usage_error(capsys, *argv), argv
    assert not xelink.is_initialized()


def test_python_m_xelink_bench_runs_a_kernel_family(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xelink.bench", "gemv", "--quick", "--iters", "1", "--rounds", "1",
                        "--out", str(tmp_path), "--csv", "--plots"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[gemv 2/2" in r.stderr and "xelink:reference" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "gemv.jsonl").read_text().splitlines()]
    assert {row["dtype"] for row in rows} == {"bf16", "w8a16", "w4a16"} and all(row["wrong"] == 0 for row in rows)
    assert (tmp_path / "gemv.csv").is_file() and _png(tmp_path / "gemv-gemv.png")


def test_collectives_on_cuda_ranks_time_the_gpu_algorithms_the_model_can_price():
    import torch

    from xelink import cost
    from xelink.bench.families import collectives as B
    from xelink.collectives import ALGORITHMS, GPU_ALGORITHMS

    cuda, cpu = SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cpu"))
    for op in B.OPS:
        assert B.algorithms(cpu, op) == tuple(ALGORITHMS[op])
        assert B.model_algo(cpu, op, ALGORITHMS[op][0]) == ALGORITHMS[op][0]
        family = op.replace("_tensor", "")
        assert set(B.algorithms(cuda, op)) <= set(GPU_ALGORITHMS[family]) - {"nccl"}  # nccl is the baseline
        for algo in B.algorithms(cuda, op):
            named = B.model_algo(cuda, op, algo)
            assert named in cost.ALGOS[op]
    # Every op has at least one GPU algorithm that model-check can price.
    assert all(any(B.model_algo(cuda, op, a) for a in B.algorithms(cuda, op)) for op in B.OPS)


def test_a_cuda_case_builds_its_tensors_on_the_device_it_is_given():
    import torch

    from xelink.bench.families.collectives import _case

    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        src, out, want, _, _ = _case(op, 2, 1, 64, torch.float32, torch.device("cpu"))
        assert src.device == out.device == want.device == torch.device("cpu")
    src, out, want, _, _ = _case("all_to_all", 2, 1, 64, torch.float32)
    assert want.tolist() == [8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
                             1008.0, 1009.0, 1010.0, 1011.0, 1012.0, 1013.0, 1014.0, 1015.0]


def test_counts_below_their_minimum_are_usage_errors(capsys):
    for args, text in ((["collectives", "--iters", "0"], "argument --iters: 0 must be >= 1"),
                       (["gemv", "--rounds", "-1"], "argument --rounds: -1 must be >= 1"),
                       (["collectives", "--warmup", "x"], "argument --warmup: 'x' is not an int")):
        err = _usage_error(capsys, "bench", *args)
        assert text in err, (args, err[-300:])
