"""The exceptions xelink raises.

Argument errors are plain ``ValueError``/``TypeError`` prefixed with the function name; the classes
here cover what goes wrong in a running job.
"""
from __future__ import annotations

import builtins

__all__ = ["XelinkError", "TimeoutError", "LaunchError", "NotInitializedError"]


class XelinkError(RuntimeError):
    """Base class of every error xelink raises about a running job."""


class TimeoutError(XelinkError, builtins.TimeoutError):
    """A wait passed its deadline.

    Attributes:
        what: the operation that waited (e.g. ``"barrier"``).
        missing: the ranks (of the communicator that waited) that did not arrive, when known.
        timeout: the deadline in seconds.
    """

    def __init__(self, what: str, missing, timeout: float, detail: str = ""):
        self.what = what
        self.missing = sorted(missing)
        self.timeout = timeout
        ranks = ", ".join(map(str, self.missing)) if self.missing else "unknown"
        msg = f"{what}: timed out after {timeout:g} s waiting for rank(s) {ranks}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class LaunchError(XelinkError):
    """The job was launched in a way xelink cannot serve (e.g. more ranks on a host than GPUs)."""


class NotInitializedError(XelinkError):
    """A call needed the world communicator before ``xelink.init()``."""
