"""What the CPU schedules share: reductions, chunking, message steps, and running a call (now, or on the
communicator's worker thread for ``async_op``), with the progress board that names late ranks."""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Sequence

import torch

from ...comm import Communicator
from ...config import resolve_timeout
from ...errors import TimeoutError
from ...transport import Deadline, wait_all
from ...transport.base import COLLECTIVE_TAGS
from ...work import Work as Handle
from ...kernels.common import spans_overlap
from ..checks import ReduceOp

__all__ = ["Work", "run", "step", "tag_for", "state", "work_dtype", "copy_as", "work_copy", "combine", "finish",
           "reduce_into", "bounds", "chunks"]

_HALF = (torch.float16, torch.bfloat16)


class _State:
    """The CPU backend's state of one communicator (its resource ``"cpu"``): the tag counter of the
    collectives, the worker thread of asynchronous calls, and the shared-memory window of the
    one-shot all-reduce (``window_refused``: the smallest call in bytes for which this host's shared-memory
    filesystem had no room; as large or larger calls go by messages without asking again)."""

    def __init__(self):
        self.call = self.taken = 0  # the call (Communicator.issued) whose tags tag_for hands out; how many so far
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.worker_thread: int | None = None
        self.pending = 0
        self.lock = threading.Lock()
        self.window = None
        self.window_refused = float("inf")

    def start_worker(self, name: str) -> concurrent.futures.ThreadPoolExecutor:
        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"xelink-{name}",
                initializer=lambda: setattr(self, "worker_thread", threading.get_ident()))
        return self.worker

    def quiesce(self, comm: Communicator, fn: str) -> None:
        """Wait (under the communicator's timeout) until the calls queued on the worker have run; nothing to
        wait for on the worker thread itself (its own calls' exchanges are in order)."""
        if self.worker is None or self.pending == 0 or threading.get_ident() == self.worker_thread:
            return
        try:
            self.worker.submit(lambda: None).result(timeout=comm.timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(fn, [], comm.timeout, "the communicator's asynchronous operations are still "
                               "running") from None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=False)
            self.worker = None


def state(comm: Communicator) -> _State:
    found = comm._resources.get("cpu")
    return found if found is not None else comm.attach("cpu", _State())


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types are reduced in float32; everything else in its own type."""
    return torch.float32 if dtype in _HALF else dtype


def copy_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``x`` in ``dtype`` (``x.to(dtype, copy=True)``; ``clone`` where the type stays: half the host
    time, which counts in a small call)."""
    return x.clone() if x.dtype == dtype else x.to(dtype)


def work_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in its work type (``work_dtype``), as an accumulator."""
    return copy_as(x, work_dtype(x.dtype))


def combine(acc: torch.Tensor, x: torch.Tensor, op: str) -> None:
    """acc = op(acc, x), in place; ``avg`` sums (the caller divides once at the end)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(x)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, x, out=acc)
    elif op == ReduceOp.MIN:
        torch.minimum(acc, x, out=acc)
    elif op == ReduceOp.PROD:
        acc.mul_(x)
    else:
        _FIRST[op](acc, x, out=acc)


def finish(acc: torch.Tensor, op: str, n: int) -> torch.Tensor:
    if op == ReduceOp.AVG:
        acc.div_(n)
    return acc


_FIRST = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.MAX: torch.maximum,
          ReduceOp.MIN: torch.minimum, ReduceOp.PROD: torch.mul, ReduceOp.BAND: torch.bitwise_and,
          ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}


def reduce_into(out: torch.Tensor, parts: list, op: str, *, disjoint: bool | None = None) -> None:
    """``out`` = ``op`` over ``parts`` in their order (half types through a float32 accumulator), the same bits
    on every rank: combining a copy of ``parts[0]`` with the rest, in order. Where ``out`` is its own work type
    and shares no storage with a part, the first two parts combine straight into ``out`` (no accumulator copy:
    the one-shot all-reduce's small calls are mostly such tensor ops). ``disjoint``: the caller knows whether a
    part shares memory with ``out`` (None: looked up here, by address range)."""
    if work_dtype(out.dtype) == out.dtype and len(parts) >= 2:
        if disjoint is None:
            disjoint = not any(spans_overlap(out, p) for p in parts)
        if disjoint:
            _FIRST[op](parts[0], parts[1], out=out)
            for part in parts[2:]:
                combine(out, part, op)
            finish(out, op, len(parts))
            return
    acc = copy_as(parts[0], work_dtype(out.dtype))
    for part in parts[1:]:
        combine(acc, part, op)
    out.copy_(finish(acc, op, len(parts)))


