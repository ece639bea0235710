"""The CUDA backend: collectives on CUDA tensors through xelink's peer-memory kernels (Triton, CUDA IPC
between the ranks of one host, several ranks per GPU allowed) or NCCL, with NCCL's stream semantics
(``launch``: enqueued on the current stream; ``async_op=True`` returns a handle whose ``wait()`` makes
the current stream wait).

Importing it registers its algorithms (``registry``); a name the CPU backend uses for the same schedule
is accepted as an alias (``dest_split``/``one_shot`` -> ``direct``). The op functions below take checked
tensors and a resolved ``registry.Algorithm``.
"""
from __future__ import annotations

import functools
import sys

import torch

from ...errors import XelinkError
from ... import symm
from .. import registry
from . import compose, nccl, peer
from .launch import done, kernel_module

__all__ = ["BACKEND", "GpuWork", "all_reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
           "all_to_all_single", "barrier", "synchronize", "device_barrier", "synchronize_group", "unmet", "size_rule"]

BACKEND = "cuda"
_PEER = ("peer_memory",)

for _op, _name, _impl, _schedule, _needs, _summary in (
    ("all_reduce", "direct", functools.partial(peer.all_reduce, algo="direct"), "direct", _PEER,
     "one-shot: push into every rank's scratch, one barrier, reduce locally"),
    ("all_reduce", "two_shot", functools.partial(peer.all_reduce, algo="two_shot"), "two_shot", _PEER,
     "each rank reduces its chunk from every peer and writes it into every peer"),
    ("all_reduce", "copy_engine", functools.partial(peer.all_reduce, algo="copy_engine"), "two_shot",
     _PEER + ("symmetric",), "SM reduce-scatter in place, then the DMA engines pull the reduced chunks"),
    ("all_reduce", "hierarchical", compose.hierarchical_all_reduce, "hierarchical", _PEER,
     "reduce inside each package, all-reduce across (once per remote package), spread inside each"),
    ("all_reduce", "nccl", nccl.all_reduce, "ring", ("baseline",), "NCCL through torch.distributed"),
    ("all_gather", "direct", functools.partial(peer.all_gather_into_tensor, algo="direct"), "direct", _PEER,
     "every rank pulls every shard"),
    ("all_gather", "copy_engine", functools.partial(peer.all_gather_into_tensor, algo="copy_engine"), "direct",
     _PEER, "the DMA engines pull every shard; the own shard is copied alongside"),
    ("all_gather", "topo", compose.topo_all_gather, "topo", _PEER,
     "each shard across once per remote package (same local index, wrapping), then inside each package"),
    ("all_gather", "nccl", nccl.all_gather_into_tensor, "ring", ("baseline",), "NCCL through torch.distributed"),
    ("reduce_scatter", "direct", peer.reduce_scatter_tensor, "dest_split", _PEER,
     "each rank reads its block from every peer and reduces it"),
    ("reduce_scatter", "nccl", nccl.reduce_scatter_tensor, "ring", ("baseline",), "NCCL through torch.distributed"),
    ("all_to_all", "direct", peer.all_to_all_single, "dest_split", _PEER, "each rank pulls its block from every peer"),
    ("all_to_all", "nccl", nccl.all_to_all_single, "dest_split", ("baseline",), "NCCL through torch.distributed"),
):
    registry.register(_op, _name, BACKEND, _impl, schedule=_schedule, needs=_needs, summary=_summary)
for _other in ("dest_split", "one_shot"):
    registry.alias(BACKEND, _other, "direct")
registry.add_backend(BACKEND, sys.modules[__name__])

GpuWork = symm.Work  # the handle of an async_op=True call on CUDA tensors

# algo="auto" on CUDA tensors: the measured tuning table, else the size rule below. The cost model is not
# consulted: its figures for these kernels (latency per barrier, copy-engine overlap) are not measured.
MODEL_AUTO = False
# The size rule of algo="auto" when no tuning table says otherwise (bytes of the buffer reduced): the
# one-shot push moves (n-1) buffers per rank, two-shot 2(n-1)/n; on 2 x H200 one-shot won at every
# size with torch.empty tensors (benchmarks/results/h200x2-gpu-collectives), so two ranks always take it.
_DIRECT_MAX = 512 << 10


