"""How the job was launched, which device each rank drives, and ``init()`` / ``finalize()``.

Everything xelink knows about the launch (rank, size, local rank, host, device) is read here, once,
and handed to the world communicator; library code asks the communicator, never the environment.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import socket
import sys
import time
from typing import Mapping

from . import bridge, config, log, tuning
from .comm import NON_GROUP_MEMBER, Communicator, get_world, live, resolve_group, set_world
from .config import DEFAULT_TIMEOUT_S, resolve_timeout  # noqa: F401 (public here since before config.py)
from .errors import LaunchError, NotInitializedError, XelinkError
from .transport import Deadline, SelfTransport, Transport, shm

__all__ = [
    "Launch",
    "detect_launch",
    "init",
    "finalize",
    "destroy_process_group",
    "init_process_group",
    "is_available",
    "get_node_local_rank",
    "get_world",
    "is_initialized",
    "resolve_timeout",
    "choose_device_index",
    "check_device_sharing",
]

_log = log.get_logger("runtime")


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the launcher said about this process.

    ``launcher`` is one of ``mpich``, ``intelmpi``, ``openmpi``, ``mpi`` (a PMI/PMIx launcher of
    unknown flavour, e.g. srun), ``torchrun``, ``single``. ``local_rank``/``local_size`` are None when
    the launcher does not say; ``init()`` then derives them from the hosts of all ranks.
    """

    launcher: str
    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    host: str

    @property
    def transport(self) -> str:
        return {"torchrun": "torch", "single": "self"}.get(self.launcher, "mpi")


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            try:
                return int(value)
            except ValueError:
                raise LaunchError(f"init: environment variable {name}={value!r} is not an integer") from None
    return None


