"""launch_scripts/xelink-run: the command it builds for each MPI, the per-rank binding, and a real 4-rank run."""
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ranks

SCRIPT = Path(__file__).resolve().parent.parent / "launch_scripts" / "xelink-run"


def _load():
    loader = importlib.machinery.SourceFileLoader("xelink_run", str(SCRIPT))
    spec = importlib.util.spec_from_loader("xelink_run", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


run = _load()
RANK = ["python3", "xelink-run", "--bind-rank", "--", "app", "--lr", "3"]


@pytest.mark.parametrize("text, flavour", [
    ("HYDRA build details:\n    Version:                                 4.2.0\n", "mpich"),
    ("mpiexec (OpenRTE) 4.1.2\n\nReport bugs to http://www.open-mpi.org/community/help/\n", "openmpi"),
    ("mpirun (Open MPI) 5.0.3\n", "openmpi"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.13 Build 20240701\nCopyright 2003-2024", "intel"),
])
def test_detect_flavour(text, flavour):
    assert run.detect_flavour(text) == flavour


def test_detect_flavour_names_what_it_read():
    with pytest.raises(ValueError, match=r"cannot tell which MPI .*'SomeMPI 1.0'.*--flavour"):
        run.detect_flavour("SomeMPI 1.0\n")


def test_open_mpi_as_root_oversubscribed_with_hosts_and_env():
    cmd = run.mpi_command("openmpi", 8, RANK, mpiexec="mpirun", as_root=True, oversubscribe=True, ppn=4,
                          hostfile="hosts", env={"NCCL_NVLS_ENABLE": "0"})
    assert cmd == ["mpirun", "--allow-run-as-root", "--oversubscribe", "--hostfile", "hosts", "--map-by", "ppr:4:node",
                   "--bind-to", "none", "-x", "NCCL_NVLS_ENABLE=0", "-n", "8", *RANK]


def test_open_mpi_as_a_user_binds_cores():
    assert run.mpi_command("openmpi", 2, RANK) == ["mpiexec", "--bind-to", "core", "-n", "2", *RANK]


def test_mpich_hydra_needs_no_oversubscription_flag():
    cmd = run.mpi_command("mpich", 4, RANK, as_root=True, oversubscribe=True, ppn=2, hostfile="hosts",
                          env={"B": "2", "A": "1"})
    assert cmd == ["mpiexec", "-f", "hosts", "-ppn", "2", "-bind-to", "core", "-genv", "A", "1", "-genv", "B", "2",
                   "-n", "4", *RANK]


def test_intel_mpi_pins_by_default_and_can_be_told_not_to():
    assert run.mpi_command("intel", 2, RANK) == ["mpiexec", "-n", "2", *RANK]
    assert run.mpi_command("intel", 2, RANK, cpu_bind="none")[1:4] == ["-genv", "I_MPI_PIN", "0"]


def test_mpi_command_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"flavour='lam' is not one of mpich, openmpi, intel"):
        run.mpi_command("lam", 2, RANK)
    with pytest.raises(ValueError, match=r"nprocs=0 must be an int >= 1"):
        run.mpi_command("mpich", 0, RANK)
    with pytest.raises(ValueError, match=r"rank_command is empty"):
        run.mpi_command("mpich", 2, [])


def test_local_rank_from_each_launcher():
    assert run.local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == (3, 4)
    assert run.local_rank({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}) == (1, 2)
    assert run.local_rank({"SLURM_LOCALID": "5"}) == (5, None)
    assert run.local_rank({}) == (0, None)


def test_bind_env_one_device_per_local_rank():
    off = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert run.bind_env("cuda", 1, {}) == {**off, "CUDA_VISIBLE_DEVICES": "1"}
    # An inherited list (a scheduler's allocation) is indexed, not replaced.
    assert run.bind_env("cuda", 1, {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] == "6"
    assert run.bind_env("cuda", 3, {}, ranks_per_device=2)["CUDA_VISIBLE_DEVICES"] == "1"
    assert run.bind_env("xpu", 2, {}) == {**off, "ZE_AFFINITY_MASK": "2", "ONEAPI_DEVICE_SELECTOR": "level_zero:0"}
    assert run.bind_env("cpu", 7, {}) == {**off, "XELINK_DEVICE": "cpu"}
    with pytest.raises(ValueError, match=r"local rank 2 would take device 2, but the host has 2 cuda device"):
        run.bind_env("cuda", 2, {}, devices=2)


def test_bind_env_can_leave_every_device_visible():
    off = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    # xelink.init then binds local rank r to device r itself; an inherited list is left as it is.
    assert run.bind_env("cuda", 1, {}, visible="all") == off
    assert run.bind_env("cuda", 1, {"CUDA_VISIBLE_DEVICES": "4,6"}, visible="all") == off
    with pytest.raises(ValueError, match=r"local rank 2 would take device 2, but the host has 2 cuda device"):
        run.bind_env("cuda", 2, {}, devices=2, visible="all")
    with pytest.raises(ValueError, match=r"visible='some' is not one of one, all"):
        run.bind_env("cuda", 0, {}, visible="some")


def test_a_real_four_rank_run_through_the_wrapper():
    env = {**os.environ, "XELINK_MPIEXEC": ranks.mpiexec()}
    # One write a rank (os.write, under PIPE_BUF): print() writes its pieces separately when Python runs
    # unbuffered (PYTHONUNBUFFERED), and Hydra then interleaves the ranks' pieces within a line.
    code = ("import os; e = os.environ; os.write(1, ('rank %s %s %s %s\\n' % (e.get('PMI_RANK', "
            "e.get('OMPI_COMM_WORLD_RANK')), "
            "e['CUDA_VISIBLE_DEVICES'], e['NCCL_NVLS_ENABLE'], e['TORCH_SYMM_MEM_DISABLE_MULTICAST'])).encode())")
    # No GPU here: binding is only environment, so the per-rank choice can still be checked.
    r = subprocess.run([sys.executable, str(SCRIPT), "-n", "4", "--devices", "cuda", "--devices-per-node", "2",
                        "--ranks-per-device", "2", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    got = sorted(line.split()[1:] for line in r.stdout.splitlines() if line.startswith("rank "))
    assert got == [["0", "0", "0", "1"], ["1", "0", "0", "1"], ["2", "1", "0", "1"], ["3", "1", "0", "1"]]
    # --visible all (here through XELINK_RUN_VISIBLE) keeps the inherited list on every rank.
    r = subprocess.run([sys.executable, str(SCRIPT), "-n", "2", "--devices", "cuda", "--devices-per-node", "2",
                        sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "XELINK_RUN_VISIBLE": "all", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert r.returncode == 0, r.stderr
    got = sorted(line.split()[1:3] for line in r.stdout.splitlines() if line.startswith("rank "))
    assert got == [["0", "0,1"], ["1", "0,1"]]


def test_xelink_info_through_the_wrapper_and_dry_run():
    env = {**os.environ, "XELINK_MPIEXEC": ranks.mpiexec()}
    cpu = ["--devices", "cpu"]  # (the default binds the GPUs where nvidia-smi lists some: four ranks on one failed)
    dry = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "-n", "4", *cpu, "xelink", "info"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert dry.returncode == 0, dry.stderr
    start = " --allow-run-as-root" if ranks.open_mpi() and os.geteuid() == 0 else " -bind-to core -genv"
    assert dry.stdout.startswith(ranks.mpiexec() + start) and \
        dry.stdout.rstrip().endswith("--bind-rank --devices cpu --ranks-per-device 1 --visible one -- xelink info")
    r = subprocess.run([sys.executable, str(SCRIPT), "-n", "4", *cpu, sys.executable, "-m", "xelink", "info"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert f"launcher: {'openmpi' if ranks.open_mpi() else 'mpich'}, 4 rank(s)" in r.stdout, r.stdout
    assert "rank   3  local 3/4  device cpu" in r.stdout, r.stdout


def test_bad_counts_and_launchers_are_usage_errors(capsys, monkeypatch):
    # counts below 1 (shown as the launch's -n 1 before), a SLURM_NTASKS that is no number and a launcher that is not
    # there: usage errors naming the option or variable, exit 2, before anything starts
    for argv, want in ((["-n", "0"], "argument -n/--np: 0 must be >= 1"), (["--ppn", "0"], "--ppn: 0 must be >= 1"),
                       (["--ranks-per-device", "0"], "--ranks-per-device: 0 must be >= 1"),
                       (["--mpiexec", "/nonexistent"], "--mpiexec '/nonexistent' is not an executable launcher")):
        with pytest.raises(SystemExit) as info:
            run.main(["--dry-run", *argv, "echo"])
        assert info.value.code == 2 and want in capsys.readouterr().err, argv
    monkeypatch.setenv("SLURM_NTASKS", "abc")
    with pytest.raises(SystemExit) as info:
        run.main(["--dry-run", "echo"])
    assert info.value.code == 2 and "SLURM_NTASKS='abc' is not a number of ranks" in capsys.readouterr().err


def test_a_command_that_cannot_run_is_named(monkeypatch):
    """A script given without python (execvp looks it up on PATH): every rank said only FileNotFoundError."""
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(SystemExit, match=r"xelink-run: cannot run 'train\.py': No such file or directory \(a Python "
                                         r"script: xelink-run \.\.\. python train\.py\)"):
        run.main(["--bind-rank", "--devices", "cpu", "--", "train.py"])
