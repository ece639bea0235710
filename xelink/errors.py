"""The exceptions xelink raises.

Argument errors are plain ``ValueError``/``TypeError`` prefixed with the function name; a setting xelink
cannot use (an ``XELINK_*`` variable, a topology name or file) is a ``ConfigError``, a ``ValueError`` the
command line prints as one line; the other classes cover what goes wrong in a running job.
"""
from __future__ import annotations

import builtins

__all__ = ["ConfigError", "XelinkError", "TimeoutError", "LaunchError", "NotInitializedError"]


class ConfigError(ValueError):
    """A setting xelink cannot use: an ``XELINK_*`` environment variable, a topology name or file. The message
    names the variable or file and the bad value; ``xelink`` commands print it and exit 2, with no traceback."""


class XelinkError(RuntimeError):
    """Base class of every error xelink raises about a running job."""


class TimeoutError(XelinkError, builtins.TimeoutError):
    """A wait passed its deadline.

    Attributes:
        what: the operation that waited (e.g. ``"barrier"``).
        missing: the ranks (of the communicator that waited) that did not arrive, when known.
        timeout: the deadline in seconds.
        behind: the ranks holding the others up, when known: on one host, the ranks furthest behind in
            the sequence of collectives (a stalled rank, which a ring's ranks see only through the
            neighbour that stopped forwarding), else empty.
        group: the communicator whose ranks ``missing`` and ``behind`` name (None: not recorded).
    """

    def __init__(self, what: str, missing, timeout: float, detail: str = "", group=None):
        self.what = what
        self.timeout = timeout
        self.group = group
        self._detail = detail
        self.behind: list[int] = []
        self._behind_detail = ""
        self.missing = sorted(missing)
        super().__init__(self._message())

    def _message(self) -> str:
        ranks = ", ".join(map(str, self.missing)) if self.missing else "unknown"
        msg = f"{self.what}: timed out after {self.timeout:g} s waiting for rank(s) {ranks}"
        if self._detail:
            msg += f" ({self._detail})"
        if self.behind:
            msg += f"; furthest behind: rank(s) {', '.join(map(str, self.behind))}"
            if self._behind_detail:
                msg += f" ({self._behind_detail})"
        return msg

    def restate(self, *, missing=None, behind=None, behind_detail: str = "", group=None,
                what: str | None = None) -> "TimeoutError":
        """Name other ranks (e.g. those of the communicator the user called instead of a sub-group's,
        and the ranks furthest behind), or the operation (the one the user called, where a step inside it
        waited); the message follows. Returns ``self``."""
        if what is not None:
            self.what = what
        if missing is not None:
            self.missing = sorted(missing)
        if behind is not None:
            self.behind, self._behind_detail = sorted(behind), behind_detail
        if group is not None:
            self.group = group
        self.args = (self._message(),)
        return self


class LaunchError(XelinkError):
    """The job was launched in a way xelink cannot serve (e.g. more ranks on a host than GPUs)."""


class NotInitializedError(XelinkError, ValueError):
    """A call needed the world communicator before ``xelink.init()`` (a ``ValueError`` too, as torch.distributed's
    "Default process group has not been initialized")."""
