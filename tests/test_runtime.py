"""Launcher detection, deadlines, device binding rules and bad launches (single process)."""
import datetime
import logging
import os
import subprocess
import sys

import pytest

import xelink
from xelink import runtime
from xelink.errors import LaunchError

MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4", "PMI_FD": "9"}
INTEL = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "I_MPI_ROOT": "/opt"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
SLURM = {"PMIX_RANK": "1", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("env,expect", [
    ({}, ("single", 0, 1, 0, 1)),
    (MPICH, ("mpich", 2, 4, 2, 4)),
    (INTEL, ("intelmpi", 1, 2, 1, 2)),
    (OPENMPI, ("openmpi", 3, 8, 1, 4)),
    (TORCHRUN, ("torchrun", 5, 6, 1, 2)),
    (SLURM, ("mpi", 1, 3, 0, None)),
    # an env:// launch by hand, without LOCAL_RANK (it ran every process as rank 0 of 1), as torch reads one
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     ("torchrun", 1, 2, None, None)),
    # torch's variables left in the environment of an mpiexec launch: MPI's rank and size (not "1 of 1")
    ({**MPICH, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, ("mpich", 2, 4, 2, 4)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, ("single", 0, 1, 0, 1)),  # a batch script's python
])
def test_detect_launch(env, expect):
    launch = runtime.detect_launch(env)
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank, launch.local_size) == expect
    assert launch.transport == {"single": "self", "torchrun": "torch"}.get(expect[0], "mpi")


@pytest.mark.parametrize("env,message", [
    ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "launcher mpi gave rank=4 size=4"),
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK='x' is not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "launcher openmpi gave rank=0 size=None"),
    # srun without PMI: every task alone as rank 0 of 1 before
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"},
     "srun started this process as task 1 of 2 without PMI"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, "task 0 of 2 without PMI"),
])
def test_detect_launch_rejects_inconsistent_placement(env, message):
    with pytest.raises(LaunchError, match=message):
        runtime.detect_launch(env)


