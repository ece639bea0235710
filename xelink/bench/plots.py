"""PNG plots of benchmark rows: time and bandwidth versus size per op with the baseline, bars per
kernel shape, and the heatmap of a link matrix.

matplotlib (the ``bench`` extra: ``pip install "xelink[bench]"``) is imported on first use, with the
Agg backend, so the suite runs without a display and without matplotlib when no plot is asked for.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence

from .harness import Row

__all__ = ["available", "plot_sweep", "plot_kernels", "plot_link_matrix", "size_label"]

# Baselines are drawn black/grey and dashed, xelink's paths in these colours (colour-blind safe).
_BASELINE_STYLES = (dict(color="black", linestyle="--", linewidth=2.2, marker="s"),
                    dict(color="#606060", linestyle="-.", linewidth=2.0, marker="^"),
                    dict(color="#8C564B", linestyle="--", linewidth=1.8, marker="D"))
_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#7F7F7F")


def available() -> bool:
    """Whether matplotlib is installed (plots need it)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError('plots need matplotlib: pip install "xelink[bench]" (or pip install matplotlib)') from None
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def size_label(nbytes: float) -> str:
    """``1024 -> '1K'``, ``3 << 20 -> '3M'``: the axis labels of message sizes."""
    for unit, suffix in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if nbytes >= unit:
            value = nbytes / unit
            return f"{value:.0f}{suffix}" if value == int(value) else f"{value:.1f}{suffix}"
    return f"{nbytes:.0f}"


def _is_baseline(row: Row) -> bool:
    return not row.path.startswith("xelink")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("_")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_sweep(rows: Iterable[Row], outdir, prefix: str) -> list[Path]:
    """One PNG per (op, dtype, and ``extra["mode"]`` where rows have one: eager / CUDA graph): time
    (log-log) and bandwidth versus size, a line per path.

    Baselines (paths not ``xelink*``) are black and dashed; a path's cost-model prediction, where rows
    carry one, is a dotted line of the same colour. The bandwidth panel shows busbw where the op has
    nccl-tests' factor, else algbw.

    Args:
        rows: result rows of a sweep (several sizes per path).
        outdir: the folder to write to (created).
        prefix: the start of each file name (``<prefix>-<op>-<dtype>[-<mode>].png``).

    Returns:
        the files written.
    """
    plt = _pyplot()
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.op, r.dtype, r.extra.get("mode")), []).append(r)
    written = []
    for (op, dtype, mode), got in groups.items():
        paths = list(dict.fromkeys(r.path for r in got))
        fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.8))
        bus = any(r.busbw_GBps is not None for r in got)
        colour, base_style = iter(_COLOURS * 4), iter(_BASELINE_STYLES * 4)
        for path in paths:
            mine = sorted((r for r in got if r.path == path), key=lambda r: r.size_bytes)
            x = [r.size_bytes for r in mine]
            base = _is_baseline(mine[0])
            style = dict(next(base_style)) if base else dict(color=next(colour), linestyle="-", linewidth=1.6,
                                                              marker="o")
            ax_t.plot(x, [r.time_us for r in mine], label=path + (" (baseline)" if base else ""), **style)
            bw = [(r.busbw_GBps if bus else r.algbw_GBps) for r in mine]
            ax_b.plot(x, [math.nan if v is None else v for v in bw], **style)
            pred = [(r.size_bytes, r.predicted_us) for r in mine if r.predicted_us is not None]
            if pred and not base:
                ax_t.plot(*zip(*pred), color=style["color"], linestyle=":", linewidth=1.2, marker="x",
                          label=f"{path} predicted")
        n = got[0].nranks
        for ax in (ax_t, ax_b):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes)")
            ax.grid(True, which="major", alpha=0.35)
            sizes = sorted({r.size_bytes for r in got})
            ax.set_xticks(sizes)
            ax.set_xticklabels([size_label(s) for s in sizes])
            ax.minorticks_off()
        _log_axis(ax_t)
        ax_t.set_ylabel("time per call (µs, median of max over ranks)")
        ax_t.set_title("latency (lower is better)")
        ax_b.set_ylabel(("busbw" if bus else "algbw") + " (GB/s)")
        ax_b.set_title("bandwidth (higher is better)")
        fig.suptitle(f"{op}: {n} rank(s), {dtype}" + (f", {mode}" if mode else ""), fontsize=13)
        _legend_under(fig, ax_t)
        name = "-".join(_safe(str(part)) for part in (prefix, op, dtype, mode) if part)
        written.append(_save(fig, Path(outdir) / f"{name}.png"))
    return written


