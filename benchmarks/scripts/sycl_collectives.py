"""Rows for xelink.sycl (one process, several SYCL queues) against a host numpy reference on the same data.

    .venv/bin/python benchmarks/scripts/sycl_collectives.py [--devices tiles4|sub2] [--iters 20] [--jsonl PATH]

Each timed run is checked (#wrong: elements that differ from the exact answer). The reference is numpy on
the host over the same shared-USM buffers (``np.sum`` of the inputs written back into each buffer); ratio =
numpy time / xelink time (> 1: xelink faster), which says how the OpenCL path compares with plain host code
on this machine, nothing about a GPU. On the
CPU OpenCL device kernels of different queues run one at a time (``xelink.symm.sycl``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

import xelink.sycl as xs
from xelink.symm import sycl as symm_sycl


def _manifest():
    dpctl = symm_sycl.dpctl_module()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"commit": commit, "dpctl": dpctl.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "OCL_ICD_FILENAMES": os.environ.get("OCL_ICD_FILENAMES", "")}


def _pattern(r, n):
    return (((np.arange(n) * 7 + r * 13) % 23) - 11).astype(np.float32)


def bench_all_reduce(comms, n, algo, iters):
    p = len(comms)
    arrs = [xs.empty(c, n, "float32", usm="shared") for c in comms]
    data = [_pattern(c.rank, n) for c in comms]
    expect = np.sum(np.stack(data), axis=0)
    times, wrong = [], 0
    for _ in range(iters + 2):
        for a, d in zip(arrs, data):
            a.numpy()[:] = d
        t = time.perf_counter()
        xs.all_reduce(arrs, algo=algo)
        times.append(time.perf_counter() - t)
        wrong += sum(int(np.count_nonzero(a.numpy() != expect)) for a in arrs)
    ref = []
    for _ in range(iters + 2):
        for a, d in zip(arrs, data):
            a.numpy()[:] = d
        t = time.perf_counter()
        total = np.sum(np.stack([a.numpy() for a in arrs]), axis=0)
        for a in arrs:
            a.numpy()[:] = total
        ref.append(time.perf_counter() - t)
    return {"op": "all_reduce", "algo": algo, "ranks": p, "count": n, "bytes": 4 * n, "dtype": "float32",
            "time_us": 1e6 * float(np.median(times[2:])), "numpy_us": 1e6 * float(np.median(ref[2:])), "wrong": wrong}


def bench_all_gather(comms, n, algo, iters):
    p = len(comms)
    ins = [xs.empty(c, n, "float32", usm="shared") for c in comms]
    outs = [xs.empty(c, p * n, "float32", usm="shared") for c in comms]
    for c, a in zip(comms, ins):
        a.numpy()[:] = _pattern(c.rank, n)
    expect = np.concatenate([a.numpy().copy() for a in ins])
    times, wrong = [], 0
    for _ in range(iters + 2):
        for o in outs:
            o.numpy()[:] = -1
        t = time.perf_counter()
        xs.all_gather_into_tensor(outs, ins, algo=algo)
        times.append(time.perf_counter() - t)
        wrong += sum(int(np.count_nonzero(o.numpy() != expect)) for o in outs)
    ref = []
    for _ in range(iters + 2):
        t = time.perf_counter()
        for o in outs:
            np.concatenate([a.numpy() for a in ins], out=o.numpy())
        ref.append(time.perf_counter() - t)
    return {"op": "all_gather", "algo": algo, "ranks": p, "count": n, "bytes": 4 * n, "dtype": "float32",
            "time_us": 1e6 * float(np.median(times[2:])), "numpy_us": 1e6 * float(np.median(ref[2:])), "wrong": wrong}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", choices=["sub2", "tiles4"], default="sub2")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sizes", default="1024,65536,1048576", help="elements per rank, comma-separated")
    ap.add_argument("--jsonl", default=None)
    args = ap.parse_args(argv)
    if args.devices == "sub2":
        comms = xs.communicators()
    else:
        comms = xs.communicators(["opencl:cpu"] * 4, packages=[[0, 1], [2, 3]])
    manifest = _manifest()
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        for algo in xs.ALGOS["all_reduce"]:
            rows.append(bench_all_reduce(comms, n, algo, args.iters))
        for algo in xs.ALGOS["all_gather"]:
            rows.append(bench_all_gather(comms, n, algo, args.iters))
    print(f"# xelink.sycl {args.devices} ({len(comms)} queues), commit {manifest['commit'][:12]}, dpctl "
          f"{manifest['dpctl']}, {manifest['cpus']} CPUs; time: median of {args.iters} calls (host wall clock)")
    print(f"{'op':<11}{'algo':<13}{'count':>9}{'bytes':>10}{'time_us':>11}{'numpy_us':>11}{'ratio':>8}{'#wrong':>8}")
    for r in rows:
        print(f"{r['op']:<11}{r['algo']:<13}{r['count']:>9}{r['bytes']:>10}{r['time_us']:>11.1f}{r['numpy_us']:>11.1f}"
              f"{r['numpy_us'] / r['time_us']:>8.2f}{r['wrong']:>8}")
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "devices": args.devices, "manifest": manifest}) + "\n")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