def test_resolve_timeout(monkeypatch):
    monkeypatch.delenv("XELINK_TIMEOUT", raising=False)
    assert runtime.resolve_timeout(None) == runtime.DEFAULT_TIMEOUT_S
    assert runtime.resolve_timeout(2) == 2.0
    assert runtime.resolve_timeout(datetime.timedelta(minutes=1)) == 60.0
    monkeypatch.setenv("XELINK_TIMEOUT", "7.5")
    assert runtime.resolve_timeout(None) == 7.5
    monkeypatch.setenv("XELINK_TIMEOUT", "")  # set but empty: unset, as every knob
    assert runtime.resolve_timeout(None) == runtime.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("XELINK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="XELINK_TIMEOUT='soon' is not a number of seconds"):
        runtime.resolve_timeout(None)
    with pytest.raises(ValueError, match=r"init: timeout=0 must be a positive, finite number"):
        runtime.resolve_timeout(0)
    with pytest.raises(ValueError, match=r"barrier: timeout=inf must be a positive, finite number"):
        runtime.resolve_timeout(float("inf"), "barrier")
    with pytest.raises(TypeError, match=r"init: timeout='1' must be a number of seconds"):
        runtime.resolve_timeout("1")


def test_choose_device_index():
    assert [runtime.choose_device_index("cuda", r, 4, 4, 1, "h") for r in range(4)] == [0, 1, 2, 3]
    assert [runtime.choose_device_index("cuda", r, 4, 2, 2, "h") for r in range(4)] == [0, 0, 1, 1]
    # Each rank sees one device (the launcher set CUDA_VISIBLE_DEVICES per rank): bind to index 0.
    assert runtime.choose_device_index("cuda", 3, 4, 1, 1, "h") == 0
    with pytest.raises(LaunchError, match=r"init: 4 ranks on host h but only 2 cuda device\(s\) visible"):
        runtime.choose_device_index("cuda", 0, 4, 2, 1, "h")
    with pytest.raises(LaunchError, match="no xpu device is visible on host h"):
        runtime.choose_device_index("xpu", 0, 1, 0, 1, "h")


def test_check_device_sharing():
    runtime.check_device_sharing([None, None, None], 1)  # CPU ranks may share the host
    runtime.check_device_sharing([("h", "A"), ("h", "B")], 1)
    runtime.check_device_sharing([("h", "A"), ("h", "A")], 2)
    with pytest.raises(LaunchError, match=r"ranks \[0, 2\] all drive device A on host h, but ranks_per_device=1"):
        runtime.check_device_sharing([("h", "A"), ("h", "B"), ("h", "A")], 1)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI", "MPI_", "RANK", "TORCHELASTIC"))}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_init_single_process_and_bad_arguments():
    world = xelink.init()
    try:
        assert (world.rank, world.size, world.transport.name) == (0, 1, "self")
        assert xelink.init() is world
        world.barrier()
        assert world.allgather_object("x") == ["x"]
        assert world.split(3).size == 1
        assert world.split(None) is xelink.NON_GROUP_MEMBER
    finally:
        xelink.finalize()
    with pytest.raises(xelink.NotInitializedError, match=r"xelink.init\(\) has not been called"):
        xelink.get_world()
    with pytest.raises(ValueError):  # as torch's "Default process group has not been initialized"
        xelink.get_rank()
    with pytest.raises(ValueError, match=r"init: device='tpu' is not one of 'cpu', 'cuda', 'xpu'"):
        xelink.init(device="tpu")
    with pytest.raises(ValueError, match=r"init: ranks_per_device=0 must be a positive int"):
        xelink.init(ranks_per_device=0)
    with pytest.MonkeyPatch.context() as mp:  # the variables' values: named as the variables
        mp.setenv("XELINK_RANKS_PER_DEVICE", "0")
        with pytest.raises(ValueError, match=r"^XELINK_RANKS_PER_DEVICE=0 must be a positive int"):
            xelink.init()
        mp.delenv("XELINK_RANKS_PER_DEVICE")
        mp.setenv("XELINK_DEVICE", "tpu")
        with pytest.raises(ValueError, match=r"^XELINK_DEVICE='tpu' is not one of 'cpu', 'cuda', 'xpu'"):
            xelink.init()
    with pytest.raises(ValueError, match=r"init: timeout=-5 must be a positive"):
        xelink.init(timeout=-5)
    with pytest.raises(ValueError, match=r"init: device='cpu:abc': give the kind alone \('cpu'\)"):
        xelink.init(device="cpu:abc")  # (the index was dropped: "cuda:1" bound local_rank // ranks_per_device)
    assert not xelink.is_initialized() and xelink.group.WORLD is None  # (torch's group.WORLD before init: None)


@pytest.mark.parametrize("name,value,error", [
    ("XELINK_CHECK", "disabled", r"^XELINK_CHECK='disabled' is not a switch: use one of 1, true, yes, on, 0"),
    ("XELINK_CHECK", "abc", r"^XELINK_CHECK='abc' is not a switch"),
    ("XELINK_DEVICE", "cuda:1", r"^XELINK_DEVICE='cuda:1': give the kind alone \('cuda'\)"),
    ("XELINK_LOG", "verbose", r"^XELINK_LOG: unknown level 'verbose'"),
])
def test_bad_settings_are_named_at_init(monkeypatch, name, value, error):
    """Before: any word but 0/false/no/off turned a switch on ("disabled" checked every call), and XELINK_DEVICE's
    ":index" was dropped without a word."""
    monkeypatch.setenv(name, value)
    with pytest.raises(xelink.ConfigError, match=error):
        xelink.init()
    assert not xelink.is_initialized()


def test_switches_and_bounded_integers(monkeypatch):
    """Switches read 1/true/yes/on and 0/false/no/off in any case (XELINK_LOG ' info ' as XELINK_TIMEOUT ' 4 ');
    integer knobs below their least value are named (XELINK_P2P_BLOCKS=0 made kernels of no blocks)."""
    from xelink import config, log

    for word, on in (("YES", True), (" on ", True), ("1", True), ("Off", False), ("0", False), ("", False)):
        monkeypatch.setenv("XELINK_CHECK", word)
        assert config.env_flag("XELINK_CHECK") is on, word
    monkeypatch.setenv("XELINK_P2P_BLOCKS", "0")
    with pytest.raises(xelink.ConfigError, match=r"^XELINK_P2P_BLOCKS='0' must be >= 1"):
        config.env_int("XELINK_P2P_BLOCKS", 16, 1)
    monkeypatch.setenv("XELINK_P2P_BLOCKS", " 4 ")
    assert config.env_int("XELINK_P2P_BLOCKS", 16, 1) == 4
    before = log.get_logger().level
    try:
        monkeypatch.setenv("XELINK_LOG", " info ")
        log.configure(0)
        assert log.get_logger().level == logging.INFO
        monkeypatch.setenv("XELINK_LOG", " ")  # empty: unset, as every knob
        log.configure(0)
    finally:
        log.get_logger().setLevel(before)


def test_finalize_raises_a_gpu_wait_error_no_call_reported(monkeypatch):
    """A GPU wait past its deadline leaves its output unwritten; when no later call on its group raised it,
    finalize does (after releasing everything); one already raised (the group failed) is not raised again.
    CUDA and the peer-memory check are stood in for (this runs on CPU)."""
    import torch

    from xelink import symm

    late = xelink.TimeoutError("irecv", [1], 2.0, "a point-to-point transfer waited past its deadline")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(symm, "available", lambda comm: True)
    checked = []

    def synchronize(comm):
        checked.append(comm.name)
        if comm.name == bad_name:
            raise late

    monkeypatch.setattr(symm, "synchronize", synchronize)
    world = xelink.init(device="cpu")
    bad_name = world.split(0).name
    with pytest.raises(xelink.TimeoutError) as info:
        xelink.finalize()
    assert info.value is late and bad_name in checked and not xelink.is_initialized()
    world = xelink.init(device="cpu")
    sub = world.split(0)
    bad_name = sub.name
    sub.fail(late)  # already raised to a caller
    checked.clear()
    xelink.finalize()
    assert bad_name not in checked and world.name in checked and not xelink.is_initialized()


def test_bad_launch_gpu_missing():
    """Asking for GPUs on a machine without them is a LaunchError naming the device kind and host."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    r = _python("import xelink; xelink.init(device='cuda')")
    assert r.returncode != 0
    assert "LaunchError: init: device 'cuda' asked for, but no cuda device is visible on host" in r.stderr


def test_bad_launch_mismatched_mpi():
    """A launcher whose rank count differs from what mpi4py's MPI sees (mixed MPI installs) is caught."""
    r = _python("import xelink; xelink.init()", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="4")
    assert r.returncode != 0
    assert ("LaunchError: init: openmpi launched rank 1 of 4, but mpi4py's MPI sees rank 0 of 1: mpiexec and "
            "mpi4py come from different MPI libraries") in r.stderr


def test_xelink_log_debug():
    r = _python("import xelink; xelink.init(); xelink.finalize()", XELINK_LOG="debug")
    assert r.returncode == 0, r.stderr
    assert "xelink.runtime DEBUG] init: single rank 0/1 local 0/1" in r.stderr
    r = _python("import xelink; xelink.init()", XELINK_LOG="chatty")
    assert "XELINK_LOG: unknown level 'chatty'" in r.stderr


def test_a_tuning_path_without_a_table_for_this_machine_is_reported(tmp_path):
    r = _python("import xelink; xelink.init(); xelink.finalize()", XELINK_TUNING=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"XELINK_TUNING={tmp_path} holds no tuning table (*.tuning.json) for this machine" in r.stderr


def test_group_argument_is_checked():
    from xelink.comm import resolve_group

    with pytest.raises(TypeError, match=r"all_reduce: group=42 is not an xelink Communicator"):
        resolve_group(42, "all_reduce")


def test_uncaught_exception_on_one_rank_aborts_the_job():
    """The other ranks do not sit in the barrier until their deadline: the whole job ends at once."""
    import time

    import ranks

    code = ("import xelink; w = xelink.init()\n"
            "if w.rank == 1: raise RuntimeError('boom on rank 1')\n"
            "w.barrier()\n")
    start = time.monotonic()
    r = subprocess.run([ranks.mpiexec(), "-n", "2", sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "XELINK_TIMEOUT": "300", "XELINK_DEVICE": "cpu"})
    assert r.returncode != 0
    assert "RuntimeError: boom on rank 1" in r.stderr
    assert time.monotonic() - start < 60  # far below the 300 s deadline the others would wait


def test_a_rank_that_exits_before_init_ends_the_job_at_the_deadline():
    """A rank gone before MPI_Init (an error in the script before xelink.init): the others waited in MPI_Init for
    it forever (MPICH's launcher waits too); now they stop at init's deadline, saying why, and the job ends."""
    import time

    import ranks

    code = ("import os, sys\n"
            "rank = os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK'))\n"
            "if rank == '1': sys.exit('gone before init')\n"
            "import xelink; xelink.init(); print('initialised')\n")
    start = time.monotonic()
    r = subprocess.run([ranks.mpiexec(), "-n", "2", sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "XELINK_TIMEOUT": "4", "XELINK_DEVICE": "cpu"})
    assert r.returncode != 0 and "initialised" not in r.stdout
    if not ranks.open_mpi():  # (Open MPI's launcher may end the job itself first)
        assert "xelink: MPI_Init (rank 0) did not return within 4 s" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - start < 60


_LIFECYCLE = """
import sys, time, torch, xelink
def say(*parts):  # one write a line: the ranks share the launcher's stdout
    sys.stdout.write(" ".join(map(str, parts)) + "\\n")
    sys.stdout.flush()
w = xelink.init(timeout=3, abort_on_exception=False)
r = w.rank
# 1. finalize on rank 1 while the others start an all_reduce (whose first call sets up a shared window)
try:
    if r == 1:
        xelink.finalize()
    else:
        xelink.all_reduce(torch.ones(4))
    say(r, "first: ok")
except Exception as exc:
    say(r, "first:", type(exc).__name__, exc)
xelink.finalize()  # (a broken world: each rank releases its own)
say(r, "initialized:", xelink.is_initialized())
# 2. a rank late past the deadline, then destroy and init again, as with torch.distributed
w = xelink.init(timeout=3, abort_on_exception=False)
if w.rank == 1:
    time.sleep(4)
try:
    xelink.all_reduce(torch.ones(4))
except xelink.TimeoutError:
    pass
xelink.destroy_process_group()
xelink.init_process_group(timeout=30)
t = torch.ones(4)
xelink.all_reduce(t)
say(r, "again:", t.tolist())
def mine(*args):
    pass
sys.excepthook = mine
xelink.finalize()
say(r, "hook kept:", sys.excepthook is mine)
"""


def test_finalize_beside_a_collective_and_after_a_timeout():
    """finalize on a rank whose peers are inside another call raises naming them, within the deadline (its barrier
    took the message of the peers' window set-up, and it waited in MPI_Win_free forever); after a timeout broke
    the world, finalize / destroy_process_group release each rank's own resources and init works again (it raised
    "unusable", the process could neither tear down nor init, as torch's can); a hook the user set after init is
    kept."""
    import time

    import ranks

    start = time.monotonic()
    r = subprocess.run([ranks.mpiexec(), "-n", "3", sys.executable, "-c", _LIFECYCLE], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "XELINK_DEVICE": "cpu"})
    out = r.stdout
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 first: XelinkError finalize: rank(s) 0, 2 of the world are in another collective call" in out, out
    for rank in (0, 2):
        assert f"{rank} first: TimeoutError all_reduce: timed out" in out, out
    for rank in range(3):
        assert f"{rank} initialized: False" in out and f"{rank} again: [3.0, 3.0, 3.0, 3.0]" in out, out
        assert f"{rank} hook kept: True" in out, out
    assert time.monotonic() - start < 60


def test_auto_reads_rank_0s_table_and_settings_that_differ_between_ranks_stop_init(tmp_path):
    """algo='auto' chose by each rank's own tuning table (a multi-host job's ~/.cache/xelink differ: a table on rank 0's
    host only), calibration or topology: ranks took different paths of one collective, wrong results, then a hang.
    Rank 0's table now serves every rank; variables that differ between ranks are a LaunchError on every rank."""
    import json

    import ranks

    from xelink import tuning

    env = {k: v for k, v in os.environ.items() if not k.startswith(("XELINK_TOPOLOGY", "XELINK_TUNING",
                                                                      "XELINK_CALIBRATION"))}
    env.update(XELINK_TIMEOUT="60", XELINK_DEVICE="cpu")
    if ranks.open_mpi():
        pytest.skip("per-rank environments as MPICH's mpiexec takes them (-env)")
    show = ("import json, torch, xelink; from xelink import tuning; w = xelink.init()\n"
            "fp = tuning.fingerprint(w.topology.name, w.hosts, w.world_placement)\n"
            "t = tuning.active(); x = torch.arange(1000.0) + w.rank; xelink.all_reduce(x)\n"
            "ok = torch.equal(x, 2 * torch.arange(1000.0) + 1)\n"
            "import sys; open(f'{sys.argv[1]}/rank{w.rank}.json', 'w').write(json.dumps([fp, t and t.source, ok]))\n"
            "xelink.finalize()\n")  # (a file a rank: the ranks' stdout lines may interleave)
    script = tmp_path / "show.py"
    script.write_text(show)

    def launch(*per_rank):  # per_rank: each rank's extra environment
        argv = [ranks.mpiexec()]
        for i, extra in enumerate(per_rank):
            argv += ([":"] if i else []) + ["-n", "1"] + [a for k, v in extra.items() for a in ("-env", k, v)]
            argv += [sys.executable, str(script), str(tmp_path)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)

    home_a, home_b = tmp_path / "a", tmp_path / "b"
    r = launch({"HOME": str(home_b)}, {"HOME": str(home_b)})
    assert r.returncode == 0, r.stderr
    fp = json.loads((tmp_path / "rank0.json").read_text())[0]
    (home_a / ".cache" / "xelink").mkdir(parents=True)
    path = home_a / ".cache" / "xelink" / "t.tuning.json"
    tuning.TuningTable(fp, {("all_reduce", "float32"): [(0, None, "xelink:ring")]}).save(path)
    r = launch({"HOME": str(home_a)}, {"HOME": str(home_b)})  # the table on rank 0's host only
    assert r.returncode == 0, r.stderr
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text())[1:] for r in range(2)]
    assert seen == [[str(path), True]] * 2, seen
    r = launch({"HOME": str(home_b), "XELINK_TOPOLOGY": "cpu-2x2"}, {"HOME": str(home_b)})
    assert r.returncode != 0
    assert r.stderr.count("LaunchError: init: XELINK_TOPOLOGY differs between ranks (rank 0: 'cpu-2x2', rank 1: "
                          "unset)") == 2, r.stderr


