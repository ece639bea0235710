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
A group keeps at most ``XELINK_DIST_GRAPHS`` graphs per device (default 512: a tensor-parallel model makes
four calls a layer, 126 layers for the largest Llama), holding at most ``XELINK_DIST_GRAPH_MB`` MiB of
temporaries in their pools (default 2048: the reduce-scatter's partials and float32 sum; the gather's
schedules have none). When they are all taken, a new key replaces the least recently used graphs only if
they went unused for ``STALE_CALLS`` calls of the group; otherwise it runs eagerly (a graph whose pool alone
exceeds the budget too). So a loop over more keys than fit (the layers of a model, each its own weight)
keeps replaying the graphs it has and runs the rest eagerly, never capturing again and again, while graphs
of shapes no longer called give way. A key whose capture fails runs eagerly from then on. Calls whose
tensors never repeat (outputs kept alive, fresh inputs) run the eager schedule; this module adds the key
(a few us).
"""
from __future__ import annotations

import collections
import logging

import torch

from .. import config, symm
from ..kernels.common import gc_paused

__all__ = ["DEFAULT_LIMIT", "DEFAULT_MB", "STALE_CALLS", "limit", "budget", "key_of", "run"]

DEFAULT_LIMIT = 512
DEFAULT_MB = 2048
STALE_CALLS = 1000  # calls of the group after which an unused graph may give way to a new key
# Keys seen once (and keys refused a graph), kept until this many (then forgotten together): far above the
# limit, or a loop over more keys than this would forget each before its second call and never capture it.
_SEEN_MAX = 4096
_log = logging.getLogger("xelink.dist")  # under the xelink logger (xelink.log configures it)


def limit() -> int:
    """Graphs a group keeps per device (``XELINK_DIST_GRAPHS``; 0 turns the replays off)."""
    return config.env_int("XELINK_DIST_GRAPHS", DEFAULT_LIMIT, 0)


def budget() -> int:
    """Bytes of temporaries a group's graphs may hold per device (``XELINK_DIST_GRAPH_MB``)."""
    return config.env_int("XELINK_DIST_GRAPH_MB", DEFAULT_MB, 0) << 20


def _remember(keys: set, key) -> None:
    """Add ``key`` to a set of keys bounded by ``_SEEN_MAX`` (full: all forgotten, keys of addresses long gone;
    a forgotten key costs one more eager call or capture attempt at worst)."""
    if len(keys) >= _SEEN_MAX:
        keys.clear()
    keys.add(key)


def key_of(*tensors) -> tuple:
    """What of ``tensors`` a graph holds: each one's address, shape and strides."""
    return tuple((t.data_ptr(), t.shape, t.stride()) for t in tensors)


class _Graphs:
    """One group's remembered schedules on one device (a resource of the group: ``free()`` drops them
    before the buffers they point at)."""

    def __init__(self, device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # key -> [graph, the call that last used it, bytes its pool holds], least recently used first
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.seen: set = set()
        self.never: set = set()
        self.calls = 0  # calls that came here (the clock of STALE_CALLS)
        self.replays = 0  # calls that replayed a graph (tests, benchmarks)

    def refuse(self, key) -> None:
        """Run ``key`` eagerly from now on (its capture failed, or its pool does not fit the budget)."""
        _remember(self.never, key)

    def held(self) -> int:
        return sum(e[2] for e in self.graphs.values())

    def make_room(self, keep: int, nbytes: int, new=None) -> bool:
        """Drop stale graphs, least recently used first, until there is a place for one more (``new`` None)
        or the graphs (``new`` among them) hold at most ``nbytes``; whether that was reached. Graphs over a
        limit that went down since are dropped, stale or not."""
        while len(self.graphs) > keep:
            self.graphs.popitem(last=False)
        slot = 1 if new is None else 0
        while len(self.graphs) + slot > keep or self.held() > nbytes:
            key, (_, last, _) = next(iter(self.graphs.items()))
            if key == new or self.calls - last < STALE_CALLS:
                return False
            self.graphs.popitem(last=False)
        return True

    def capture(self, key, body, fn: str, keep: int, nbytes: int):
        """The graph of ``body`` kept under ``key``, or None (capture failed, or no room for its pool)."""
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_reserved(self.device)
        try:
            with torch.cuda.stream(self.stream), gc_paused(collect=False):  # kernels.common.gc_paused says why
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - a schedule capture refuses runs eagerly instead
            _log.debug("%s: the schedule could not be captured (%s: %s); eager calls for this key", fn,
                       type(e).__name__, e)
            self.refuse(key)
            return None
        pool = max(0, torch.cuda.memory_reserved(self.device) - before)
        self.graphs[key] = [graph, self.calls, pool]
        if not self.make_room(keep, nbytes, new=key):
            del self.graphs[key]  # its temporaries do not fit the budget: eager calls
            self.refuse(key)
            return None
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
    gs.calls += 1
    entry = gs.graphs.get(key)
    if entry is not None:
        gs.graphs.move_to_end(key)
        entry[1] = gs.calls
        graph = entry[0]
    else:
        nbytes = budget()
        if key not in gs.seen or key in gs.never or not gs.make_room(keep, nbytes):
            _remember(gs.seen, key)
            body()
            return
        gs.seen.discard(key)
        graph = gs.capture(key, body, fn, keep, nbytes)
        if graph is None:
            body()
            return
    symm.team_of(comm).check(fn)
    gs.replays += 1
    graph.replay()
