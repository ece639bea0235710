"""The ``gpu-collectives`` family of the suite: ``gpu_collectives.main`` (CUDA only) run in the suite.

Options it does not know go on to ``python -m xelink.bench.gpu_collectives`` (``--rounds``, ``--calls``,
...). Its rows come back from the JSON Lines it writes, for the plots and CSV. With ``--tune PATH``
its ``cuda:<op>`` entries are merged into a table already at PATH for the same machine layout (the
collectives family's, in ``xelink bench all``; ``tuning.save_merged``), so one file holds both.

The GPU benchmark ends the xelink world it runs in (``xelink.finalize``); ``xelink bench all`` runs it
last.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["PASS_THROUGH", "add_arguments", "run"]

PASS_THROUGH = True


def add_arguments(p) -> None:
    p.add_argument("--tune", metavar="PATH", help="write (or merge into) the tuning table auto uses on CUDA tensors")


def run(ctx) -> list:
    """Run the GPU collectives benchmark on every rank; rows on rank 0. Collective; ends the world."""
    from . import gpu_collectives
    from .suite import rows_of_jsonl

    lead, tune = ctx.lead, ctx.args.tune
    folder = ctx.out if ctx.out is not None else Path(tempfile.mkdtemp(prefix="xelink-bench-")) if lead else None
    argv = ["--out", str(folder or ".")] + (["--quick"] if ctx.quick else []) + (["--tune", tune] if tune else [])
    rc = gpu_collectives.main(argv + ctx.rest)
    ctx.delegated, ctx.failed = True, rc != 0
    if not lead:
        return []
    ctx.notes.append(f"gpu-collectives: GPU benchmark output in {folder}/ (exit status {rc})")
    return rows_of_jsonl(folder / "gpu_collectives.jsonl")