def bounds(count: int, n: int) -> list[int]:
    """Offsets of n nearly equal chunks of ``count`` (the first ``count % n`` one element longer)."""
    base, extra = divmod(count, n)
    out = [0]
    for i in range(n):
        out.append(out[-1] + base + (1 if i < extra else 0))
    return out


def chunks(t: torch.Tensor, b: Sequence[int]) -> tuple:
    """The views ``t[b[i]:b[i + 1]]`` of a flat ``t`` that offsets ``b`` cover from 0 to its end, made in one call
    (slicing each costs about as much as the split)."""
    return t.split_with_sizes([hi - lo for lo, hi in zip(b, b[1:])])


# The tags of one collective call: a block of this many a call (a call takes at most three).
TAGS_PER_CALL = 8


def tag_for(comm: Communicator) -> int:
    """A fresh tag for a step of the running collective call.

    Each call takes its tags from a block of its own, numbered by the call (``Communicator.issued``, counted
    on every rank as the call starts, even where the call's checks then refuse it), so that the messages of
    a call that a rank refused or timed out cannot be taken by a later call of that rank: its tags differ
    until they come round again (2**26 calls under MPICH). Each communicator starts its blocks at its own
    offset (from its id), so that a message a timed-out call of a freed communicator left queued is unlikely
    to match a call of a new one that MPI gave the same context (``transport.mpi`` drains such messages when a
    communicator is freed, too).
    """
    st = state(comm)
    st.taken += 1
    blocks = (comm.transport.tag_limit - COLLECTIVE_TAGS) // TAGS_PER_CALL
    return COLLECTIVE_TAGS + ((comm.board_id + st.call) % blocks) * TAGS_PER_CALL + (st.taken - 1) % TAGS_PER_CALL


def step(comm: Communicator, sends: Sequence, recvs: Sequence, tag: int, deadline: Deadline, what: str,
         empty: bool = False) -> None:
    """One communication step: post every receive and send, wait for all of them.

    ``sends``/``recvs`` are lists of (peer, tensor). Receives are posted first so that no send waits
    for a matching receive that is posted later. Empty tensors move nothing (both sides skip them), unless
    ``empty``: then they are messages too, for a step whose peers may disagree on which blocks are empty (a
    receiver that expects nothing takes a block sent to it as a size mismatch, not as nothing). A rank that
    only sends here sends synchronously: it learns from no receive that its peers took part, so a send nobody
    receives (ranks that disagree on a root) times out naming them rather than completing from MPI's buffer
    and staying queued for a later call.
    """
    t = comm.transport
    reqs = [t.irecv(buf, peer, tag) for peer, buf in recvs if empty or buf.numel()]
    sync = not reqs
    reqs += [t.isend(buf, peer, tag, sync) for peer, buf in sends if empty or buf.numel()]
    if reqs:
        try:
            wait_all(reqs, deadline, what)
        except TimeoutError as exc:
            raise exc.restate(group=exc.group or comm)


# How long ``Work.wait()`` waits past its operation's own deadline before it gives up on the operation itself.
_WAIT_GRACE_S = 5.0


class Work(Handle):
    """Handle of an ``async_op=True`` call on CPU ranks (the call runs on the communicator's worker thread), with
    torch.distributed's Work protocol (``xelink.work``): ``wait()`` blocks until the operation has finished (or
    raises its error: a ``TimeoutError`` naming the missing ranks at the operation's deadline, which starts when
    the worker starts it, after the calls queued before it); ``wait(timeout)`` waits at most ``timeout`` seconds.
    Its ``get_future()`` completes when the call does, without waiting."""

    def __init__(self, future: concurrent.futures.Future, what: str, timeout: float, started: list):
        self._future, self._what, self._timeout, self._started = future, what, timeout, started

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self, timeout=None) -> bool:
        # (The operation's own TimeoutError is a concurrent.futures.TimeoutError too: so the future is waited
        # for with ``concurrent.futures.wait``, and ``result()`` read only once it is done, raising that error.)
        if timeout is not None:
            limit = resolve_timeout(timeout, f"Work.wait of {self._what}")
            if not concurrent.futures.wait([self._future], timeout=limit).done:
                raise TimeoutError(self._what, [], limit, "the operation is still running")
            self._future.result()
            return True
        # (A wait of the operation's own length from now expired before the operation's deadline, which starts
        # later, and named no rank: the operation's error, which names them, came after it.)
        while not self._future.done():
            left = None if not self._started else self._started[0] + self._timeout + _WAIT_GRACE_S - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(self._what, [], self._timeout, "the operation is still running past its deadline")
            concurrent.futures.wait([self._future], timeout=1.0 if left is None else left)
        self._future.result()
        return True

    def get_future(self):
        future = torch.futures.Future()

        def done(call):
            error = call.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(list(self.outputs))

        self._future.add_done_callback(done)
        return future


