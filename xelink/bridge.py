"""The torch.distributed bridge: the process group of a communicator's ranks (gloo for CPU tensors,
nccl/xccl for the device), made on first use by ``Communicator.process_group()``.

It holds the job's torch.distributed state (the store, the default group if xelink made it, the
rendezvous folder) and releases it in ``close()`` (``xelink.finalize``). It takes communicators as
arguments and imports neither ``comm`` nor ``runtime``.
"""
from __future__ import annotations

import atexit
import datetime
import os
import shutil
import socket
import tempfile

from .errors import LaunchError, XelinkError
from .transport import Deadline

__all__ = ["world_group", "subgroup", "adopt_store", "use_loopback", "close", "generation"]

_state: dict = {}
# Each init() of the process names its store keys afresh, so nothing of an earlier world is read back.
_generation = [0]


def generation(bump: bool = False) -> int:
    """The init() count of this process (``bump``: a new world starts)."""
    if bump:
        _generation[0] += 1
    return _generation[0]


def adopt_store(store) -> None:
    """Use ``store`` (the torchrun rendezvous store, prefixed) for the groups made later."""
    _state["store"] = store


def use_loopback() -> None:
    """Jobs on one host: gloo talks over loopback, never over the host's external interfaces."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        names = [n for _, n in socket.if_nameindex()]
        lo = next((n for n in ("lo", "lo0") if n in names), None)
        if lo:
            os.environ["GLOO_SOCKET_IFNAME"] = lo


def backend_string(kind: str) -> str:
    return {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl", "xpu": "cpu:gloo,xpu:xccl"}[kind]


def _check_nccl_devices(comm) -> None:
    """NCCL refuses a communicator in which two ranks drive one GPU; say so before it fails inside."""
    idents = comm.device_idents
    shared = [i for i in idents if i is not None and idents.count(i) > 1]
    if comm.device.type == "cuda" and shared:
        raise XelinkError(f"process_group: ranks of this communicator share GPU {shared[0][1]} (ranks_per_device > 1), "
                          f"and NCCL cannot put two ranks of one GPU in a communicator; use one rank per GPU "
                          f"for the torch.distributed bridge")


def world_group(world):
    """The torch.distributed default group for ``world``, created (or adopted) on first use."""
    import torch.distributed as dist

    _check_nccl_devices(world)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (world.rank, world.size):
            raise LaunchError(
                f"process_group: torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the xelink world is rank {world.rank} of {world.size}"
            )
        _state.setdefault("store", dist.PrefixStore("xelink", dist.distributed_c10d._get_default_store()))
        return dist.group.WORLD
    kind = world.device.type
    deadline = Deadline(world.timeout)
    if len(set(world.hosts)) == 1:
        # One host: a file store in a private directory; no socket is opened for the rendezvous.
        path = tempfile.mkdtemp(prefix="xelink-store-") if world.rank == 0 else None
        path = world.transport.exchange(path, deadline, "process_group")[0]
        store = dist.FileStore(os.path.join(path, "store"), world.size)
        _state["store_dir"] = (path, world.rank == 0)
        if world.rank == 0:
            atexit.register(shutil.rmtree, path, True)
        use_loopback()
    else:
        # Several hosts: torch's TCPStore on rank 0 (it listens on every interface; torch gives no choice).
        td = datetime.timedelta(seconds=world.timeout)
        server = dist.TCPStore(world.hosts[0], 0, world.size, True, timeout=td) if world.rank == 0 else None
        port = world.transport.exchange(server.port if server else None, deadline, "process_group")[0]
        store = server or dist.TCPStore(world.hosts[0], port, world.size, False, timeout=td)
    kwargs = {"device_id": world.device} if kind != "cpu" else {}
    dist.init_process_group(backend_string(kind), store=store, rank=world.rank, world_size=world.size,
                            timeout=datetime.timedelta(seconds=world.timeout), **kwargs)
    _state["own_default_pg"] = True
    _state["store"] = dist.PrefixStore("xelink", store)
    return dist.group.WORLD
def subgroup(comm):
    """A torch ProcessGroup of ``comm``'s ranks (gloo for CPU tensors, plus nccl/xccl for the device).

    Built directly on the world's store under the communicator's unique name, so that only the
    members take part (see ``transport.torchdist.gloo_backend`` for why not ``new_group``).
    """
    import torch
    import torch.distributed as dist

    from .transport.torchdist import gloo_backend

    _check_nccl_devices(comm)
    store = dist.PrefixStore(f"bridge{_generation[0]}/{comm.name}", _state["store"])
    Type = dist.ProcessGroup.BackendType
    pg = dist.ProcessGroup(store, comm.rank, comm.size)
    gloo = gloo_backend(dist.PrefixStore("cpu/", store), comm.rank, comm.size, comm.timeout)
    pg._register_backend(torch.device("cpu"), Type.GLOO, gloo)
    default = Type.GLOO
    if comm.device.type == "cuda":
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), comm.rank, comm.size,
                                     dist.ProcessGroupNCCL.Options())
        pg._register_backend(torch.device("cuda"), Type.NCCL, nccl)
        default = Type.NCCL
    elif comm.device.type == "xpu":
        raise XelinkError("process_group: sub-communicator groups on XPU are not supported yet (no xccl "
                          "backend can be built here to test it); use the world communicator's group")
    pg._set_default_backend(default)
    return pg


def close() -> None:
    """Destroy the default group xelink made and remove its rendezvous folder (``xelink.finalize``)."""
    if _state.pop("own_default_pg", False):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    path, mine = _state.pop("store_dir", (None, False))
    if path and mine:
        shutil.rmtree(path, ignore_errors=True)
    _state.clear()
