"""Point-to-point: send, recv, isend, irecv, batch_isend_irecv, on CPU tensors and numpy arrays (the host
transport; ``wait()`` blocks the host) and on CUDA tensors (``gpu.p2p``: peer memory or NCCL, stream-ordered;
``wait()`` makes the current stream wait, as torch.distributed's NCCL works do); send_object_list and
recv_object_list (picklable objects, through the host transport)."""
from __future__ import annotations

import dataclasses
import pickle

import torch

from ..config import is_int
from ..errors import TimeoutError
from ..transport import wait_all
from ..transport.base import OBJECT_TAG as _OBJECT_TAG, USER_TAG_LIMIT
from ..work import Work as Handle
from .checks import group_of, root_of, shared_pair, tensor as _tensor

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "P2PWork", "send_object_list",
           "recv_object_list", "cuda_p2p_unsupported"]



def _check(fn, tensor, peer_name, peer, group_peer, group, tag):
    """(comm, the tensor, the peer as a rank of comm or None for any source): ``peer`` a world rank or
    ``group_peer`` a rank of the group, as torch.distributed's ``dst``/``group_dst`` and ``src``/``group_src``."""
    comm = group_of(group, fn)
    cuda = isinstance(tensor, torch.Tensor) and tensor.is_cuda
    if cuda:  # any dtype: the transfer moves bytes
        from .gpu import p2p as gpu_p2p

        gpu_p2p.check_tensor(fn, tensor, comm)
        x = tensor.detach() if tensor.requires_grad else tensor  # moved outside autograd, as checks.tensor
    else:
        x = _tensor(fn, "tensor", tensor, comm)
    if peer is None and group_peer is None:  # any source: a CPU receive (NCCL and peer memory name the sender)
        if peer_name != "src":
            raise ValueError(f"{fn}: dst= (a world rank) or group_dst= (a rank of the group) is required")
        if cuda:
            raise ValueError(f"{fn}: src=None (any source) needs a CPU tensor or numpy array; CUDA receives "
                             f"(NCCL, peer memory) name the sender")
        if comm.size == 1:
            raise ValueError(f"{fn}: src=None (any source) in a group of one rank ({comm.name}): no other rank "
                             f"can send")
    else:
        given = f"{peer_name}={peer}" if group_peer is None else f"group_{peer_name}={group_peer}"
        peer = root_of(fn, comm, peer_name, peer, group_peer)
    if not is_int(tag) or not 0 <= tag < USER_TAG_LIMIT:
        raise ValueError(f"{fn}: tag={tag!r} must be an int in [0, {USER_TAG_LIMIT})")
    tag = int(tag)
    if peer == comm.rank:  # as torch.distributed: a rank's message to itself would wait for itself
        raise ValueError(f"{fn}: {given} is this rank itself (rank {comm.rank} of {comm.name}, world rank "
                         f"{comm.world_ranks[comm.rank]}); copy the tensor instead")
    if cuda:
        problem = gpu_p2p.unsupported(comm)
        if problem is not None:
            raise problem
    return comm, x, peer


def _start(fn, comm, x, peer, tag, send):
    if x.is_cuda:
        from .gpu import p2p as gpu_p2p

        work = gpu_p2p.start(comm, x, peer, send)
    else:
        t = comm.transport
        work = P2PWork(comm, [t.isend(x, peer, tag) if send else t.irecv(x, peer, tag)], fn)
    work.outputs = [] if send else [x]  # the received tensor: result() and the future's value, as torch's
    return work


