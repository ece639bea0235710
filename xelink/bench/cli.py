"""``xelink bench <name> [options]`` (also ``python -m xelink.bench <name> [options]``): the one entry of the
benchmark suite.

``<name>`` is a family of the suite (``suite.FAMILIES``: one module of ``xelink.bench.families`` each),
``all`` (every family this machine can run, into one results folder), or a tool the families build on
(``probe``, ``model-check``). ``xelink bench <name> --help`` lists its options.
"""
from __future__ import annotations

import argparse
import importlib

from . import suite
from ..config import run_reporting_settings

__all__ = ["NAMES", "TOOLS", "main"]

# Tools: name -> (module of xelink.bench whose main(argv) runs it, what it does).
TOOLS = {
    "probe": ("probe", "measure the job's links, software overhead and local speed; write the calibrated topology "
                       "and the cost model's calibration"),
    "model-check": ("model_check", "the cost model's prediction next to the measured time of every collective "
                                   "algorithm (probes first, or takes a calibration)"),
}
NAMES = (*suite.FAMILIES, "all", *TOOLS)


def _parser() -> argparse.ArgumentParser:
    width = max(map(len, NAMES))
    lines = ["families:"] + [f"  {f.name:<{width}}  {f.summary}" for f in suite.FAMILIES.values()]
    lines += [f"  {'all':<{width}}  every family this machine can run, in one launch, into one folder (--quick: the "
              f"quick suite)", "tools:"] + [f"  {name:<{width}}  {what}" for name, (_, what) in TOOLS.items()]
    p = argparse.ArgumentParser(prog="xelink bench", description="The benchmark suite: one family, all of them, or "
                                                                 "a tool (run under a launcher for several ranks).",
                                epilog="\n".join(lines), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", metavar="NAME", choices=NAMES, help="a family, all, or a tool (listed below)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="its own options (xelink bench NAME --help)")
    return p


def main(argv=None) -> int:
    """Run ``xelink bench <name> [options]``; ``argv`` starts with the name. Returns the exit status."""
    argv = list(argv) if argv is not None else None
    if argv is not None and not argv:
        _parser().error("name a family, all, or a tool (xelink bench --help lists them)")
    args = _parser().parse_args(argv)
    if args.name in TOOLS:
        fn, rest = importlib.import_module(f".{TOOLS[args.name][0]}", __package__).main, (args.rest,)
    elif args.name == "all":
        fn, rest = suite.main_all, (args.rest,)
    else:
        fn, rest = suite.main, (args.name, args.rest)
    return run_reporting_settings(f"xelink bench {args.name}", fn, *rest)
