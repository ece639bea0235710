"""Timeouts and environment knobs: what a job can set from outside, read in one place.

A leaf module: it imports nothing of xelink, so every layer may use it. Library code reads the
environment only through these functions, when a knob is used (never at import time).

Knobs (environment variables):
    XELINK_TIMEOUT           default deadline of every wait, seconds (``init(timeout=...)`` wins)
    XELINK_DEVICE            cuda, xpu or cpu (``init(device=...)`` wins)
    XELINK_RANKS_PER_DEVICE  ranks that may share one GPU (``init(ranks_per_device=...)`` wins)
    XELINK_TOPOLOGY          a shipped topology name or a TOML path (else discovery)
    XELINK_TUNING            a tuning table file or folder (else ~/.cache/xelink)
    XELINK_CALIBRATION       a calibration TOML (``xelink bench links --calibration-out``) that prices auto's cost
                             model (else ``cost.SOFTWARE``'s estimate)
    XELINK_CHECK             1: every collective checks that all ranks make the same call
    XELINK_LOG               logging level of the ``xelink`` logger (debug, info, ...)
    XELINK_GPU_SCRATCH       cap of the GPU collectives' scratch slot, bytes
    XELINK_GPU_BLOCKS        blocks of every GPU collective kernel (default: one per multiprocessor)
    XELINK_P2P_BLOCKS        blocks of the point-to-point kernels on CUDA tensors (default 16; same on every rank)
    XELINK_DIST_GRAPHS       CUDA graphs of the distributed GEMM schedules a group keeps for eager calls that
                             repeat their tensors (default 512; 0: every call enqueues its schedule)
    XELINK_DIST_GRAPH_MB     MiB of temporaries those graphs may hold (default 2048)
    XELINK_LAUNCH_CHECK      1: every fast kernel launch is checked against Triton's own cache key (tests)
    XELINK_PREFETCH          0: kernels under programmatic dependent launch do not prefetch into L2 before their
                             wait (``kernels.pdl``; default on where it was measured to gain: sm90+)
    XELINK_PREFETCH_MB       MiB a launch prefetches at most (default 8; the quantized GEMVs 2)
    XELINK_WATCHDOG          warn (default), abort or off: what a thread does when a GPU wait runs past its
                             deadline, before the next call raises (``symm.watchdog``)
    XELINK_TEST_READ_DELAY   test hook of the shared-memory collectives (``transport.shm``)
"""
from __future__ import annotations

import datetime
import math
import numbers
import os
import sys
from pathlib import Path

from .errors import ConfigError, LaunchError

__all__ = ["DEFAULT_TIMEOUT_S", "resolve_timeout", "env", "env_int", "env_flag", "bad_value", "opencl_runtime_default",
           "at_least", "integer", "is_int", "run_reporting_settings"]

DEFAULT_TIMEOUT_S = 300.0


def opencl_runtime_default() -> None:
    """Point the OpenCL ICD loader at the environment's ``libintelocl.so`` (the ``intel-opencl-rt`` wheel: SYCL on
    the CPU) when ``OCL_ICD_FILENAMES`` is unset and dpctl is not loaded yet (it reads the variable as it loads):
    call before any ``import dpctl``."""
    if "dpctl" not in sys.modules and not os.environ.get("OCL_ICD_FILENAMES"):
        lib = Path(sys.prefix) / "lib" / "libintelocl.so"
        if lib.exists():
            os.environ["OCL_ICD_FILENAMES"] = str(lib)


def env(name: str, default: str | None = None) -> str | None:
    """The knob ``name`` (``XELINK_*``), or ``default`` when unset or empty."""
    value = os.environ.get(name)
    return default if value is None or value.strip() == "" else value


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """The integer knob ``name``, or ``default``; a value that is not an integer, or is below ``minimum``, is a
    ``ConfigError``."""
    value = env(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum}")
    return number


def bad_value(source: str, message: str) -> ValueError:
    """The error for a bad value from ``source``: a ``ConfigError`` where it is an ``XELINK_*`` variable (a
    setting), else a ``ValueError`` (an argument, ``source`` naming the function)."""
    return (ConfigError if source.startswith("XELINK_") else ValueError)(message)


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """Whether the knob ``name`` is on: 1/true/yes/on, or 0/false/no/off (any case; unset or empty: off);
    anything else is a ``ConfigError`` (a word such as "disabled" read as on)."""
    value = env(name)
    if value is None:
        return False
    word = value.strip().lower()
    if word not in _ON + _OFF:
        raise ConfigError(f"{name}={value!r} is not a switch: use one of {', '.join(_ON + _OFF)}")
    return word in _ON


def resolve_timeout(timeout, fn: str = "init") -> float:
    """The deadline in seconds: ``timeout`` if given, else ``XELINK_TIMEOUT``, else 300 s.

    Accepts numbers and ``datetime.timedelta``; raises ``TypeError``/``ValueError`` naming ``fn``
    (or the variable) for anything that is not a positive, finite number of seconds.
    """
    source = f"{fn}: timeout"
    if timeout is None:
        value = env("XELINK_TIMEOUT")  # (empty: unset, as every knob)
        if value is None:
            return DEFAULT_TIMEOUT_S
        source = "XELINK_TIMEOUT"
        try:
            timeout = float(value)
        except ValueError:
            raise ConfigError(f"{source}={value!r} is not a number of seconds") from None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{source}={timeout!r} must be a number of seconds")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise bad_value(source, f"{source}={timeout!r} must be a positive, finite number of seconds")
    return float(timeout)


def is_int(value) -> bool:
    """Whether ``value`` is an int or an integer scalar (numpy's), and not a bool (``integer``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(fn: str, name: str, value, minimum: int | None = None) -> int:
    """``value`` as a plain int: a Python int or an integer scalar (numpy's ``np.int64``: ranks and sizes taken
    from arrays, as torch.distributed takes them), not a bool; ``minimum``: the least allowed. Errors name ``fn``
    and ``name``."""
    if not is_int(value):
        raise TypeError(f"{fn}: {name}={value!r} must be an int")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{fn}: {name}={value} must be >= {minimum}")
    return value


def at_least(minimum: int):
    """An argparse ``type``: an int >= ``minimum`` (``--iters 0`` is a usage error, not a traceback mid-run)."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


def run_reporting_settings(prog: str, fn, *args) -> int:
    """``fn(*args)`` for a command ``prog`` of the command line, a setting it cannot use (``ConfigError``: a bad
    ``XELINK_*`` value, topology name or file) or a launch it cannot serve (``LaunchError``) printed as one line
    naming ``prog`` with exit status 2 (a usage error, as argparse's), not a traceback."""
    try:
        return fn(*args)
    except (ConfigError, LaunchError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
