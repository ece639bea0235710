"""torch.distributed host transport, used under torchrun: gloo point-to-point and the rendezvous store.

Control exchanges go through the store (set a key, poll for the peers' keys), which can be polled
without blocking and so names exactly the ranks that did not arrive. Bytes go through gloo.
"""
from __future__ import annotations

import datetime
import pickle
from typing import Any, Sequence

from ..errors import TimeoutError, XelinkError
from .base import Deadline, Request, Transport, as_bytes, iter_peers, spin_until

__all__ = ["TorchTransport", "gloo_backend"]

# The most bytes an exchange puts under one key of the store: torchrun's TCPStore refuses a value over 8 MiB (it
# resets the connection), so a larger one (an all_gather_object of big objects) goes in parts of this size.
STORE_VALUE_BYTES = 4 << 20


def gloo_backend(store, rank: int, size: int, timeout: float):
    """A gloo backend of ``size`` ranks rendezvousing under ``store`` (give each group its own prefix).

    xelink builds its groups directly rather than through ``torch.distributed.new_group``: with
    local synchronisation, torch names a group after how many groups *this process* made before, so
    ranks with different histories of sub-groups wait for each other forever.
    """
    import os

    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname) if ifname
                     else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _as_tensor(buf):
    import torch

    return torch.from_numpy(as_bytes(buf))


class _TorchRequest(Request):
    # gloo's Work.is_completed() stays False until wait() is called, so completion is learnt by a
    # blocking wait with a timeout; a gloo timeout also closes the pair, which is fine: it is fatal.
    def __init__(self, work, peer: int, what: str):
        self.work, self.peer, self.what = work, peer, what
        self._done = False

    def test(self) -> bool:
        return self._done

    def wait_for(self, seconds: float) -> bool:
        try:
            self.work.wait(datetime.timedelta(seconds=max(seconds, 1e-3)))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                return False
            raise XelinkError(f"{self.what}: transfer with rank {self.peer} failed: {exc}") from exc
        self._done = True
        if self.peer is None:  # an any-source receive: the sender is known now
            self.peer = self.work.source_rank()
        return True


class TorchTransport(Transport):
    """Point-to-point over a gloo process group, control exchanges over its store."""

    name = "torch"
    tag_limit = 1 << 31  # (gloo's tags are 32-bit)

    def __init__(self, store, prefix: str, global_ranks: Sequence[int], my_global_rank: int, timeout: float):
        import torch.distributed as dist

        self.store, self.prefix, self.timeout = store, prefix, timeout
        self.global_ranks = list(global_ranks)
        self.rank, self.size = self.global_ranks.index(my_global_rank), len(self.global_ranks)
        self.gloo = gloo_backend(dist.PrefixStore(f"{prefix}/gloo", store), self.rank, self.size, timeout)
        self._epoch = 0
        self._parts = 0  # how many parts the last exchange's value took (``_put``)
        self._splits = 0

    def _key(self, epoch: int, rank: int) -> str:
        return f"{self.prefix}/x{epoch}/{rank}"

    def _put(self, key: str, data: bytes) -> int:
        """``data`` under ``key``: inline (a 0 byte first), or in parts under ``key/i`` written first and their
        count under ``key`` (a 1 byte first), which readers poll for (``STORE_VALUE_BYTES``). Returns the count."""
        if len(data) < STORE_VALUE_BYTES:
            self.store.set(key, b"\0" + data)
            return 0
        parts = range(0, len(data), STORE_VALUE_BYTES)
        for i, start in enumerate(parts):
            self.store.set(f"{key}/{i}", data[start:start + STORE_VALUE_BYTES])
        self.store.set(key, b"\1" + str(len(parts)).encode())
        return len(parts)

    def _take(self, key: str) -> bytes:
        value = self.store.get(key)
        if value[:1] == b"\0":
            return value[1:]
        return b"".join(self.store.get(f"{key}/{i}") for i in range(int(value[1:])))

    def exchange(self, obj: Any, deadline: Deadline, what: str) -> list:
        epoch = self._epoch
        self._epoch += 1
        parts = self._put(self._key(epoch, self.rank), pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        pending = set(iter_peers(self.rank, self.size))

        def poll() -> bool:
            for p in list(pending):
                if self.store.check([self._key(epoch, p)]):
                    pending.discard(p)
            return not pending

        if not spin_until(poll, deadline):
            raise TimeoutError(what, pending, deadline.seconds)
        out = [obj if p == self.rank else pickle.loads(self._take(self._key(epoch, p))) for p in range(self.size)]
        # Every peer has now written this epoch's key, so each has read our key of the epoch before.
        if epoch > 0:
            last = self._key(epoch - 1, self.rank)
            for i in range(self._parts):
                self.store.delete_key(f"{last}/{i}")
            self.store.delete_key(last)
        self._parts = parts
        return out

    def split(self, color, key, members):
        self._splits += 1
        if color is None:
            return None
        granks = [self.global_ranks[m] for m in members]
        prefix = f"{self.prefix}/s{self._splits}c{color}"
        return TorchTransport(self.store, prefix, granks, self.global_ranks[self.rank], self.timeout)

    def isend(self, buf, dst: int, tag: int = 0, sync: bool = False) -> Request:  # (gloo has no synchronous mode)
        return _TorchRequest(self.gloo.send([_as_tensor(buf)], dst, tag), dst, "isend")

    def irecv(self, buf, src: int | None, tag: int = 0) -> Request:
        if src is None:
            return _TorchRequest(self.gloo.recv_anysource([_as_tensor(buf)], tag), None, "irecv")
        return _TorchRequest(self.gloo.recv([_as_tensor(buf)], src, tag), src, "irecv")
