"""A GPU wait that ran past its deadline, reported when it happens (``XELINK_WATCHDOG``).

A GPU wait of the peer-memory layer that gives up marks its error word (pinned host memory, ``cuda._ErrorWord``)
and lets its stream go on: what the call should have written is not written, and the next call on the
communicator (or ``synchronize``, or ``finalize``) raises ``xelink.TimeoutError``. Until then the job's own GPU work
may already be using that data, and a job that makes no further xelink call for a while learns nothing. So a
daemon thread reads every live error word (host memory: no CUDA call, no synchronization) every
:data:`INTERVAL_S` and, once one is set (read again one poll after it is first seen set: the kernels' stores
reach the host one at a time, the flag perhaps before a late program's peer):

- ``warn`` (the default): writes one line to stderr naming the rank, the communicator and the peers it waited for;
- ``abort``: writes that line and ends the process (``os.abort``; under MPI the launcher then ends the other
  ranks), as torch ends a process whose NCCL collective timed out;
- ``off``: no thread.

A word whose error a call already raised is not reported again.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref

from ..config import env
from ..errors import ConfigError

__all__ = ["INTERVAL_S", "MODES", "mode", "watch"]

MODES = ("warn", "abort", "off")
INTERVAL_S = 0.1
_lock = threading.Lock()
_words: weakref.WeakSet = weakref.WeakSet()
_thread: threading.Thread | None = None


def mode() -> str:
    """``XELINK_WATCHDOG``: "warn" (default), "abort" or "off"; another value is a ConfigError naming the knob."""
    value = env("XELINK_WATCHDOG", "warn").strip().lower()
    if value not in MODES:
        raise ConfigError(f"XELINK_WATCHDOG={value!r} must be one of {', '.join(MODES)}")
    return value


def watch(word) -> None:
    """Watch ``word`` while it lives: an object whose ``tripped()`` returns the line to report once it is set and
    not yet told (else None), and whose ``told`` the thread sets once it reported it. Starts the thread on the
    first word; nothing with ``XELINK_WATCHDOG=off``."""
    global _thread
    if mode() == "off":
        return
    with _lock:
        _words.add(word)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="xelink-watchdog", daemon=True)
            _thread.start()


def _run() -> None:
    while True:
        time.sleep(INTERVAL_S)
        with _lock:
            words = list(_words)
        for word in words:
            line = word.tripped()
            if line is None:
                continue
            try:
                how = mode()  # read when it matters: a job (or a test) may change it while the thread runs
            except ValueError:  # (set to something else since: the thread reports rather than dies)
                how = "warn"
            if how == "off":
                continue
            word.told = True
            sys.stderr.write(f"xelink watchdog: {line}\n")
            sys.stderr.flush()
            if how == "abort":
                os.abort()
        del words
