"""Logging through the standard ``logging`` module, under the ``xelink`` logger.

``XELINK_LOG=debug|info|warning|error`` sets the level; records carry the rank once it is known.
"""
from __future__ import annotations

import logging

from .config import env
from .errors import ConfigError

__all__ = ["get_logger", "configure"]

_ROOT = "xelink"
_handler: logging.Handler | None = None


def get_logger(name: str = "") -> logging.Logger:
    """The logger of a submodule (``get_logger("comm")`` → ``xelink.comm``)."""
    return logging.getLogger(f"{_ROOT}.{name}" if name else _ROOT)


def configure(rank: int | None = None, level: str | None = None) -> None:
    """Attach one stderr handler to the ``xelink`` logger, prefixed with the rank.

    Called by ``xelink.init()``; the level comes from ``level`` or ``XELINK_LOG`` (default: warning).
    An application that configures logging itself can set the ``xelink`` logger's level instead.
    """
    global _handler
    level = level or env("XELINK_LOG")  # (empty: unset, as every knob)
    logger = logging.getLogger(_ROOT)
    if level:
        value = logging.getLevelName(level.strip().upper())
        if not isinstance(value, int):
            raise ConfigError(f"XELINK_LOG: unknown level {level!r} (debug, info, warning, error)")
        logger.setLevel(value)
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = logging.StreamHandler()
    who = f"rank {rank}" if rank is not None else "xelink"
    _handler.setFormatter(logging.Formatter(f"[%(asctime)s {who} %(name)s %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