def size_rule(comm, op: str, nbytes: int) -> str:
    if op == "all_reduce" and nbytes > _DIRECT_MAX and comm.size > 2:
        return "two_shot"
    return "direct"


def unmet(comm, algo: registry.Algorithm, x=None) -> Exception | None:
    """Why ``algo`` cannot run on ``comm`` (for the tensor ``x``): the error to raise (its message a
    sentence to follow ``algo=...``; a ``ValueError`` for the caller's choice, ``XelinkError`` for the
    install), or None when it can."""
    if "peer_memory" in algo.needs and "cuda.team" not in comm._resources:
        if not symm.available(comm):
            return ValueError(f"needs peer memory: every rank of {comm.name} on one host's CUDA GPUs, at most "
                              f"{symm.MAX_WORLD} ranks (use algo='nccl' or 'auto')")
        if not kernel_module().available():
            return XelinkError("runs Triton kernels, and Triton is not installed")
    if "symmetric" in algo.needs and x is not None and x.numel() and peer.symmetric(comm, x) is None:
        return ValueError("reads the input in place on every rank: allocate it with xelink.empty (or use "
                          "algo='two_shot')")
    return None


def _alone(comm, fn, async_op, out, inp):
    """One rank (or nothing to move): the output is this rank's own data."""
    if out.numel():
        out.view(-1).copy_(inp.view(-1)[: out.numel()])
    return done(comm, fn, async_op)


def all_reduce(comm, x, op, algo, async_op, timeout):
    if comm.size == 1 or x.numel() == 0:
        return done(comm, "all_reduce", async_op)
    return algo.impl(comm, x, op, async_op, timeout)


def all_gather_into_tensor(comm, out, inp, algo, async_op, timeout):
    if comm.size == 1 or inp.numel() == 0:
        return _alone(comm, "all_gather_into_tensor", async_op, out, inp)
    return algo.impl(comm, out, inp, async_op, timeout)


def all_gather(comm, outs, inp, algo, async_op, timeout):
    """List form: ``outs[r]`` receives rank r's ``inp`` (copied out on the stream, after the gather)."""
    flat = torch.empty(comm.size * inp.numel(), dtype=inp.dtype, device=inp.device)
    all_gather_into_tensor(comm, flat, inp, algo, False, timeout)
    for i, t in enumerate(outs):
        t.copy_(flat[i * inp.numel():(i + 1) * inp.numel()].view_as(t))
    return done(comm, "all_gather", async_op)


def reduce_scatter_tensor(comm, out, inp, op, algo, async_op, timeout):
    if comm.size == 1 or out.numel() == 0:
        return _alone(comm, "reduce_scatter_tensor", async_op, out, inp)
    return algo.impl(comm, out, inp, op, async_op, timeout)


def all_to_all_single(comm, out, inp, out_splits, in_splits, algo, async_op, timeout):
    if comm.size == 1 or inp.numel() == 0:
        return _alone(comm, "all_to_all_single", async_op, out, inp)
    if algo.name == "nccl":
        return algo.impl(comm, out, inp, async_op, timeout, out_splits, in_splits)
    return algo.impl(comm, out, inp, async_op, timeout)


def barrier(comm, timeout=None):
    """A GPU-resident barrier on the current stream: later work waits until every rank reached it."""
    symm.barrier(comm, timeout=timeout)


def synchronize(comm) -> None:
    """Wait for this rank's GPU work, then raise ``xelink.TimeoutError`` if a GPU wait timed out."""
    symm.synchronize(comm)


def device_barrier(group=None, timeout=None) -> None:
    """GPU-resident barrier on the current stream: work queued after it runs once every rank got there.

    The host does not wait. A rank that never arrives makes the kernel give up at the deadline;
    the next call (or ``xelink.synchronize``) raises ``xelink.TimeoutError`` naming it.
    Collective: every rank of ``group`` must call this.
    """
    symm.barrier(group, timeout=timeout)


def synchronize_group(group=None) -> None:
    """Block until this rank's GPU work is done; raise ``xelink.TimeoutError`` if a GPU wait timed out."""
    symm.synchronize(group)