def _legend_under(fig, ax) -> None:
    """The legend of ``ax`` under the figure: measured paths in the first row, each path's prediction
    under it in the second (matplotlib fills a legend column by column)."""
    handles, labels = ax.get_legend_handles_labels()
    measured = [(h, l) for h, l in zip(handles, labels) if not l.endswith(" predicted")]
    predicted = {l[:-len(" predicted")]: (h, l) for h, l in zip(handles, labels) if l.endswith(" predicted")}
    order = []
    for h, l in measured:
        order.append((h, l))
        if predicted:
            order.append(predicted.get(l, (_blank(), "")))
    ncol = len(measured)
    rows = 2 if predicted else 1
    if ncol > 5:  # too wide for one line: let matplotlib wrap the plain list
        order, ncol = measured + list(predicted.values()), 4
        rows = math.ceil(len(order) / ncol)
    fig.legend(*zip(*order), loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.03 + 0.05 * rows, 1, 0.95))  # room for the legend and the suptitle


def _log_axis(ax) -> None:
    """A log y axis labelled with plain numbers (100, 2000) and no minor-tick labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _blank():
    from matplotlib.lines import Line2D

    return Line2D([], [], linestyle="none")


def _shape(row: Row) -> str:
    """A kernel row's shape label: ``extra["shape"]``, else its B/S/D fields (attention), else its size."""
    e = row.extra
    if e.get("shape"):
        return str(e["shape"])
    if all(k in e for k in ("B", "S", "D")):
        return " ".join(str(x) for x in (e.get("case", ""), f"B={e['B']}", f"S={e['S']}", f"D={e['D']}") if x)
    return size_label(row.size_bytes)


def _rate(row: Row) -> tuple[float | None, str]:
    """A kernel row's throughput and unit: GFLOP/s where it records FLOPs, else GB/s."""
    e = row.extra
    for key, scale in (("gflops", 1.0), ("TFLOPs", 1e3), ("tflops", 1e3)):
        if e.get(key) is not None:
            return e[key] * scale, "GFLOP/s"
    return row.algbw_GBps, "GB/s"


