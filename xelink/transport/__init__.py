"""Host transports: how bytes and small control objects move between the ranks of a communicator.

A transport moves bytes only; algorithms (later: ``xelink.collectives``) are written once on top of
the ``Transport`` interface and run over every transport:

- ``mpi``   (``transport/mpi.py``): mpi4py, under mpirun/mpiexec.
- ``torch`` (``transport/torchdist.py``): torch.distributed point-to-point (gloo) and its store, under torchrun.
- ``self``  (``transport/base.py``): a single process, world size 1.
"""
from .base import Deadline, Request, SelfTransport, Transport, spin_until, wait_all

__all__ = ["Deadline", "Request", "SelfTransport", "Transport", "spin_until", "wait_all"]