class P2PWork(Handle):
    """Handle of a point-to-point transfer: ``wait()`` blocks up to the communicator's deadline and raises the
    transfer's error (a receive of another size than was sent, the deadline) on every call, as torch's Work;
    ``is_completed()`` is True once it ended either way; ``source_rank()`` names the sender of a receive (of an
    any-source one once it completed)."""

    def __init__(self, comm, requests, what: str):
        self._comm, self._requests, self._what = comm, requests, what
        self._error: Exception | None = None

    def is_completed(self) -> bool:
        if self._error is not None:
            return True
        try:
            return all(r.test() for r in self._requests)
        except ValueError as exc:  # (the transport's SizeMismatch: the transfer ended)
            self._error = ValueError(f"{self._what}: {exc}")
            return True

    def wait(self, timeout=None) -> bool:
        if self._error is not None:
            raise self._error
        try:
            wait_all(self._requests, self._comm.deadline(timeout, self._what), self._what)
        except TimeoutError as exc:  # (its transfers were cancelled: it cannot complete later)
            if self._requests[0].peer is None:  # an any-source receive: no rank sent
                exc.restate(missing=[p for p in range(self._comm.size) if p != self._comm.rank])
            self._error = exc.restate(group=self._comm)
            raise exc from None
        except ValueError as exc:
            self._error = exc
            raise
        return True

    def source_rank(self) -> int:
        """The rank (of the group) this receive came from, as torch.distributed's ``Work.source_rank``; a
        ``RuntimeError`` before an any-source receive completed."""
        peer = self._requests[0].peer
        if peer is None:
            raise RuntimeError(f"{self._what}: source_rank() of an any-source receive that has not completed "
                               f"(wait() first)")
        return peer


