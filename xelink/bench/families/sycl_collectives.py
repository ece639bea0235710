"""``xelink bench sycl-collectives``: ``xelink.sycl`` (one process driving several SYCL queues through dpctl)
against a host numpy reference over the same data, with the cost model's prediction.

Rank 0 runs it (the backend is single-process; other ranks return no rows). ``--devices sub2``: the first two
queues of ``xelink.sycl.communicators()``' default (two tiles of the first GPU, or two GPUs, else two compute
units of the CPU device; skipped where there are not two); ``tiles4``: four queues of one device standing for
tiles, packages ``[[0, 1], [2, 3]]``. Ops all_reduce, all_gather and reduce_scatter,
every algorithm of ``xelink.sycl.ALGOS``, float32 (small integers: exact in every order); ``count`` is
elements per rank (all_reduce, all_gather input; reduce_scatter output). Timing: the host clock around the
public call (it waits), co-measured with the baseline, round by round. Baseline ``numpy:host``: numpy on the
host over the same shared-USM buffers (the sum written back into each buffer; the concatenation into each
output; each rank's block of the sum). Every timed output is checked against the exact answer (#wrong).
Predictions: ``xelink.cost.predict`` on ``xelink.sycl.topology`` (estimated figures: see there).

On the CPU OpenCL device kernels of different queues run one at a time (``xelink.symm.sycl``), so these rows
say how the path compares with host code on this machine, nothing about an Intel GPU.
"""
from __future__ import annotations

import numpy as np

from ..harness import Unavailable, at_least, co_measure, make_row, poison_unlike

__all__ = ["add_arguments", "run", "OPS", "DEVICE_SETS"]

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DEVICE_SETS = ("sub2", "tiles4")
COUNTS = (1024, 65536, 1 << 20)  # elements per rank
QUICK_COUNTS = (1024, 65536)


def add_arguments(p) -> None:
    p.add_argument("--devices", choices=DEVICE_SETS, default="sub2", help="the SYCL queues (default sub2)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--counts", nargs="+", type=at_least(0), default=None,
                   help="float32 elements per rank (default 1024 65536 1048576; quick 1024 65536)")
    p.add_argument("--iters", type=at_least(1), default=None,
                   help="timed calls per variant per round (default 10; quick 3)")
    p.add_argument("--rounds", type=at_least(1), default=None, help="rounds, variants interleaved (default 3; quick 2)")


def _pattern(r: int, n: int) -> np.ndarray:
    return (((np.arange(n) * 7 + r * 13) % 23) - 11).astype(np.float32)


def _case(xs, comms, op: str, n: int, algo: str):
    """(xelink call, numpy call, wrong elements of the last xelink call's output, bytes as nccl-tests counts,
    poison: the outputs made unlike the expected ones, before xelink's block, since numpy's writes them too)."""
    p = len(comms)
    data = [_pattern(c.rank, n * (p if op == "reduce_scatter" else 1)) for c in comms]
    if op == "all_reduce":
        bufs = [xs.empty(c, n, "float32", usm="shared") for c in comms]
        want = np.sum(np.stack(data), axis=0)

        def refill():
            for b, d in zip(bufs, data):
                b.numpy()[:] = d

        def mine():
            refill()
            xs.all_reduce(bufs, algo=algo)

        def numpy_call():
            refill()
            total = np.sum(np.stack([b.numpy() for b in bufs]), axis=0)
            for b in bufs:
                b.numpy()[:] = total

        def wrong():
            return sum(int(np.count_nonzero(b.numpy() != want)) for b in bufs)

        return mine, numpy_call, wrong, 4 * n, refill  # (mine refills: a call that does nothing leaves the input)
    ins = [xs.empty(c, len(d), "float32", usm="shared") for c, d in zip(comms, data)]
    for b, d in zip(ins, data):
        b.numpy()[:] = d
    if op == "all_gather":
        outs = [xs.empty(c, p * n, "float32", usm="shared") for c in comms]
        want = [np.concatenate(data)] * p

        def mine():
            xs.all_gather_into_tensor(outs, ins, algo=algo)

        def numpy_call():
            for o in outs:
                np.concatenate([b.numpy() for b in ins], out=o.numpy())
        nbytes = 4 * n * p
    else:
        outs = [xs.empty(c, n, "float32", usm="shared") for c in comms]
        total = np.sum(np.stack(data), axis=0)
        want = [total[r * n:(r + 1) * n] for r in range(p)]

        def mine():
            xs.reduce_scatter_tensor(outs, ins, algo=algo)

        def numpy_call():
            s = np.sum(np.stack([b.numpy() for b in ins]), axis=0)
            for r, o in enumerate(outs):
                o.numpy()[:] = s[r * n:(r + 1) * n]
        nbytes = 4 * n * p

    def wrong():
        return sum(int(np.count_nonzero(o.numpy() != w)) for o, w in zip(outs, want))

    def poison():
        for o, w in zip(outs, want):
            poison_unlike(o.numpy(), w)

    return mine, numpy_call, wrong, nbytes, poison