_DISAGREE = """
import os, sys, time
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
import torch, xelink
from xelink import runtime
def say(*parts):  # one write a line: the ranks share the launcher's stdout
    sys.stdout.write(" ".join(map(str, parts)) + "\\n")
    sys.stdout.flush()
def attempt(what, **kw):
    start = time.monotonic()
    try:
        xelink.init(abort_on_exception=False, **kw)
        say(rank, what, "initialized")
        xelink.finalize()
    except Exception as exc:
        say(rank, what, type(exc).__name__, str(exc).splitlines()[0], f"after {time.monotonic() - start:.0f} s")
if rank == 0:
    os.environ["XELINK_CHECK"] = "1"
attempt("check")
os.environ.pop("XELINK_CHECK", None)
attempt("rpd", ranks_per_device=2 if rank == 0 else None)
bind = runtime._bind_device
if rank == 1:
    def refuse(kind, index):
        raise RuntimeError("no such device")
    runtime._bind_device = refuse
attempt("bind")
runtime._bind_device = bind
w = xelink.init()
t = torch.ones(4) * (w.rank + 1)
xelink.all_reduce(t)
say(rank, "then:", t.tolist())
xelink.finalize()
"""


def test_settings_or_a_device_that_differ_between_ranks_stop_init_at_once_on_every_rank():
    """XELINK_CHECK on one rank made its collectives exchange what the others did not (every call timed out, with
    errors blaming the calls); a ranks_per_device of its own placed a rank in other packages (timeouts, or a
    false "different sizes"); a rank that failed to bind its device raised alone while the others waited out the
    deadline in init. Each is now a LaunchError on every rank at once, and init works again afterwards."""
    import time

    import ranks

    start = time.monotonic()
    r = subprocess.run([ranks.mpiexec(), "-n", "3", sys.executable, "-c", _DISAGREE], capture_output=True,
                       text=True, timeout=150, env={**os.environ, "XELINK_DEVICE": "cpu", "XELINK_TIMEOUT": "60"})
    out = r.stdout
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(3):
        assert (f"{rank} check LaunchError init: XELINK_CHECK differs between ranks (rank 0: '1', rank 1: unset, "
                f"rank 2: unset)") in out, out
        assert f"{rank} rpd LaunchError init: ranks_per_device differs between ranks (rank 0: 2, rank 1: 1" in out, out
        assert (f"{rank} bind LaunchError init: binding a device failed on rank 1: RuntimeError: no such device"
                in out), out
        assert f"{rank} then: [6.0, 6.0, 6.0, 6.0]" in out, out
    assert time.monotonic() - start < 60  # (each refusal at once, not at the 60 s deadline)
