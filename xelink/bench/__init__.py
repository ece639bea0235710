"""The benchmark suite (``xelink bench <name>``, ``python -m xelink.bench <name>``) and the harness and tuning
table that every xelink benchmark builds on.

Layout: ``cli.py`` (the one entry), ``suite.py`` (the family table, the runner, the outputs),
``families/`` (one module per family), ``harness.py`` (manifest, co-measured timing, rows, JSONL/CSV/table),
``kernel_timing.py`` (what the single-device kernel families share), ``plots.py``, ``tune.py`` (the tuning
table from rows), and the tools ``probe.py`` and ``model_check.py``. The suite imports the library; nothing
of the library imports the suite (only the ``xelink`` command hands ``xelink bench ...`` to ``cli.py``).
"""
from .harness import (BUSBW_FACTORS, JsonlWriter, Progress, Row, algbw, busbw, co_measure, dtype_name, format_table,
                      make_row, manifest, pred_over_meas, rank_max, read_jsonl, summarize, time_cuda_events, time_fn,
                      write_csv)
from ..tuning import TuningTable, find_table, fingerprint, load
from .tune import build_table

__all__ = [
    "BUSBW_FACTORS",
    "JsonlWriter",
    "Progress",
    "Row",
    "TuningTable",
    "algbw",
    "build_table",
    "busbw",
    "co_measure",
    "dtype_name",
    "find_table",
    "fingerprint",
    "format_table",
    "load",
    "make_row",
    "manifest",
    "pred_over_meas",
    "rank_max",
    "read_jsonl",
    "summarize",
    "time_cuda_events",
    "time_fn",
    "write_csv",
]
