"""Peer memory in a plain process: a communicator without MPI gets a clear error, not a window."""
import pytest
import torch

import xelink
from xelink.comm import Communicator
from xelink.transport import SelfTransport
from xelink.transport import shm
from xelink.transport.shm import PeerCounters, PeerMemoryUnavailable, PeerWindow


def self_comm() -> Communicator:
    return Communicator(SelfTransport(), name="t", world_ranks=[0], hosts=["localhost"],
                        device=torch.device("cpu"), timeout=5.0, launch=None)


def test_non_mpi_transport_is_refused_by_name():
    comm = self_comm()
    assert not shm.available(comm)
    with pytest.raises(PeerMemoryUnavailable, match=r"PeerWindow: comm.transport.name='self': peer memory needs "
                                                    r"the 'mpi' transport") as info:
        PeerWindow(comm, 64)
    assert isinstance(info.value, ValueError)  # callers may catch either and fall back to point-to-point
    with pytest.raises(PeerMemoryUnavailable, match=r"PeerCounters: comm.transport.name='self'"):
        PeerCounters(comm)
    comm.free()


def test_freed_communicator_and_wrong_types():
    comm = self_comm()
    comm.free()
    assert not shm.available(comm)
    with pytest.raises(xelink.XelinkError, match=r"PeerWindow: the communicator was freed"):
        PeerWindow(comm, 64)
    with pytest.raises(TypeError, match=r"PeerWindow: comm=None is not an xelink Communicator"):
        PeerWindow(None, 64)
    assert not shm.available(None)


def test_free_all_without_windows():
    assert shm.free_all(self_comm()) == 0
