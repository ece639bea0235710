"""What every collective shares: argument checks, reduction ops, chunking, message steps, async handles."""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable, Sequence

import numpy as np
import torch

from ..comm import Communicator, resolve_group
from ..errors import TimeoutError
from ..transport import Deadline, wait_all

__all__ = ["Work", "ReduceOp", "DTYPES", "REDUCE_DTYPES"]

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
REDUCE_DTYPES = DTYPES
_HALF = (torch.float16, torch.bfloat16)
# Point-to-point tags of users live below this bound; collectives use the tags above it, so the two
# never match each other's messages on the same transport.
USER_TAG_LIMIT = 1 << 14


class ReduceOp:
    """Reduction names accepted by ``op=`` (torch's ``ReduceOp`` values are accepted too)."""

    SUM, AVG, MAX, MIN, PROD = "sum", "avg", "max", "min", "prod"
    ALL = (SUM, AVG, MAX, MIN, PROD)


def is_cuda(x) -> bool:
    """Whether ``x`` is a CUDA tensor (the collectives then run on the GPU path, ``collectives/gpu.py``)."""
    return isinstance(x, torch.Tensor) and x.is_cuda


def parse_op(fn: str, op) -> str:
    name = op
    if not isinstance(op, str):
        # torch.distributed.ReduceOp and its RedOpType members print as e.g. "RedOpType.SUM"/"SUM".
        name = str(getattr(op, "name", op)).rsplit(".", 1)[-1]
    name = name.lower()
    if name not in ReduceOp.ALL:
        raise ValueError(f"{fn}: op={op!r} is not one of {', '.join(ReduceOp.ALL)}")
    return name


def as_tensor(fn: str, name: str, x, *, reduce: bool = False) -> torch.Tensor:
    """The torch CPU tensor behind ``x`` (a numpy array is wrapped without a copy), checked."""
    if isinstance(x, np.ndarray):
        if not (x.flags.c_contiguous and x.flags.writeable):
            raise ValueError(f"{fn}: {name} must be a C-contiguous, writeable numpy array")
        try:
            x = torch.from_numpy(x)
        except TypeError:
            raise TypeError(f"{fn}: {name} has numpy dtype {x.dtype}, which torch cannot wrap") from None
    elif not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{fn}: {name} is on {x.device}; this op moves CPU tensors only (CUDA tensors "
                         f"go through all_reduce, all_gather(_into_tensor), reduce_scatter_tensor and "
                         f"all_to_all_single)")
    if not x.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (call .contiguous() first)")
    if reduce and x.dtype not in REDUCE_DTYPES:
        raise TypeError(f"{fn}: {name}.dtype={x.dtype} is not reducible here; use one of "
                        f"{', '.join(str(d).replace('torch.', '') for d in REDUCE_DTYPES)}")
    return x


def output_input(fn: str, output, input, *, reduce: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``as_tensor`` of an op's output and input, which must share a dtype."""
    out = as_tensor(fn, "output", output, reduce=reduce)
    inp = as_tensor(fn, "input", input, reduce=reduce)
    if out.dtype != inp.dtype:
        raise TypeError(f"{fn}: output.dtype={out.dtype} != input.dtype={inp.dtype}")
    return out, inp


def check_op_dtype(fn: str, op: str, dtype: torch.dtype) -> None:
    if op == ReduceOp.AVG and not dtype.is_floating_point:
        raise TypeError(f"{fn}: op='avg' needs a floating dtype, got {dtype}")


def check_algo(fn: str, algo, choices: Sequence[str]) -> str:
    if algo != "auto" and algo not in choices:
        raise ValueError(f"{fn}: algo={algo!r} is not one of auto, {', '.join(choices)}")
    return algo


def check_rank(fn: str, name: str, value, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name}={value!r} must be an int")
    if not 0 <= value < size:
        raise ValueError(f"{fn}: {name}={value} is out of range for a group of size {size}")
    return value


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types are reduced in float32; everything else in its own type."""
    return torch.float32 if dtype in _HALF else dtype


def combine(acc: torch.Tensor, x: torch.Tensor, op: str) -> None:
    """acc = op(acc, x), in place; ``avg`` sums (the caller divides once at the end)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(x)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, x, out=acc)
    elif op == ReduceOp.MIN:
        torch.minimum(acc, x, out=acc)
    else:
        acc.mul_(x)


def finish(acc: torch.Tensor, op: str, n: int) -> torch.Tensor:
    if op == ReduceOp.AVG:
        acc.div_(n)
    return acc


def bounds(count: int, n: int) -> list[int]:
    """Offsets of n nearly equal chunks of ``count`` (the first ``count % n`` one element longer)."""
    base, extra = divmod(count, n)
    out = [0]
    for i in range(n):
        out.append(out[-1] + base + (1 if i < extra else 0))
    return out


def tag_for(comm: Communicator) -> int:
    """A fresh tag for one collective call: every rank calls collectives in the same order."""
    seq = getattr(comm, "_coll_seq", 0)
    comm._coll_seq = seq + 1
    return USER_TAG_LIMIT + seq % USER_TAG_LIMIT


def step(comm: Communicator, sends: Sequence, recvs: Sequence, tag: int, deadline: Deadline, what: str) -> None:
    """One communication step: post every receive and send, wait for all of them.

    ``sends``/``recvs`` are lists of (peer, tensor). Receives are posted first so that no send waits
    for a matching receive that is posted later.
    """
    t = comm.transport
    reqs = [t.irecv(buf, peer, tag) for peer, buf in recvs if buf.numel()]
    reqs += [t.isend(buf, peer, tag) for peer, buf in sends if buf.numel()]
    if reqs:
        try:
            wait_all(reqs, deadline, what)
        except TimeoutError as exc:
            raise exc.restate(group=exc.group or comm)


