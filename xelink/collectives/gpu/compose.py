"""GPU algorithms composed of the flat ones on the package sub-communicators (``Communicator.package_groups``):
the hierarchical all-reduce and the topology-aware all-gather. Packages must have equal sizes here."""
from __future__ import annotations

import torch

from . import peer
from .launch import done

__all__ = ["hierarchical_all_reduce", "topo_all_gather"]


def _groups(comm, fn, timeout):
    packages = comm.packages
    if len({len(p) for p in packages}) != 1:
        raise ValueError(f"{fn}: algo='hierarchical'/'topo' on CUDA tensors needs packages of equal size; "
                         f"{comm.name} has packages {packages}")
    return comm.package_groups(timeout)


def hierarchical_all_reduce(comm, x, op, async_op, timeout):
    """Reduce-scatter inside each package, all-reduce across packages, all-gather inside each package.

    The schedule of the CPU ``hierarchical`` (``xelink.collectives.cpu.all_reduce``) on equal packages:
    each rank's 1/k share (k ranks per package) crosses the fabric, exchanged with the ranks of the
    same local index in one step (the one-shot all-reduce of the cross group).
    """
    pkg, cross = _groups(comm, "all_reduce", timeout)
    inner = "sum" if op == "avg" else op
    flat = x.view(-1)
    k = pkg.size
    per = -(-flat.numel() // k)
    padded = torch.empty(per * k, dtype=x.dtype, device=x.device)
    padded[: flat.numel()].copy_(flat)
    if per * k > flat.numel():
        padded[flat.numel():].fill_(1 if op == "prod" else 0)
    part = torch.empty(per, dtype=x.dtype, device=x.device)
    if k > 1:
        peer.reduce_scatter_tensor(pkg, part, padded, inner, False, timeout)
    else:
        part.copy_(padded)
    if cross.size > 1:
        peer.all_reduce(cross, part, inner, False, timeout, algo="direct")
    if op == "avg":
        part.div_(comm.size)
    if k > 1:
        peer.all_gather_into_tensor(pkg, padded, part, False, timeout, algo="direct")
    else:
        padded.copy_(part)
    flat.copy_(padded[: flat.numel()])
    return done(comm, "all_reduce", async_op)


def topo_all_gather(comm, out, inp, async_op, timeout):
    """Gather across packages (peers with my local index), then inside my package.

    Each shard crosses between packages once per remote package; the package then replicates it.
    """
    pkg, cross = _groups(comm, "all_gather_into_tensor", timeout)
    packages = comm.packages
    n = inp.numel()
    mine = torch.empty(cross.size * n, dtype=inp.dtype, device=inp.device)
    if cross.size > 1:
        peer.all_gather_into_tensor(cross, mine, inp.view(-1), False, timeout, algo="direct")
    else:
        mine.copy_(inp.view(-1))
    full = torch.empty(comm.size * n, dtype=inp.dtype, device=inp.device)
    if pkg.size > 1:
        peer.all_gather_into_tensor(pkg, full, mine, False, timeout, algo="direct")
    else:
        full.copy_(mine)
    # full is ordered [local index i][package p]; output wants rank order.
    view = full.view(pkg.size, cross.size, n)
    o = out.view(-1)
    for p, members in enumerate(packages):
        for i, r in enumerate(members):
            o[r * n:(r + 1) * n].copy_(view[i, p])
    return done(comm, "all_gather_into_tensor", async_op)