def run(ctx) -> list:
    """The rows of ``add_arguments``' options on rank 0 ([] elsewhere, with a note)."""
    if not ctx.lead:
        return []
    import xelink.sycl as xs  # the suite checked that dpctl and a device are there (Family.sycl_only)

    from ... import cost

    args = ctx.args

    if args.devices == "sub2":
        try:
            every = xs.communicators()
        except ValueError as exc:  # (a CPU device of one compute unit cannot be partitioned)
            raise Unavailable(f"--devices sub2 needs two SYCL queues: {exc}") from None
        if len(every) < 2:
            raise Unavailable(f"--devices sub2 needs two SYCL queues; this machine's default has {len(every)}")
        comms = every if len(every) == 2 else xs.communicators([c.device for c in every[:2]])
    else:
        comms = xs.communicators(["opencl:cpu"] * 4, packages=[[0, 1], [2, 3]])
    topo, placement = xs.topology(comms)
    p = len(comms)
    counts = args.counts or (QUICK_COUNTS if ctx.quick else COUNTS)
    iters = args.iters or (3 if ctx.quick else 10)
    rounds = args.rounds or (2 if ctx.quick else 3)
    ctx.notes.append(f"sycl-collectives: {args.devices}: {p} queue(s) {[str(c.device.name).strip() for c in comms]}, "
                     f"packages {comms[0].packages}; baseline numpy on the host over the same shared-USM buffers; "
                     f"predictions: xelink.cost on xelink.sycl.topology (estimated figures)")
    rows = []
    progress = ctx.progress(len(counts) * len(args.ops))
    for n in counts:
        for op in args.ops:
            for algo in xs.ALGOS[op]:
                mine, numpy_call, wrong, nbytes, poison = _case(xs, comms, op, n, algo)
                bad = {"xelink": 0}

                def check(name, wrong=wrong, bad=bad):
                    if name == "xelink":
                        bad["xelink"] += wrong()

                def before(name, poison=poison):
                    if name == "xelink":
                        poison()

                samples = co_measure({"xelink": mine, "numpy": numpy_call}, warmup=1, iters=iters, rounds=rounds,
                                     after_block=check, before_block=before)
                pred = cost.predict(topo, placement, op, algo, nbytes).time_s * 1e6 \
                    if algo in cost.ALGOS.get(op, ()) else None
                rows.append(make_row(op, f"xelink:{algo}", samples["xelink"], size_bytes=nbytes, count=n,
                                     dtype="float32", nranks=p, wrong=bad["xelink"], baseline="numpy:host",
                                     baseline_samples=samples["numpy"], predicted_us=pred,
                                     extra={"devices": args.devices}))
            progress.step(f"{op} {n} elements")
    return rows
