"""``xelink info`` and ``xelink demo`` on one rank and under mpiexec."""
import json
import subprocess
import sys

import ranks


def _run(*args, n=None):
    cmd = [sys.executable, "-m", "xelink", *args]
    if n is not None:
        cmd = [ranks.mpiexec(), "-n", str(n), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_info_single_process():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "launcher: single, 1 rank(s)" in r.stdout
    assert "host transport in use: self" in r.stdout
    assert "torch 2." in r.stdout


def test_info_json_under_mpiexec():
    r = _run("info", "--json", n=2)
    assert r.returncode == 0, r.stderr
    infos = json.loads(r.stdout)
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["launcher"] for i in infos} == {"mpich"}
    assert infos[0]["transports"]["in_use"] == "mpi"
    assert infos[0]["transports"]["mpi"].startswith("MPICH")


def test_demo_under_mpiexec():
    r = _run("demo", "-n", "3", n=3)
    assert r.returncode == 0, r.stderr
    assert "all_reduce over 3 rank(s) (mpich, device cpu): [3.0, 6.0, 9.0]" in r.stdout
    assert "correct on every rank" in r.stdout