def detect_launch(env: Mapping[str, str] = os.environ) -> Launch:
    """Identify the launcher from the environment it set (a pure function of ``env``)."""
    host = socket.gethostname()
    mpi = any(k in env for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"))
    # torchrun, or an env:// launch by hand (RANK, WORLD_SIZE and MASTER_ADDR, as torch's init_method="env://" reads
    # them; LOCAL_RANK may be absent). Under an MPI launcher its own variables win over torch's left in the environment.
    torch_env = "RANK" in env and "WORLD_SIZE" in env and ("LOCAL_RANK" in env or "MASTER_ADDR" in env)
    if "TORCHELASTIC_RUN_ID" in env or (torch_env and not mpi):
        launcher = "torchrun"
        rank, size = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        local_rank, local_size = _env_int(env, "LOCAL_RANK"), _env_int(env, "LOCAL_WORLD_SIZE")
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "openmpi"
        rank, size = _env_int(env, "OMPI_COMM_WORLD_RANK"), _env_int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_RANK" in env or "PMIX_RANK" in env:
        # MPICH's and Intel MPI's Hydra both set PMI_* and MPI_LOCALRANKID; Intel MPI adds I_MPI_*.
        if any(k.startswith("I_MPI_") for k in env):
            launcher = "intelmpi"
        elif "PMI_RANK" in env and "MPI_LOCALRANKID" in env:
            launcher = "mpich"
        else:
            launcher = "mpi"
        rank, size = _env_int(env, "PMI_RANK", "PMIX_RANK"), _env_int(env, "PMI_SIZE", "SLURM_NTASKS")
        local_rank = _env_int(env, "MPI_LOCALRANKID", "SLURM_LOCALID")
        local_size = _env_int(env, "MPI_LOCALNRANKS")
    else:
        task, tasks = _env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_STEP_NUM_TASKS")
        if task is not None and (task > 0 or (tasks or 1) > 1):  # (a batch script's own shell is task 0 of no step)
            raise LaunchError(f"init: srun started this process as task {task} of {tasks} without PMI (no PMI_RANK or "
                              f"PMIX_RANK): each task would run alone as rank 0 of 1; launch with srun --mpi=pmi2 (or "
                              f"pmix), mpiexec or xelink-run")
        return Launch("single", 0, 1, 0, 1, host)
    if rank is None or size is None or size < 1 or not 0 <= rank < size:
        raise LaunchError(f"init: launcher {launcher} gave rank={rank} size={size}, which is not a valid placement")
    return Launch(launcher, rank, size, local_rank, local_size, host)


# ---------------------------------------------------------------------------------------------
# Devices


def _device_kind(device: str | None) -> str:
    """``cuda``, ``xpu`` or ``cpu``: the asked-for kind, else the first accelerator torch sees."""
    import torch

    source = "init: device"
    if device is None:
        device, source = config.env("XELINK_DEVICE"), "XELINK_DEVICE"
    if device is None:
        if torch.cuda.is_available():
            return "cuda"
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return "xpu"
        return "cpu"
    kind, colon, _ = str(device).partition(":")
    if kind not in ("cpu", "cuda", "xpu"):
        raise config.bad_value(source, f"{source}={device!r} is not one of 'cpu', 'cuda', 'xpu'")
    if colon:  # (it was dropped: "cuda:1" bound device local_rank // ranks_per_device, not 1)
        raise config.bad_value(source, f"{source}={device!r}: give the kind alone ({kind!r}); rank r binds "
                                       f"device local_rank // ranks_per_device (init_process_group(device_id=) "
                                       f"checks an index)")
    return kind


def _device_count(kind: str) -> int:
    import torch

    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "xpu":
        return torch.xpu.device_count() if hasattr(torch, "xpu") and torch.xpu.is_available() else 0
    return 0


def choose_device_index(kind: str, local_rank: int, local_size: int, count: int, ranks_per_device: int, host: str) -> int:
    """The device index a rank binds to: ``local_rank // ranks_per_device``.

    A host whose ranks each see a single device (the launcher restricted visibility per rank) binds
    every rank to index 0; ``check_device_sharing`` then catches ranks that really share one.
    """
    need = -(-local_size // ranks_per_device)
    if count == 0:
        raise LaunchError(f"init: device {kind!r} asked for, but no {kind} device is visible on host {host}")
    if count >= need:
        return local_rank // ranks_per_device
    if count == 1:
        return 0
    raise LaunchError(
        f"init: {local_size} ranks on host {host} but only {count} {kind} device(s) visible; launch at most "
        f"{count * ranks_per_device} ranks per host, or allow several ranks per device with "
        f"init(ranks_per_device=k) or XELINK_RANKS_PER_DEVICE=k"
    )


def check_device_sharing(idents: list, ranks_per_device: int) -> None:
    """Raise ``LaunchError`` if more than ``ranks_per_device`` ranks drive one device.

    ``idents[r]`` identifies rank r's device (host and UUID); None for CPU ranks, which may share.
    """
    users: dict = {}
    for r, ident in enumerate(idents):
        if ident is not None:
            users.setdefault(ident, []).append(r)
    for ident, ranks in users.items():
        if len(ranks) > ranks_per_device:
            raise LaunchError(
                f"init: ranks {ranks} all drive device {ident[1]} on host {ident[0]}, but ranks_per_device="
                f"{ranks_per_device}; launch fewer ranks per host or pass init(ranks_per_device={len(ranks)})"
            )


def _bind_device(kind: str, index: int):
    import torch

    if kind == "cpu":
        return torch.device("cpu"), None
    getattr(torch, kind).set_device(index)
    props = getattr(torch, kind).get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES" if kind == "cuda" else "ZE_AFFINITY_MASK", "")
    return torch.device(kind, index), str(uuid) if uuid is not None else f"{kind}:{visible}:{index}"


def _ranks_per_device(value) -> int:
    source = "init: ranks_per_device"
    if value is None:
        value, source = config.env_int("XELINK_RANKS_PER_DEVICE", 1), "XELINK_RANKS_PER_DEVICE"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise config.bad_value(source, f"{source}={value!r} must be a positive int")
    return value


# ---------------------------------------------------------------------------------------------
# init / finalize

_state: dict = {}  # this process's init: the previous excepthook while the abort hook is installed


def _make_transport(launch: Launch, kind: str, timeout: float) -> Transport:
    if launch.transport == "self":
        return SelfTransport()
    if launch.transport == "mpi":
        from .transport.mpi import MPITransport

        t = MPITransport.world(f"w{bridge.generation()}", timeout)
        if (t.rank, t.size) != (launch.rank, launch.size):
            raise LaunchError(
                f"init: {launch.launcher} launched rank {launch.rank} of {launch.size}, but mpi4py's MPI sees rank "
                f"{t.rank} of {t.size}: mpiexec and mpi4py come from different MPI libraries (use the mpiexec "
                f"that belongs to mpi4py's MPI)"
            )
        # MPICH's init slab stays in /dev/shm if the job crashes; every local rank has mapped it by
        # now, so it can go (transport/shm.py explains why that is safe).
        from .transport.shm import unlink_mpich_init_segment

        unlink_mpich_init_segment()
        return t
    import torch.distributed as dist

    from .transport.torchdist import TorchTransport

    if not dist.is_initialized():
        if launch.size == launch.local_size:
            bridge.use_loopback()
        # No device_id: NCCL communicators are made lazily, on the device init() binds just after.
        # Kept across finalize(): torch cannot make a default group twice on one torchrun store (the
        # second finds the first one's stale addresses), so a later init() adopts this one; it is
        # destroyed when the process exits.
        dist.init_process_group(bridge.backend_string(kind), timeout=datetime.timedelta(seconds=timeout))
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if (dist.get_rank(), dist.get_world_size()) != (launch.rank, launch.size):
        raise LaunchError(
            f"init: torchrun launched rank {launch.rank} of {launch.size}, but torch.distributed is rank "
            f"{dist.get_rank()} of {dist.get_world_size()}"
        )
    store = dist.PrefixStore("xelink", dist.distributed_c10d._get_default_store())
    bridge.adopt_store(store)
    return TorchTransport(store, f"world{bridge.generation()}", range(launch.size), launch.rank, timeout)


def init(timeout=None, *, device: str | None = None, ranks_per_device: int | None = None,
         abort_on_exception: bool = True) -> Communicator:
    """Join the job: detect the launcher, bind this rank to its device, return the world communicator.

    Args:
        timeout: default deadline in seconds for every wait (float or timedelta); else
            ``XELINK_TIMEOUT``, else 300 s.
        device: ``"cuda"``, ``"xpu"`` or ``"cpu"`` (else ``XELINK_DEVICE``, else the first accelerator
            torch sees, else CPU). Rank r binds to device ``local_rank // ranks_per_device``.
        ranks_per_device: how many ranks may share one GPU (else ``XELINK_RANKS_PER_DEVICE``, else 1).
        abort_on_exception: under MPI, an uncaught exception on one rank aborts the whole job
            instead of leaving the other ranks waiting.

    Returns:
        The world ``Communicator``. A second call returns the same one (its arguments are ignored).

    Raises:
        LaunchError: the launch is inconsistent (more ranks per host than devices, mismatched MPI).
        xelink.TimeoutError: a rank did not join within the deadline.

    Collective: every rank of the job must call this.
    """
    if is_initialized():
        return get_world()
    timeout = resolve_timeout(timeout)
    rpd = _ranks_per_device(ranks_per_device)
    launch = detect_launch(os.environ)
    log.configure(launch.rank)
    kind = _device_kind(device)
    bridge.generation(bump=True)  # store keys of this world differ from an earlier init()'s
    transport = _make_transport(launch, kind, timeout)
    try:
        launch, seen, dev, idents = _join(transport, launch, kind, rpd, Deadline(timeout))
    except BaseException as exc:  # (a refused init leaves nothing behind: init may be called again)
        transport.free(abandon=isinstance(exc, TimeoutError))
        raise
    hosts = [h for h, _ in seen]
    world = Communicator(transport, name="w", world_ranks=range(launch.size), hosts=hosts, device=dev,
                         timeout=timeout, launch=launch, device_idents=idents)
    if launch.transport == "mpi" and launch.local_size > 1:
        world.board = shm.ProgressBoard(world, timeout)
    _attach_topology(world, rpd)
    from .cost import set_active_oversubscription

    set_active_oversubscription(ranks_per_core(seen))
    set_world(world)
    if abort_on_exception and launch.transport == "mpi" and launch.size > 1:
        _install_abort_hook()
    _log.debug("init: %s rank %d/%d local %d/%d on %s, device %s, timeout %g s", launch.launcher,
               launch.rank, launch.size, launch.local_rank, launch.local_size, launch.host, dev, timeout)
    return world


def _join(transport, launch: Launch, kind: str, rpd: int, deadline: Deadline):
    """init's two exchanges: every rank's host, CPUs and settings (which must agree), then its device, bound
    between them. Returns the launch with its local rank, [(host, CPUs)], this rank's device and the devices'
    identities. A rank that fails to bind its device tells the others, so every rank raises at once (they waited
    in the second exchange until the deadline)."""
    seen = transport.exchange((launch.host, _cpus(), _settings(kind, rpd)), deadline, "init")
    _agree_on_settings([s for _, _, s in seen])
    seen = [(h, cpus) for h, cpus, _ in seen]
    if launch.local_rank is None or launch.local_size is None:
        same = [r for r, (h, _) in enumerate(seen) if h == launch.host]
        launch = dataclasses.replace(launch, local_rank=same.index(transport.rank), local_size=len(same))
    failure = None
    try:
        index = None
        if kind != "cpu":
            index = choose_device_index(kind, launch.local_rank, launch.local_size, _device_count(kind), rpd,
                                        launch.host)
        dev, uuid = _bind_device(kind, index) if index is not None else _bind_device("cpu", 0)
        mine = None if uuid is None else (launch.host, uuid)
    except Exception as exc:  # noqa: BLE001 - every rank raises it below
        failure, mine = exc, _BindFailure(f"{type(exc).__name__}: {exc}")
    idents = transport.exchange(mine, deadline, "init")
    failed = [(r, i.why) for r, i in enumerate(idents) if isinstance(i, _BindFailure)]
    if failed:
        raise LaunchError("init: binding a device failed on " + "; ".join(f"rank {r}: {why}" for r, why in failed)) \
            from failure
    check_device_sharing(idents, rpd)
    return launch, seen, dev, idents


def _cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity; every CPU where the platform has no affinity)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def ranks_per_core(seen) -> float:
    """Ranks per core on the busiest host, from every rank's (host, CPUs it may run on), at least 1: the host's
    ranks over the CPUs any of them may use (ranks bound to one core each, or free to use all, count alike)."""
    cpus: dict = {}
    ranks: dict = {}
    for host, mine in seen:
        cpus.setdefault(host, set()).update(mine)
        ranks[host] = ranks.get(host, 0) + 1
    return max([1.0] + [ranks[h] / max(len(cpus[h]), 1) for h in ranks])


# Settings that every rank must share. algo='auto' reads the first three besides the call: ranks that chose by
# different ones took different paths of one collective (wrong results, then a hang); the files they (or
# ~/.cache/xelink, which differs between hosts) name are read by rank 0 for every rank. The others decide which
# messages a call exchanges (XELINK_CHECK's extra exchange, the GPU collectives' pieces and blocks, the distributed
# GEMM's graphs) or where ranks sit in the topology's packages (ranks_per_device): a rank set apart timed out.
_AGREED = ("XELINK_TOPOLOGY", "XELINK_TUNING", "XELINK_CALIBRATION", "XELINK_CHECK", "XELINK_GPU_SCRATCH",
           "XELINK_P2P_BLOCKS", "XELINK_DIST_GRAPHS", "XELINK_DIST_GRAPH_MB")


@dataclasses.dataclass(frozen=True)
class _BindFailure:
    """What a rank sends in init's device exchange when binding its device failed."""
    why: str


def _settings(kind: str, rpd: int) -> tuple:
    """This rank's share of what every rank must agree on: (name, value) pairs."""
    return (("device", kind), ("ranks_per_device", rpd)) + tuple((n, config.env(n)) for n in _AGREED)


def _agree_on_settings(seen: list) -> None:
    """A ``LaunchError`` on every rank where the ranks' ``_settings`` differ, naming the setting and each value."""
    for i, (name, _) in enumerate(seen[0]):
        values = [s[i][1] for s in seen]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {'unset' if v is None else repr(v)}" for r, v in enumerate(values))
            raise LaunchError(f"init: {name} differs between ranks ({shown}); every rank must see the same value")


def _rank0s(world: Communicator, what: str, load):
    """``load()`` run on rank 0, its result on every rank (its error a ``LaunchError`` on every rank)."""
    got = None
    if world.rank == 0:
        try:
            got = (load(), None)
        except (OSError, ValueError, TypeError) as exc:
            got = (None, str(exc))
    value, error = world.allgather_object(got)[0]
    if error is not None:
        raise LaunchError(f"init: {what} (read by rank 0): {error}")
    return value


def _attach_topology(world: Communicator, rpd: int) -> None:
    """Give the world its topology (``XELINK_TOPOLOGY`` or discovery), placement, tuning table and calibration,
    the same on every rank (init agreed on the settings: ``_AGREED``)."""
    from .topology import from_env_or_discover, place

    topo = from_env_or_discover(world)
    try:
        world.world_placement = place(topo, world.size, rpd)
    except ValueError as exc:
        raise LaunchError(f"init: topology {topo.name!r} does not fit this launch: {exc}") from None
    world.topology = topo
    asked = config.env("XELINK_TUNING")
    fp = tuning.fingerprint(topo.name, world.hosts, world.world_placement)
    where = asked or os.path.join(os.path.expanduser("~"), ".cache", "xelink")
    table = _rank0s(world, "the tuning table", lambda: tuning.find_table(fp, [where]))
    if asked and table is None and world.rank == 0:  # named, but nothing there fits: say so (auto uses the cost model)
        _log.warning("XELINK_TUNING=%s holds no tuning table (*%s) for this machine %s; algo='auto' falls back to "
                     "the cost model", asked, tuning.SUFFIX, fp)
    tuning.set_active(table)
    cal_path = config.env("XELINK_CALIBRATION")
    if cal_path:  # a measured calibration (``xelink bench links --calibration-out``) prices auto's model
        from .cost import load_calibration, set_active_calibration

        set_active_calibration(_rank0s(world, f"XELINK_CALIBRATION={cal_path!r}",
                                       lambda: load_calibration(cal_path, topo)))


def _install_abort_hook() -> None:
    previous = sys.excepthook

    def hook(etype, value, tb):
        previous(etype, value, tb)
        sys.stderr.flush()
        from mpi4py import MPI

        # Let the launcher forward the traceback first: Hydra drops what is still in a rank's pipe when
        # the abort reaches it (seen with MPICH 5.0: the message lost in about 1 run in 6).
        time.sleep(0.5)
        # Abort rather than exit: the other ranks would otherwise wait for this one until their deadline.
        MPI.COMM_WORLD.Abort(1)

    _state["previous_excepthook"], _state["abort_hook"] = previous, hook
    sys.excepthook = hook


def init_process_group(backend=None, init_method=None, timeout=None, world_size: int = -1, rank: int = -1,
                       store=None, group_name: str = "", pg_options=None, device_id=None) -> None:
    """torch.distributed.init_process_group's signature over :func:`init` (which also returns the world).

    The job's ranks come from its launcher (mpirun, mpiexec, srun, torchrun), so ``init_method`` may be None or
    ``"env://"`` only, ``store`` None only, and ``world_size`` / ``rank`` where given (not -1) must be the
    launcher's; ``backend`` ("nccl", "gloo", "mpi", "xccl", "cpu:gloo,cuda:nccl", ...), ``group_name`` and
    ``pg_options`` are taken and unused (xelink picks by each tensor's device). ``device_id`` (a torch.device,
    "cuda:1" or an index) binds that kind of device, and its index must be the one this rank binds
    (``local_rank // ranks_per_device``): ValueError after joining otherwise. Everything else is checked before
    joining; a second call raises ValueError, as torch's.

    Collective: every rank of the job must call this.
    """
    fn = "init_process_group"
    if is_initialized():
        raise ValueError(f"{fn}: trying to initialize the default process group twice (xelink is initialized; "
                         f"destroy_process_group() or finalize() first)")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"{fn}: backend={backend!r} must be a string such as 'nccl' or 'gloo' (or None)")
    if init_method not in (None, "env://"):
        raise ValueError(f"{fn}: init_method={init_method!r} is not used: xelink joins the job through its "
                         f"launcher (mpirun, mpiexec, srun, torchrun); pass None or 'env://'")
    if store is not None:
        raise ValueError(f"{fn}: store={store!r} is not used: xelink joins the job through its launcher; pass None")
    launch = detect_launch(os.environ)
    for name, given, real in (("world_size", world_size, launch.size), ("rank", rank, launch.rank)):
        if not config.is_int(given):
            raise TypeError(f"{fn}: {name}={given!r} must be an int (-1: the launcher's)")
        if given not in (-1, real):
            raise ValueError(f"{fn}: {name}={given}, but the launcher ({launch.launcher}) started this process as "
                             f"{name} {real}")
    want = None
    if device_id is not None:
        import torch

        try:
            want = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"{fn}: device_id={device_id!r} is not a device") from None
    world = init(timeout, device=None if want is None else want.type)
    if want is not None and want.index is not None and world.device != want:
        raise ValueError(f"{fn}: device_id={device_id!r}, but this rank binds {world.device} (local rank "
                         f"{world.launch.local_rank}: device local_rank // ranks_per_device)")