def run(comm: Communicator, what: str, body: Callable[[Deadline], object], async_op: bool, timeout=None):
    """Run ``body(deadline)`` now, or on the communicator's worker thread when ``async_op``.

    The deadline (``timeout`` or the communicator's) starts when the operation starts. All calls on
    a communicator keep their order: a synchronous call made while asynchronous ones are pending
    queues behind them instead of overtaking them on the wire.
    """
    if timeout is not None:
        timeout = resolve_timeout(timeout, what)
    st = state(comm)
    call = comm.issued  # (the API counted this call as it started)
    if not async_op and st.pending == 0:
        return _entered(comm, what, body, timeout, call)
    fn = lambda: _entered(comm, what, body, timeout, call)  # noqa: E731
    st.start_worker(comm.name)
    with st.lock:
        st.pending += 1
    started: list = []  # when the worker starts the call (its deadline starts then)

    def task():
        started.append(time.monotonic())
        try:
            return fn()
        finally:
            with st.lock:
                st.pending -= 1

    future = st.worker.submit(task)
    if async_op:
        return Work(future, what, comm.timeout if timeout is None else timeout, started)
    return future.result()


def _entered(comm: Communicator, what: str, body: Callable[[Deadline], object], timeout, call: int):
    """Run one collective's ``body`` (of the API's call number ``call``: ``tag_for``): post its start on the
    progress board, and make its timeout name the ranks of ``comm`` (not of a sub-group it ran on) and those
    furthest behind."""
    st = state(comm)
    if st.call != call:
        st.call, st.taken = call, 0
    comm.calls += 1
    board = comm.board
    if board is not None:
        board.enter(comm.board_id, comm.calls)
    deadline = comm.deadline(timeout, what)
    try:
        return body(deadline)
    except TimeoutError as exc:
        # The ranks no longer agree on which messages belong to which call: the communicator (and
        # the sub-group the wait was on) refuse further use, as after an NCCL timeout.
        comm.fail(exc)
        if exc.group is not None:
            exc.group.fail(exc)
        raise _restate(comm, exc, deadline, what)
    except Exception as exc:
        # Part way through (a receive of another size than was sent, say): messages of this call may still be
        # in flight, so later calls could take them for theirs. Refuse them instead.
        comm.fail(exc)
        raise


def _restate(comm: Communicator, exc: TimeoutError, deadline: Deadline, what: str) -> TimeoutError:
    if exc.group is not None and exc.group is not comm:  # a sub-group's ranks: say which ranks of comm
        here = {w: r for r, w in enumerate(comm.world_ranks)}
        exc.restate(missing=[here[w] for w in (exc.group.world_ranks[m] for m in exc.missing) if w in here])
    exc.restate(group=comm, what=what)  # the call the user made (a step inside it may have waited)
    board = comm.board
    rows = {} if board is None else board.entries()
    rows = {r: rows[w] for r, w in enumerate(comm.world_ranks) if w in rows}
    if not rows:
        return exc
    # Ranks not inside this call: in none yet (a row never written), on another communicator's collective (or
    # none since), or behind on this one; of the latter, those furthest behind.
    never = [r for r, (_, seq, _) in rows.items() if seq == 0]
    elsewhere = [r for r, (cid, seq, _) in rows.items() if cid != comm.board_id and seq]
    lagging = {r: seq for r, (cid, seq, _) in rows.items() if cid == comm.board_id and 0 < seq < comm.calls}
    if never or elsewhere or lagging:
        least = min(lagging.values(), default=None)
        behind = never + elsewhere + [r for r, seq in lagging.items() if seq == least]
        parts = []
        if never:
            parts.append(f"rank(s) {', '.join(map(str, never))} entered no collective yet")
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
