"""Remembered schedules: an eager call of a CUDA distributed op that repeats an earlier call's tensors
replays a CUDA graph of its schedule instead of enqueuing its dozen kernels, copies, events and stream
waits one by one (the host time of an eager call, issue 21).

Why a replay is the same call: every piece of the schedules in ``device`` orders itself on the device
(``xelink.symm`` semaphores count on the device, events order streams inside the graph, the fused
kernels keep their epochs on the device), so a replay is a new call, as a user's own replay is. The graph
holds the addresses of the call's tensors, and the key is each tensor's address, shape and strides with
the op's other arguments, so a replay reads and writes exactly the memory the eager call would, with the
values they hold now. What a call returns is allocated by the caller before the schedule (never in the
graph's private pool, which holds only the schedule's temporaries), so results of successive calls never
share memory.

When: the first call of a key runs eagerly (it also does a shape's set-up: symmetric buffers, scratch,
compilation, which capture refuses); the second captures the schedule on a stream of its own and
replays it; later ones replay. Eager throughout when the current stream is capturing (the user's graph
records the schedule itself), when a test hook of ``device`` is set, or with ``XELINK_DIST_GRAPHS=0``.
A group keeps at most ``XELINK_DIST_GRAPHS`` graphs (default 8) per device, the least recently used
dropped first (with its pool); a key whose capture fails runs eagerly from then on. Calls whose tensors
never repeat (outputs kept alive, fresh inputs) run eagerly and pay only the key (a few us).
"""
from __future__ import annotations

import collections

import torch

from .. import config, symm
from ..log import get_logger

__all__ = ["DEFAULT_LIMIT", "limit", "key_of", "run"]

DEFAULT_LIMIT = 8
_SEEN_MAX = 256  # keys seen once, kept until this many (then forgotten together)
_log = get_logger("dist")


def limit() -> int:
    """Graphs a group keeps per device (``XELINK_DIST_GRAPHS``; 0 turns the replays off)."""
    return config.env_int("XELINK_DIST_GRAPHS", DEFAULT_LIMIT)


def key_of(*tensors) -> tuple:
    """What of ``tensors`` a graph holds: each one's address, shape and strides."""
    return tuple((t.data_ptr(), t.shape, t.stride()) for t in tensors)


class _Graphs:
    """One group's remembered schedules on one device (a resource of the group: ``free()`` drops them
    before the buffers they point at)."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.seen: set = set()
        self.never: set = set()
        self.replays = 0  # eager calls that replayed a graph (tests, benchmarks)

    def capture(self, key, body, fn: str):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self.stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - a schedule capture refuses runs eagerly instead
            _log.debug("%s: the schedule could not be captured (%s: %s); eager calls for this key", fn,
                       type(e).__name__, e)
            self.never.add(key)
            return None
        self.graphs[key] = graph
        return graph

    def close(self) -> None:
        self.graphs.clear()
        self.seen.clear()


def run(comm, device, fn: str, key, body, hooked: bool = False) -> None:
    """Run ``body`` (a schedule that enqueues its work on the current stream and returns nothing) as the
    eager call, or as a replay of its graph remembered under ``key`` (module docstring)."""
    keep = limit()
    if keep <= 0 or hooked or torch.cuda.is_current_stream_capturing():
        body()
        return
    gs = comm.resource(("xelink.dist", "graphs", str(device)), lambda: _Graphs(device))
    graph = gs.graphs.get(key)
    if graph is not None:
        gs.graphs.move_to_end(key)
    else:
        if key not in gs.seen or key in gs.never:
            if len(gs.seen) >= _SEEN_MAX:
                gs.seen.clear()
            gs.seen.add(key)
            body()
            return
        gs.seen.discard(key)
        graph = gs.capture(key, body, fn)
        if graph is None:
            body()
            return
        while len(gs.graphs) > keep:
            gs.graphs.popitem(last=False)
    symm.team_of(comm).check(fn)
    gs.replays += 1
    graph.replay()