class Work:
    """Handle of an ``async_op=True`` call, like torch.distributed's ``Work``.

    ``wait()`` blocks until the operation has finished (or raises its error); ``is_completed()``
    polls. A wait has a deadline: the communicator's timeout unless ``timeout`` is given.
    """

    def __init__(self, future: concurrent.futures.Future, what: str, timeout: float):
        self._future, self._what, self._timeout = future, what, timeout

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        limit = self._timeout if timeout is None else timeout
        try:
            self._future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            from ..errors import TimeoutError

            raise TimeoutError(self._what, [], limit, "the operation is still running") from None
        return True

    def result(self):
        self.wait()
        return self._future.result()


def run(comm: Communicator, what: str, body: Callable[[Deadline], object], async_op: bool, timeout=None):
    """Run ``body(deadline)`` now, or on the communicator's worker thread when ``async_op``.

    The deadline (``timeout`` or the communicator's) starts when the operation starts. All calls on
    a communicator keep their order: a synchronous call made while asynchronous ones are pending
    queues behind them instead of overtaking them on the wire.
    """
    if timeout is not None:
        from ..runtime import resolve_timeout

        timeout = resolve_timeout(timeout, what)
    fn = lambda: _entered(comm, what, body, timeout)  # noqa: E731
    worker = getattr(comm, "_worker", None)
    pending = getattr(comm, "_pending", 0)
    if not async_op and pending == 0:
        return fn()
    if worker is None:
        worker = comm._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"xelink-{comm.name}")
        comm._pending_lock = threading.Lock()
    with comm._pending_lock:
        comm._pending = getattr(comm, "_pending", 0) + 1

    def task():
        try:
            return fn()
        finally:
            with comm._pending_lock:
                comm._pending -= 1

    future = worker.submit(task)
    if async_op:
        return Work(future, what, comm.timeout if timeout is None else timeout)
    return future.result()


def _entered(comm: Communicator, what: str, body: Callable[[Deadline], object], timeout):
    """Run one collective's ``body``: post its start on the progress board, and make its timeout name
    the ranks of ``comm`` (not of a sub-group it ran on) and those furthest behind."""
    comm.calls += 1
    board = comm.board
    if board is not None:
        board.enter(comm.board_id, comm.calls)
    deadline = comm.deadline(timeout, what)
    try:
        return body(deadline)
    except TimeoutError as exc:
        raise _restate(comm, exc, deadline)


def _restate(comm: Communicator, exc: TimeoutError, deadline: Deadline) -> TimeoutError:
    if exc.group is not None and exc.group is not comm:  # a sub-group's ranks: say which ranks of comm
        here = {w: r for r, w in enumerate(comm.world_ranks)}
        exc.restate(missing=[here[w] for w in (exc.group.world_ranks[m] for m in exc.missing) if w in here])
    exc.restate(group=comm)
    board = comm.board
    rows = {} if board is None else board.entries()
    rows = {r: rows[w] for r, w in enumerate(comm.world_ranks) if w in rows}
    if not rows:
        return exc
    # Ranks not inside this call: on another communicator's collective (or none since), or behind
    # on this one; of the latter, those furthest behind.
    elsewhere = [r for r, (cid, _, _) in rows.items() if cid != comm.board_id]
    lagging = {r: seq for r, (cid, seq, _) in rows.items() if cid == comm.board_id and seq < comm.calls}
    if elsewhere or lagging:
        least = min(lagging.values(), default=None)
        behind = elsewhere + [r for r, seq in lagging.items() if seq == least]
        parts = []
        if least is not None:
            parts.append(f"last entered call #{least} on {comm.name}, this rank is in #{comm.calls}")
        if elsewhere:
            parts.append(f"rank(s) {', '.join(map(str, elsewhere))} last entered a collective of another "
                         f"communicator")
        return exc.restate(behind=behind, behind_detail="; ".join(parts))
    # Everyone entered this call: name those who came after the first rank's deadline had passed.
    first = min(at for _, _, at in rows.values())
    late = [r for r, (_, _, at) in rows.items() if at - first > deadline.seconds * 1e9]
    if late:
        lag = max(rows[r][2] for r in late) - first
        who = "this rank " if late == [comm.rank] else ""
        return exc.restate(behind=late, behind_detail=f"{who}entered this call {lag / 1e9:.2f} s after the first "
                                                      f"rank, past the deadline")
    return exc


def group_of(group, fn: str) -> Communicator:
    comm = resolve_group(group, fn)
    if comm._broken is not None or comm._freed:
        comm._live(fn)
    return comm


def fingerprint_check(comm: Communicator, fn: str, signature: tuple) -> None:
    """With ``XELINK_CHECK=1`` (``comm.check_calls``): every rank must call the same op on the same shapes.

    Costs one control exchange per call, so it is off by default (like TORCH_DISTRIBUTED_DEBUG).
    """
    if not getattr(comm, "check_calls", False) or comm.size == 1:
        return
    seen = comm.allgather_object(signature)
    differ = [r for r, s in enumerate(seen) if s != signature]
    if differ:
        raise ValueError(f"{fn}: ranks disagree about the call: rank {comm.rank} has {signature}, rank "
                         f"{differ[0]} has {seen[differ[0]]}")
