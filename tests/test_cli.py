"""``xelink info`` and ``xelink demo`` on one rank and under mpiexec."""
import importlib.util
import json
import os
import subprocess
import sys

import ranks


def _run(*args, n=None):
    cmd = [sys.executable, "-m", "xelink", *args]
    if n is not None:
        cmd = [ranks.mpiexec(), "-n", str(n), *cmd]
    # CPU ranks, as in CI (on a GPU machine several ranks would share its one GPU)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "XELINK_DEVICE": "cpu"})


def test_info_single_process():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "launcher: single, 1 rank(s)" in r.stdout
    assert "host transport in use: self" in r.stdout
    assert "torch 2." in r.stdout
    if importlib.util.find_spec("dpctl") is not None:  # (the GPU image has no dpctl)
        assert "sycl ['opencl:cpu" in r.stdout  # dpctl's CPU device (the test extra's OpenCL runtime)


def test_info_json_under_mpiexec():
    r = _run("info", "--json", n=2)
    assert r.returncode == 0, r.stderr
    infos = json.loads(r.stdout)
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["launcher"] for i in infos} == {"openmpi" if ranks.open_mpi() else "mpich"}
    assert infos[0]["transports"]["in_use"] == "mpi"
    assert infos[0]["transports"]["mpi"].startswith("Open MPI" if ranks.open_mpi() else "MPICH")


def test_demo_under_mpiexec():
    r = _run("demo", "-n", "3", n=3)
    assert r.returncode == 0, r.stderr
    flavour = "openmpi" if ranks.open_mpi() else "mpich"
    assert f"all_reduce over 3 rank(s) ({flavour}, device cpu): [3.0, 6.0, 9.0]" in r.stdout
    assert "correct on every rank" in r.stdout


def test_settings_it_cannot_use_are_one_line_usage_errors(monkeypatch, capsys):
    """A bad XELINK_* value, topology name or size: exit 2 and one line naming the command and the value, no
    traceback (in-process: the messages; under mpiexec: every rank exits, none hangs)."""
    import pytest

    from xelink import cli, config, errors, topology

    cases = [({"XELINK_TIMEOUT": "abc"}, ["demo"], "xelink demo: XELINK_TIMEOUT='abc' is not a number of seconds"),
             ({"XELINK_TOPOLOGY": "nope"}, ["info"], "xelink info: XELINK_TOPOLOGY='nope': load: unknown topology"),
             ({"XELINK_DEVICE": "gpu"}, ["info"], "xelink info: XELINK_DEVICE='gpu' is not one of"),
             ({"XELINK_LOG": "loud"}, ["info"], "xelink info: XELINK_LOG: unknown level 'loud'"),
             ({}, ["topology", "--name", "nonexist"], "xelink topology: load: unknown topology 'nonexist'"),
             ({}, ["cost", "--topology", "cpu-2x2", "--sizes", "1K", "abc"], "xelink cost: parse_size: 'abc'"),
             ({}, ["cost", "--topology", "cpu-2x2", "--op", "all_gather_matmul", "--shapes", "12x"],
              "xelink cost: parse_shape: '12x'"),
             ({}, ["cost", "--topology", "cpu-2x2", "--nranks", "0"], None),  # (was every device's count)
             ({"XELINK_TIMEOUT": "-1"}, ["bench", "collectives", "--quick"],
              "xelink bench collectives: XELINK_TIMEOUT=-1.0 must be a positive")]
    for env, argv, want in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            if want is None:  # an argparse usage error
                with pytest.raises(SystemExit, match="2"):
                    cli.main(argv)
                assert "argument --nranks: 0 must be >= 1" in capsys.readouterr().err
                continue
            assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(want) and err.count("\n") == 1, (argv, err)
    # the same errors stay ValueErrors for library callers; an argument (not a setting) stays a plain one
    assert issubclass(errors.ConfigError, ValueError)
    with pytest.raises(errors.ConfigError, match="load: unknown topology 'nonexist'"):
        topology.load("nonexist")
    with pytest.raises(ValueError, match="init: timeout=-1") as info:
        config.resolve_timeout(-1)
    assert type(info.value) is ValueError
    r = subprocess.run([ranks.mpiexec(), "-n", "2", "env", "XELINK_TIMEOUT=abc", sys.executable, "-m", "xelink",
                        "demo"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    said = r.stderr.count("xelink demo: XELINK_TIMEOUT='abc' is not a number of seconds")
    # (Open MPI's launcher may stop the other rank before it says it: the first rank's exit ends the job)
    assert said == 2 or (ranks.open_mpi() and said == 1), r.stderr



def test_bench_probe_writes_a_topology_and_a_calibration(tmp_path):
    from xelink import cost
    from xelink import topology as T

    topo, cal = tmp_path / "probed.toml", tmp_path / "cal.toml"
    r = _run("bench", "probe", "--quick", "--topology-out", str(topo), "--calibration-out", str(cal))
    assert r.returncode == 0, r.stderr
    assert "probe of 1 rank(s)" in r.stdout and "local (every rank at once): copy" in r.stdout
    t, c = T.load(topo), cost.load_calibration(cal)
    assert t.name == c.topology == "discovered-cpu-probed" and c.local.copy_gbps > 0


def test_bench_model_check_probes_then_checks_under_mpiexec(tmp_path):
    from xelink import cost
    from xelink.bench import read_jsonl

    cal, rows = tmp_path / "cal.toml", tmp_path / "check.jsonl"
    r = _run("bench", "model-check", "--quick", "--ops", "all_gather", "--sizes", "1K", "--check-iters", "2",
             "--check-rounds", "1", "--calibration-out", str(cal), "--jsonl", str(rows), n=2)
    assert r.returncode == 0, r.stderr
    assert "probe of 2 rank(s)" in r.stdout and "pred/meas" in r.stdout and "rows within ±30%" in r.stdout
    got = read_jsonl(rows)
    assert [g["path"] for g in got] == ["xelink:ring", "xelink:direct", "xelink:topo"]
    assert all(g["predicted_us"] > 0 and g["wrong"] == 0 for g in got)
    extra = got[0]["manifest"]["extra"]
    assert extra["family"] == "model-check" and extra["calibration"]["name"] == cost.load_calibration(cal).name