def is_available() -> bool:
    """True, as torch.distributed.is_available (xelink always has a host transport)."""
    return True


def is_initialized() -> bool:
    try:
        get_world()
    except NotInitializedError:
        return False
    return True


def destroy_process_group(group=None) -> None:
    """torch.distributed.destroy_process_group's shape: ``group`` None (or the world) finalizes xelink
    (:func:`finalize`), a communicator is freed (``Communicator.free``), ``NON_GROUP_MEMBER`` is left alone.

    Collective: every rank of the group (of the world for None) must call this.
    """
    if group is NON_GROUP_MEMBER:
        return
    if group is None or resolve_group(group, "destroy_process_group") is get_world():
        finalize()
    else:
        group.free()


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its host as its launcher numbers it (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, ...;
    else its place among the host's ranks), the one init bound its device by, as
    torch.distributed.get_node_local_rank; before :func:`init`, ``fallback_rank`` where given. (Open MPI 5
    numbers a host's ranks in its mapping's order, which need not be the world ranks' order that
    ``Communicator.local_rank`` follows: the device of ``torch.cuda.set_device(get_node_local_rank())`` is the
    one init bound.)"""
    if is_initialized():
        return get_world().launch.local_rank
    if fallback_rank is None:
        raise NotInitializedError("get_node_local_rank: xelink.init() has not been called; pass fallback_rank= to "
                                  "get a rank without it")
    try:
        return int(fallback_rank)  # (as torch's: anything int() takes)
    except (TypeError, ValueError):
        raise TypeError(f"get_node_local_rank: fallback_rank={fallback_rank!r} must be an int") from None


def finalize() -> None:
    """Release every communicator, the torch.distributed groups xelink created, and their files; then raise a
    GPU wait error (a deadline, a message of another size) that no call has raised yet.

    Collective when the world has more than one rank. ``init()`` may be called again afterwards.
    """
    if not is_initialized():
        return
    world = get_world()
    unreported = _unreported_gpu_error()
    broken = world._broken is not None
    if world.size > 1 and not broken:
        _all_in_finalize(world)
    # Peer memory first, then every other communicator, each in name order: the same on every rank. (A world that
    # a timeout broke gives its windows up instead: its ranks may be anywhere.)
    if broken:
        shm.abandon_all()
    else:
        shm.free_all()
    for comm in live():
        if comm is not world:
            comm.free()
    if world.size > 1 and not broken:
        world.barrier()
    # Every rank is past the barrier, so MPI_Win_free cannot wait on one. A world that a timeout broke has no
    # barrier: its board (a small window) is left to MPI_Finalize, so that the ranks can still tear down and init
    # again, as torch.distributed's destroy_process_group after a timeout.
    if world.board is not None and not broken:
        world.board.free()
    bridge.close()
    if "previous_excepthook" in _state:
        previous = _state.pop("previous_excepthook")
        if sys.excepthook is _state.get("abort_hook"):  # (not one the user set since)
            sys.excepthook = previous
    world.free()
    tuning.set_active(None)
    from .cost import set_active_calibration, set_active_oversubscription

    set_active_calibration(None)
    set_active_oversubscription(1.0)
    set_world(None)
    _state.clear()
    if unreported is not None:
        raise unreported


def _all_in_finalize(world) -> None:
    """Check that every rank of the world is in ``finalize`` before the calls of MPI that have no deadline
    (freeing windows): a plain barrier's message is taken by whatever exchange a peer is in (the set-up of a
    window inside an all_reduce, say), and this rank went on into MPI_Win_free while its peers never would.
    Each rank sends "finalize" first and the second message only when every rank sent it, so a peer in another
    call times out in it. Raises XelinkError naming the ranks in another call (the world is then broken:
    ``finalize`` again releases this rank's resources alone)."""
    deadline = world.deadline(None, "finalize")
    seen = world._exchange("finalize", deadline, "finalize")
    elsewhere = [r for r, s in enumerate(seen) if s != "finalize"]
    if elsewhere:
        exc = XelinkError(f"finalize: rank(s) {', '.join(map(str, elsewhere))} of the world are in another "
                          f"collective call, not in finalize (every rank must finish its calls before finalize)")
        world.fail(exc)
        raise exc
    world._exchange(None, deadline, "finalize")


def _unreported_gpu_error() -> XelinkError | None:
    """The first GPU wait of a live communicator that ran past its deadline (or received a message of another
    size) and that no call has raised yet. Such a wait leaves its output unwritten and is raised by the group's
    next call; when there is none, ``finalize`` raises it once everything is released, so the job does not end
    as if the data were right."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    from . import symm

    for comm in live():
        if comm._broken is None and not comm._freed and symm.available(comm):
            try:
                symm.synchronize(comm)
            except XelinkError as exc:
                return exc
    return None
