"""The handle an ``async_op=True`` call returns, as torch.distributed's ``Work`` (a leaf: imports nothing of
xelink; torch only when a future is asked for).

Every handle (CPU ranks, CUDA streams, point-to-point, SYCL queues) has ``wait(timeout=None)`` (True once
done; raises the call's error) and ``is_completed()`` of its own; this base adds torch's rest from them:

- ``result()``: waits, then the tensors (or arrays) the call wrote, as a list (``outputs``, which the front door
  sets: ``[tensor]`` for ``all_reduce``, the output list of ``all_gather``, ...);
- ``get_future()``: a ``torch.futures.Future`` holding that list once the work is done, or its error (DDP
  communication hooks chain on it: ``work.get_future().then(lambda f: f.value()[0] / n)``). A handle that can
  report its completion completes the future then; the others wait in ``get_future`` first (a CUDA handle's wait
  orders the current stream after the work, so the future's value is ready on that stream);
- ``exception()``: the error the work ended with, None while it runs or when it succeeded;
- ``synchronize()``: blocks the host until the work is done (the CUDA handle also raises a deadline its kernels
  missed).
"""
from __future__ import annotations

__all__ = ["Work"]


class Work:
    """torch.distributed's Work protocol on a handle's own ``wait(timeout=None)`` and ``is_completed()``."""

    outputs: list = []  # what the call writes; set by the front door (empty: a barrier)

    def wait(self, timeout=None) -> bool:  # pragma: no cover - every handle has its own
        raise NotImplementedError

    def is_completed(self) -> bool:  # pragma: no cover - every handle has its own
        raise NotImplementedError

    def result(self) -> list:
        self.wait()
        return list(self.outputs)

    def synchronize(self) -> None:
        self.wait()

    def exception(self):
        if not self.is_completed():
            return None
        try:
            self.synchronize()
        except Exception as exc:  # the call's own error, as torch's Work.exception() gives it
            return exc
        return None

    def get_future(self):
        import torch

        try:
            value = self.result()
        except Exception as exc:
            future = torch.futures.Future()
            future.set_exception(exc)
            return future
        # CUDA outputs: a CUDA-aware future, whose wait() / value() order the caller's stream after this one
        devices = sorted({str(t.device) for t in value if isinstance(t, torch.Tensor) and t.is_cuda})
        future = torch.futures.Future(devices=devices or None)
        future.set_result(value)
        return future