def plot_kernels(rows: Iterable[Row], outdir, prefix: str) -> list[Path]:
    """One PNG per op, bars per shape (``extra["shape"]`` and dtype): on the left each xelink path's
    speed against the baseline (baseline time / its time; the line at 1 is the baseline), on the right
    every path's throughput (GFLOP/s where rows record FLOPs, else GB/s), both on linear axes.

    Returns:
        the files written.
    """
    plt = _pyplot()
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.op, []).append(r)
    written = []
    for op, got in groups.items():
        def category(r):
            return f"{_shape(r)} {r.dtype}"

        shapes = list(dict.fromkeys(category(r) for r in got))
        paths = list(dict.fromkeys(r.path for r in got))
        colours = iter(_COLOURS * 4)
        styles = {p: dict(color="#404040", hatch="//", edgecolor="white") if not p.startswith("xelink")
                  else dict(color=next(colours)) for p in paths}
        unit = _rate(got[0])[1]
        top = max((_rate(r)[0] or 0) for r in got)
        scale = 1e3 if top >= 1e4 else 1.0  # GFLOP/s -> TFLOP/s, GB/s -> TB/s on GPUs
        unit = {"GFLOP/s": "TFLOP/s", "GB/s": "TB/s"}[unit] if scale > 1 else unit
        fig, (ax_s, ax_r) = plt.subplots(1, 2, figsize=(min(22, max(12, 1.3 * len(shapes) + 6)), 5.4))
        labelled = set()
        bars = sum(1 for r in got if r.ratio is not None)  # a tuning sweep has too many bars to label each
        for j, shape in enumerate(shapes):
            mine = [r for r in got if category(r) == shape]  # only the paths this shape has, side by side
            ours = [r for r in mine if r.ratio is not None]
            for i, r in enumerate(mine):
                width = 0.8 / len(mine)
                x = j + (i - (len(mine) - 1) / 2) * width
                label = None
                if r.path not in labelled:
                    labelled.add(r.path)
                    label = r.path + ("" if r.path.startswith("xelink") else " (baseline)")
                ax_r.bar(x, (_rate(r)[0] or 0) / scale, width, label=label, **styles[r.path])
            for i, r in enumerate(ours):
                width = 0.8 / len(ours)
                x = j + (i - (len(ours) - 1) / 2) * width
                ax_s.bar(x, r.ratio, width, **styles[r.path])
                if bars <= 24:
                    text = f"{r.ratio:.2f}x\n{r.time_us:.0f} µs" if bars <= 12 else f"{r.ratio:.2f}"
                    ax_s.annotate(text, (x, r.ratio), ha="center", va="bottom", fontsize=8)
        ax_s.axhline(1.0, color="black", linestyle="--", linewidth=1.2)
        ax_s.set_ylim(0, max([r.ratio for r in got if r.ratio is not None] + [1.0]) * 1.25)
        for ax in (ax_s, ax_r):
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, rotation=20, ha="right", fontsize=8)
            ax.grid(True, axis="y", alpha=0.35)
        ax_s.set_ylabel("baseline time / xelink time")
        ax_s.set_title("speed against the baseline (dashed line: baseline; > 1 faster)")
        ax_r.set_ylabel(unit)
        ax_r.set_title("throughput (higher is better)")
        fig.suptitle(f"{op}", fontsize=13)
        _legend_under(fig, ax_r)
        written.append(_save(fig, Path(outdir) / f"{_safe(prefix)}-{_safe(op)}.png"))
    return written


def plot_link_matrix(latency_us: Sequence[Sequence[float | None]], gbps: Sequence[Sequence[float | None]],
                     path, title: str) -> Path:
    """A heatmap of rank-to-rank latency (µs) and bandwidth (GB/s), every cell written out.

    Args:
        latency_us, gbps: n x n matrices; None where no link was measured (the diagonal, ranks on one device).
        path: the PNG to write.
        title: the figure's title.
    """
    plt = _pyplot()
    import numpy as np

    n = len(latency_us)
    side = max(4.0, 0.7 * n + 2.5)
    fig, axes = plt.subplots(1, 2, figsize=(2 * side + 1.5, side))
    for ax, data, name, cmap, fmt in ((axes[0], latency_us, "one-way latency (µs)", "viridis_r", "{:.1f}"),
                                      (axes[1], gbps, "bandwidth (GB/s, one way)", "viridis", "{:.2f}")):
        grid = np.array([[math.nan if v is None else float(v) for v in row] for row in data])
        masked = np.ma.masked_invalid(grid)
        image = ax.imshow(masked, cmap=cmap)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        finite = grid[np.isfinite(grid)]
        middle = (finite.min() + finite.max()) / 2 if finite.size else 0
        for a in range(n):
            for b in range(n):
                v = grid[a, b]
                text = "-" if not np.isfinite(v) else fmt.format(v)
                # Light text on the dark end of the colour map, dark text on the light end.
                dark = np.isfinite(v) and ((v > middle) if cmap == "viridis_r" else (v < middle))
                ax.text(b, a, text, ha="center", va="center", fontsize=9 if n <= 8 else 6,
                        color="white" if dark else "black")
        ax.set_title(name)
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_xlabel("rank")
        ax.set_ylabel("rank")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    return _save(fig, Path(path))