def isend(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    """Start sending ``tensor`` to ``dst`` (a world rank) or ``group_dst`` (a rank of ``group``), as
    torch.distributed's; returns a handle with ``wait()``.

    CPU tensors: ``wait()`` blocks until the buffer may be reused (deadline applies). CUDA tensors: the
    transfer is enqueued after the work queued on the current stream; ``wait()`` makes the current stream
    wait for it; messages to one rank match its receives in order (tags are not matched, as with NCCL).
    """
    return _isend("isend", tensor, dst, group, tag, group_dst)


def _isend(fn: str, tensor, dst, group, tag, group_dst):
    comm, x, peer = _check(fn, tensor, "dst", dst, group_dst, group, tag)
    return _start(fn, comm, x, peer, tag, True)


def irecv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    """Start receiving into ``tensor`` from ``src`` (a world rank) or ``group_src`` (a rank of ``group``);
    returns a handle with ``wait()`` (see ``isend`` for CUDA tensors) and ``source_rank()``. Neither: from
    whichever rank sends a message with this tag first (CPU tensors and numpy arrays; a CUDA receive names
    its sender)."""
    comm, x, peer = _check("irecv", tensor, "src", src, group_src, group, tag)
    work = _start("irecv", comm, x, peer, tag, False)
    work.outputs = [tensor]  # (a numpy array as passed, as the collectives' handles give theirs)
    return work


def send(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst`` / ``group_dst``: ``isend(...).wait()`` (CUDA: ordered on the current stream)."""
    _isend("send", tensor, dst, group, tag, group_dst).wait()


def recv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` / ``group_src`` (neither: any rank, as ``irecv``); returns the
    sender's world rank, as torch.distributed.recv."""
    comm, x, peer = _check("recv", tensor, "src", src, group_src, group, tag)
    work = _start("recv", comm, x, peer, tag, False)
    work.wait()
    return comm.world_ranks[peer if peer is not None else work.source_rank()]


@dataclasses.dataclass
class P2POp:
    """One transfer for ``batch_isend_irecv``: ``op`` is ``xelink.isend`` or ``xelink.irecv``; the peer is
    ``peer`` (a world rank) or ``group_peer`` (a rank of ``group``), as torch.distributed's."""

    op: object
    tensor: object
    peer: int | None = None
    group: object = None
    tag: int = 0
    group_peer: int | None = None

    def __post_init__(self):
        if self.op not in (isend, irecv):
            raise ValueError(f"P2POp: op={self.op!r} must be xelink.isend or xelink.irecv")


def cuda_p2p_unsupported(group=None) -> str | None:
    """Why point-to-point on CUDA tensors cannot run on ``group`` (None: it can, through peer memory or NCCL): what
    the first CUDA ``isend`` / ``irecv`` would raise, asked before any is posted (a schedule that checks its
    arguments before anything moves)."""
    from .gpu import p2p as gpu_p2p

    problem = gpu_p2p.unsupported(group_of(group, "cuda_p2p_unsupported"))
    return None if problem is None else str(problem)


def batch_isend_irecv(p2p_op_list) -> list:
    """Start every transfer of the list (receives first, so no send waits on a later receive).

    Returns one handle per op, in the order given.
    """
    ops = list(p2p_op_list)
    if not ops or not all(isinstance(o, P2POp) for o in ops):
        raise ValueError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    checked = [_check("batch_isend_irecv", o.tensor, "dst" if o.op is isend else "src", o.peer, o.group_peer,
                      o.group, o.tag)[1] for o in ops]  # every op checked before any starts: nothing posted then
    pair = shared_pair([(x, o.op is irecv) for x, o in zip(checked, ops)])
    if pair is not None:  # (the transfers run at once: a send would read what a receive writes)
        raise ValueError(f"batch_isend_irecv: ops {pair[0]} and {pair[1]} of the list share memory, one of them a "
                         f"receive (the transfers run at once: give each receive a buffer of its own)")
    handles = [None] * len(ops)
    for i in sorted(range(len(ops)), key=lambda i: ops[i].op is isend):
        o = ops[i]
        handles[i] = o.op(o.tensor, o.peer, o.group, o.tag, o.group_peer)
    return handles


def send_object_list(object_list, dst: int | None = None, group=None, device=None, group_dst: int | None = None,
                     use_batch: bool = False, *, timeout=None) -> None:
    """Send the picklable objects of ``object_list`` to ``dst`` (a world rank) or ``group_dst`` (a rank of
    ``group``), as torch.distributed.send_object_list; that rank's ``recv_object_list`` takes a list of as
    many entries. Through the host transport whatever ``device`` and ``use_batch`` (taken for torch's
    signature: the list always moves as one message after its size); returns once the receiver may have the
    objects (deadline: ``timeout`` or the group's).
    """
    fn = "send_object_list"
    if not isinstance(object_list, (list, tuple)):
        raise TypeError(f"{fn}: object_list must be a list, got {type(object_list).__name__}")
    header = torch.zeros(2, dtype=torch.int64)
    comm, _, peer = _check(fn, header, "dst", dst, group_dst, group, 0)
    payload = torch.frombuffer(bytearray(pickle.dumps(list(object_list))), dtype=torch.uint8)  # before any message
    header[0], header[1] = len(object_list), payload.numel()
    t = comm.transport
    P2PWork(comm, [t.isend(header, peer, _OBJECT_TAG), t.isend(payload, peer, _OBJECT_TAG)], fn).wait(timeout)


def recv_object_list(object_list, src: int | None = None, group=None, device=None, group_src: int | None = None,
                     use_batch: bool = False, *, timeout=None) -> int:
    """Fill ``object_list`` with the objects ``src`` (a world rank) or ``group_src`` (a rank of ``group``) sent
    by ``send_object_list``; neither: the first rank that sends; returns the sender's world rank, as
    torch.distributed.recv_object_list. A ValueError (after the whole message came, so nothing is left
    queued) where the sender's list has another length than ``object_list``.
    """
    fn = "recv_object_list"
    if not isinstance(object_list, list):
        raise TypeError(f"{fn}: object_list must be a list, got {type(object_list).__name__}")
    header = torch.zeros(2, dtype=torch.int64)
    comm, _, peer = _check(fn, header, "src", src, group_src, group, 0)
    t = comm.transport
    work = P2PWork(comm, [t.irecv(header, peer, _OBJECT_TAG)], fn)
    work.wait(timeout)
    peer = work.source_rank()
    payload = torch.empty(int(header[1]), dtype=torch.uint8)
    P2PWork(comm, [t.irecv(payload, peer, _OBJECT_TAG)], fn).wait(timeout)
    got = pickle.loads(payload.numpy().tobytes())
    if len(got) != len(object_list):
        raise ValueError(f"{fn}: object_list has {len(object_list)} entries on rank {comm.rank}; world rank "
                         f"{comm.world_ranks[peer]} sent {len(got)}")
    object_list[:] = got
    return comm.world_ranks[peer]
