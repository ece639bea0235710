"""Point-to-point on CPU tensors and numpy arrays: send, recv, isend, irecv, batch_isend_irecv."""
from __future__ import annotations

import dataclasses

from ..transport import wait_all
from .checks import USER_TAG_LIMIT, check_rank, group_of, tensor as _tensor

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "P2PWork"]


def _check(fn, tensor, peer_name, peer, group, tag):
    comm = group_of(group, fn)
    x = _tensor(fn, "tensor", tensor, comm)
    if x.is_cuda:
        raise ValueError(f"{fn}: tensor is on {x.device}; point-to-point moves CPU tensors and numpy arrays only")
    if peer is None:
        raise ValueError(f"{fn}: {peer_name}=None (any source) is not supported; name the peer rank")
    check_rank(fn, peer_name, peer, comm.size)
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < USER_TAG_LIMIT:
        raise ValueError(f"{fn}: tag={tag!r} must be an int in [0, {USER_TAG_LIMIT})")
    if peer == comm.rank:  # as torch.distributed: a rank's message to itself would wait for itself
        raise ValueError(f"{fn}: {peer_name}={peer} is this rank itself (rank {comm.rank} of {comm.name}); "
                         f"copy the tensor instead")
    return comm, x


class P2PWork:
    """Handle of a point-to-point transfer: ``wait()`` blocks up to the communicator's deadline."""

    def __init__(self, comm, requests, what: str):
        self._comm, self._requests, self._what = comm, requests, what

    def is_completed(self) -> bool:
        return all(r.test() for r in self._requests)

    def wait(self, timeout=None) -> bool:
        wait_all(self._requests, self._comm.deadline(timeout, self._what), self._what)
        return True


def isend(tensor, dst: int, group=None, tag: int = 0) -> P2PWork:
    """Start sending ``tensor`` to rank ``dst`` of ``group``; returns a handle with ``wait()``."""
    comm, x = _check("isend", tensor, "dst", dst, group, tag)
    return P2PWork(comm, [comm.transport.isend(x, dst, tag)], "isend")


def irecv(tensor, src: int, group=None, tag: int = 0) -> P2PWork:
    """Start receiving into ``tensor`` from rank ``src`` of ``group``; returns a handle with ``wait()``."""
    comm, x = _check("irecv", tensor, "src", src, group, tag)
    return P2PWork(comm, [comm.transport.irecv(x, src, tag)], "irecv")


def send(tensor, dst: int, group=None, tag: int = 0) -> None:
    """Send ``tensor`` to rank ``dst``; returns when the buffer may be reused (deadline applies)."""
    isend(tensor, dst, group, tag).wait()


def recv(tensor, src: int, group=None, tag: int = 0) -> int:
    """Receive into ``tensor`` from rank ``src``; returns ``src`` like torch.distributed.recv."""
    irecv(tensor, src, group, tag).wait()
    return src


@dataclasses.dataclass
class P2POp:
    """One transfer for ``batch_isend_irecv``: ``op`` is ``xelink.isend`` or ``xelink.irecv``."""

    op: object
    tensor: object
    peer: int
    group: object = None
    tag: int = 0

    def __post_init__(self):
        if self.op not in (isend, irecv):
            raise ValueError(f"P2POp: op={self.op!r} must be xelink.isend or xelink.irecv")


def batch_isend_irecv(p2p_op_list) -> list:
    """Start every transfer of the list (receives first, so no send waits on a later receive).

    Returns one handle per op, in the order given.
    """
    ops = list(p2p_op_list)
    if not ops or not all(isinstance(o, P2POp) for o in ops):
        raise ValueError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    for o in ops:  # every op is checked before any starts: a bad one leaves nothing posted
        _check(o.op.__name__, o.tensor, "dst" if o.op is isend else "src", o.peer, o.group, o.tag)
    handles = [None] * len(ops)
    for i in sorted(range(len(ops)), key=lambda i: ops[i].op is isend):
        o = ops[i]
        handles[i] = o.op(o.tensor, o.peer, o.group, o.tag)
    return handles
