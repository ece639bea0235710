"""The benchmark suite (``xelink bench <family>``, ``python -m xelink.bench``) and the harness and tuning
table that every xelink benchmark builds on."""
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
