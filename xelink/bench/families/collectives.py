"""Collectives benchmark: every op x algorithm over a size sweep, next to the transport's own collective.

Run under a launcher: ``mpiexec -n 4 xelink bench collectives``. The baseline is MPI's own collective
under mpirun and torch.distributed (gloo) under torchrun, timed in the same run, interleaved with xelink's paths. On CUDA ranks the tensors live on the
GPUs, the algorithms are xelink's GPU ones (the registry's ``cuda`` entries), the baseline is NCCL
(torch.distributed) and every call is timed with CUDA events; its tuning entries are ``cuda:<op>``, what ``algo="auto"`` reads
for CUDA tensors. Each timed call copies the user's
input into the buffer first (copy-in counted, as a user pays it) and the output of the last timed run
of every block is checked against the known answer (#wrong). Beside each of xelink's rows, the cost
model's prediction for the same topology and size and its ratio to the measurement (``pred/meas``),
priced with a probe calibration when given one (``--calibration``; ``xelink bench all`` measures one
first, in the links family). Rank 0 prints nccl-tests-style columns, writes JSON Lines with a run
manifest (``--out``/``--jsonl``), CSV and plots on request, and the tuning table ``algo="auto"`` reads
(``--tune``).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ... import collectives as C
from ..harness import at_least, co_measure, make_row, one_gpu_per_rank, poison_unlike, pred_over_meas, rank_max

__all__ = ["run_sweep", "measure_case", "transport_baseline", "algorithms", "model_algo", "run", "add_arguments", "copy_in_s",
           "OPS", "SIZES", "QUICK_SIZES"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_MPI_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}


def _case(op: str, n: int, rank: int, nbytes: int, dtype, device=None):
    """(input, output, expected output, xelink call(algo), baseline call or None) for one size.

    ``nbytes`` is the nccl-tests size: the buffer for all_reduce/all_to_all, the output for
    all_gather, the input for reduce_scatter. Tensors live on ``device`` (default: the CPU).
    """
    item = torch.tensor([], dtype=dtype).element_size()
    count = max(n, nbytes // item // n * n)  # divisible by n
    shard = count // n
    arange = lambda k: torch.arange(k, device=device)  # noqa: E731
    pattern = lambda r, k: ((arange(k) + 3 * r) % 5).to(dtype)  # noqa: E731 - small ints: exact
    if op == "all_reduce":
        src, out = pattern(rank, count), torch.empty(count, dtype=dtype, device=device)
        want = sum(pattern(r, count).to(torch.float64) for r in range(n)).to(dtype)
        ours = lambda algo: (out.copy_(src), C.all_reduce(out, algo=algo))  # noqa: E731
        return src, out, want, ours, lambda b: (out.copy_(src), b.all_reduce(out))
    if op == "all_gather":
        src, out = pattern(rank, shard), torch.empty(count, dtype=dtype, device=device)
        want = torch.cat([pattern(r, shard) for r in range(n)])
        return src, out, want, lambda algo: C.all_gather_into_tensor(out, src, algo=algo), \
            lambda b: b.all_gather(out, src)
    if op == "reduce_scatter":
        src, out = pattern(rank, count), torch.empty(shard, dtype=dtype, device=device)
        want = sum(pattern(r, count).to(torch.float64) for r in range(n)).to(dtype)[rank * shard:(rank + 1) * shard]
        return src, out, want, lambda algo: C.reduce_scatter_tensor(out, src, algo=algo), \
            lambda b: b.reduce_scatter(out, src)
    if op == "all_to_all":
        src = (arange(count) + 1000 * rank).to(dtype)
        out = torch.empty(count, dtype=dtype, device=device)
        want = torch.cat([(arange(count)[rank * shard:(rank + 1) * shard] + 1000 * r) for r in range(n)]).to(dtype)
        return src, out, want, lambda algo: C.all_to_all_single(out, src, algo=algo), \
            lambda b: b.all_to_all(out, src)
    raise ValueError(f"run_sweep: unknown op {op!r} (one of {', '.join(OPS)})")


class _MPIBaseline:
    """MPI's own collectives on the communicator's mpi4py communicator."""

    def __init__(self, comm):
        from mpi4py import MPI

        self.MPI, self.c = MPI, comm.transport.comm
        self.name = "mpi"

    def all_reduce(self, x):
        self.c.Allreduce(self.MPI.IN_PLACE, x.numpy())

    def all_gather(self, out, src):
        self.c.Allgather(src.numpy(), out.numpy())

    def reduce_scatter(self, out, src):
        self.c.Reduce_scatter_block(src.numpy(), out.numpy())

    def all_to_all(self, out, src):
        self.c.Alltoall(src.numpy(), out.numpy())


class _TorchBaseline:
    """torch.distributed collectives on the communicator's process group: gloo on host tensors, NCCL on CUDA."""

    def __init__(self, comm):
        import torch.distributed as dist

        self.d, self.pg = dist, comm.process_group()
        self.name = "nccl" if _on_cuda(comm) else "gloo"

    def all_reduce(self, x):
        self.d.all_reduce(x, group=self.pg)

    def all_gather(self, out, src):
        self.d.all_gather_into_tensor(out, src, group=self.pg)

    def reduce_scatter(self, out, src):
        self.d.reduce_scatter_tensor(out, src, group=self.pg)

    def all_to_all(self, out, src):
        self.d.all_to_all_single(out, src, group=self.pg)


def transport_baseline(comm):
    """The baseline collectives of ``comm``'s launch: MPI's own on CPU ranks under mpirun, else
    torch.distributed's (gloo on host tensors, NCCL on CUDA), with ``all_reduce(x)``, ``all_gather(out,
    src)``, ``reduce_scatter(out, src)``, ``all_to_all(out, src)`` and ``name``."""
    return _MPIBaseline(comm) if comm.transport.name == "mpi" and not _on_cuda(comm) else _TorchBaseline(comm)


def copy_in_s(calibration, placement, nbytes: int) -> float:
    """Seconds to copy ``nbytes`` at the probe's copy bandwidth of the slowest device (0 without figures).

    The all-reduce rows are timed copying the user's input into the buffer first (the op is in place),
    so their prediction adds this copy.
    """
    if calibration is None:
        return 0.0
    speeds = [calibration.device_local(d).copy_gbps for d in placement.devices]
    speeds = [s for s in speeds if s]
    return nbytes / (min(speeds) * 1e9) if speeds and nbytes else 0.0


def _predict(topology, placement, calibration, op, algo, nbytes):
    """The cost model's time (us) of ``algo`` at ``nbytes``, copy-in included for all_reduce; None where
    the model does not describe the algorithm."""
    if topology is None:
        return None
    from ...cost import predict

    try:
        seconds = predict(topology, placement, op, algo, nbytes, calibration).time_s
    except ValueError:
        return None  # an algorithm the model does not describe
    return (seconds + (copy_in_s(calibration, placement, nbytes) if op == "all_reduce" else 0.0)) * 1e6


def _on_cuda(comm) -> bool:
    return getattr(comm.device, "type", "cpu") == "cuda"


def _entries(comm, op: str):
    """xelink's registered algorithms of ``op`` for tensors of ``comm``'s device that take any tensor (not
    the baseline's; not those whose input must come from ``xelink.empty``)."""
    from ...collectives import registry

    backend = "cuda" if _on_cuda(comm) else "cpu"
    return [a for a in registry.algorithms(op, backend) if not a.needs & {"baseline", "symmetric"}]


def algorithms(comm, op: str) -> tuple:
    """xelink's algorithms of ``op`` for tensors of ``comm``'s device (the registry's, any tensor)."""
    return tuple(a.name for a in _entries(comm, op))


def model_algo(comm, op: str, algo: str) -> str | None:
    """The cost model's schedule for ``algo`` of ``op`` on ``comm``'s device (the registry says it)."""
    return next((a.schedule for a in _entries(comm, op) if a.name == algo), None)


def measure_case(comm, op: str, nbytes: int, dtype, *, warmup: int, iters: int, rounds: int, baseline=None,
                 algos=None):
    """Co-measure every algorithm of ``op`` (and ``baseline``'s collective) at one size, checked.

    On CUDA ranks the tensors live on the GPU (the registry's CUDA algorithms) and each call is timed with CUDA events.
    ``algos``: the algorithms to time (default ``algorithms(comm, op)``).

    Returns:
        (input, output, samples by path, wrong elements by path summed over ranks), on every rank.

    Collective: every rank of ``comm`` must call this with the same arguments.
    """
    cuda = _on_cuda(comm)
    src, out, want, ours, theirs = _case(op, comm.size, comm.rank, nbytes, dtype, comm.device if cuda else None)
    variants = {f"xelink:{a}": (lambda a=a: ours(a)) for a in (algos or algorithms(comm, op))}
    if baseline is not None:
        variants[f"{baseline.name}:{op}"] = lambda: theirs(baseline)
    wrong = {name: 0 for name in variants}

    def check(name):
        wrong[name] += int((out != want).sum())

    def poison(name):  # every element unlike the expected one: a variant that writes nothing counts as wrong
        poison_unlike(out, want)

    timing = None
    if cuda:
        import functools

        from ..harness import time_cuda_events

        timing = functools.partial(time_cuda_events, warmup=0)
    samples = co_measure(variants, warmup=warmup, iters=iters, rounds=rounds, barrier=comm.barrier,
                         reduce_max=rank_max(comm), after_block=check, before_block=poison, timing=timing)
    wrong = dict(zip(wrong, map(sum, zip(*comm.allgather_object(list(wrong.values()))))))
    return src, out, samples, wrong


def run_sweep(comm, ops=OPS, sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 22), dtype=torch.float32, *,
              warmup=2, iters=5, rounds=3, topology=None, calibration=None, placement=None, progress=None) -> list:
    """Time every op x algorithm at every size next to the baseline; returns result rows (every rank).

    Args:
        comm: the communicator whose ranks run the sweep.
        ops, sizes, dtype: what to time (sizes in bytes, nccl-tests convention).
        warmup, iters, rounds: as ``co_measure``.
        topology, calibration, placement: what the cost model prices each row with (``predicted_us``);
            no prediction without a topology; placement default: ``place(topology, comm.size)``.
        progress: a ``harness.Progress`` (one step per op and size), or None.

    Collective: every rank of ``comm`` must call this with the same arguments.
    """
    n = comm.size
    if topology is not None and placement is None:
        from ...topology import place

        placement = place(topology, n)
    # NCCL refuses ranks that share a GPU (XELINK_RANKS_PER_DEVICE): xelink's rows alone there
    base = None if _on_cuda(comm) and not one_gpu_per_rank(comm) else transport_baseline(comm)
    if base is not None and base.name == "mpi" and dtype not in _MPI_DTYPES:
        raise ValueError(f"run_sweep: dtype={dtype} has no MPI datatype; the MPI baseline needs one of "
                         f"{', '.join(map(str, _MPI_DTYPES))}")
    rows = []
    for op in ops:
        algos = algorithms(comm, op)
        for nbytes in sizes:
            src, out, samples, wrong = measure_case(comm, op, nbytes, dtype, warmup=warmup, iters=iters,
                                                    rounds=rounds, baseline=base)
            size = out.numel() * out.element_size() if op == "all_gather" else src.numel() * src.element_size()
            # nccl-tests' count: one rank's share (all_gather's input, reduce_scatter's output)
            count = out.numel() if op == "reduce_scatter" else src.numel()
            common = dict(size_bytes=size, count=count, dtype=dtype, nranks=n)
            bname = None if base is None else f"{base.name}:{op}"
            for a in algos:
                modelled = model_algo(comm, op, a)
                pred = None if modelled is None else _predict(topology, placement, calibration, op, modelled, size)
                extra = {} if pred is None else {
                    "model": {"topology": topology.name, "calibration": getattr(calibration, "name", None),
                              "pred_over_meas": None}}
                row = make_row(op, f"xelink:{a}", samples[f"xelink:{a}"], wrong=wrong[f"xelink:{a}"],
                               baseline=bname, baseline_samples=samples.get(bname), predicted_us=pred, extra=extra,
                               **common)
                if pred is not None:
                    row.extra["model"]["pred_over_meas"] = pred_over_meas(row)
                rows.append(row)
            if bname is not None:
                rows.append(make_row(op, bname, samples[bname], wrong=wrong[bname], **common))
            if progress is not None:
                progress.step(f"{op} {nbytes} B: {', '.join(algos)}" + ("" if bname is None else f" and {bname}"))
    return rows


def _size(text: str) -> int:
    """An argparse type: a size in bytes, at least 1 (a size below an element a rank is measured as one)."""
    import argparse

    from ...cost import parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return size


SIZES = tuple(1 << k for k in range(10, 25, 2))  # 1 KiB to 16 MiB, x4
QUICK_SIZES = tuple(1 << k for k in range(10, 23, 2))  # 1 KiB to 4 MiB, x4
QUICK = {"iters": 3, "rounds": 2, "warmup": 1}


def add_arguments(p) -> None:
    """The options of ``xelink bench collectives``."""
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--sizes", nargs="+", type=_size, default=None,
                   help="sizes in bytes (suffixes K, M, G allowed), nccl-tests convention (default 1K to 16M x4; "
                        "quick 1K to 4M x4)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "int32", "int64"])
    p.add_argument("--iters", type=at_least(1), default=None,
                   help="timed calls per variant per round (default 5; quick 3)")
    p.add_argument("--rounds", type=at_least(1), default=None, help="rounds, variants interleaved (default 3; quick 2)")
    p.add_argument("--warmup", type=at_least(0), default=None,
                   help="untimed calls of each variant first (default 2; quick 1)")
    p.add_argument("--tune", default=None, help="write the tuning table (fastest path per size) here")
    p.add_argument("--calibration", metavar="PATH", help="price the predictions with this probe calibration "
                                                         "(`xelink bench links --calibration-out`)")
    p.add_argument("--topology", metavar="PATH", help="price them on this (measured) topology; default: the job's")


def run(ctx) -> list:
    """The sweep with the options of ``add_arguments``; tuning table and header on rank 0. Collective."""
    from ... import cost
    from ...topology import Placement, from_env_or_discover, load
    from ..probe import job_placement

    world, args = ctx.world, ctx.args
    cuda = _on_cuda(world)
    job_topo = world.topology or from_env_or_discover(world)
    topo, placement = job_placement(world, job_topo, None)
    job_place = placement  # what xelink.init fingerprints (the model's placement may take --topology's figures)
    cal = cost.load_calibration(args.calibration) if args.calibration else None
    if args.topology:
        topo = load(args.topology)
        stray = sorted(set(placement.devices) - {d.id for d in topo.devices})
        if stray:  # (every rank: the same file and job) a model of another machine cannot price this job's rows
            raise SystemExit(f"xelink bench collectives: --topology {args.topology!r} ({topo.name}) has no device "
                             f"{stray[0]!r} of this job's ({', '.join(sorted(set(placement.devices)))}): give one "
                             f"measured for this job (`xelink bench links --topology-out`)")
        placement = Placement(topo, placement.devices)
    elif getattr(world.device, "type", "cpu") not in ("cpu", "cuda") and cal is None:
        # The job's topology then describes the GPUs' links; these collectives move host memory over the
        # host transport, which it does not price: no prediction rather than a wrong one. (On CUDA ranks
        # the sweep moves device memory, which the topology does describe.)
        topo = None
    knobs = {"iters": 5, "rounds": 3, "warmup": 2, **(QUICK if ctx.quick else {})}
    knobs.update({k: getattr(args, k) for k in knobs if getattr(args, k) is not None})
    sizes = args.sizes or (QUICK_SIZES if ctx.quick else SIZES)
    rows = run_sweep(world, args.ops, sizes, getattr(torch, args.dtype), topology=topo, calibration=cal,
                     placement=placement, progress=ctx.progress(len(args.ops) * len(sizes)), **knobs)
    if ctx.lead:
        if topo is None:
            model = "no prediction: the job's topology describes its devices, these are host-memory collectives"
        else:
            model = "pred = cost model (topology " + topo.name + (
                f" + calibration {cal.name}" if cal else ", links only: no calibration; `xelink bench links` "
                                                         "measures one") + "), all_reduce with the copy-in; " \
                "pred/meas = predicted / measured"
        where = "CUDA tensors, eager, CUDA events" if cuda else "host tensors"
        if cuda and not one_gpu_per_rank(world):
            ctx.notes.append(f"the NCCL baseline left out: {world.size} ranks share a GPU, and NCCL needs one GPU "
                             f"per rank")
        ctx.header = (f"# {world.size} ranks, {world.launch.launcher}, topology {job_topo.name}, {where}; ratio = "
                      f"baseline time / xelink time (>1: xelink faster); {model}")
        if args.tune:
            from ...tuning import fingerprint, save_merged
            from ..tune import build_table

            meta = ctx.manifest({"topology": job_topo.name})
            # algo="auto" on CUDA tensors looks up "cuda:<op>" (collectives/dispatch.py).
            # The copy_engine all-gather stages a plain tensor in the peer scratch, which caps its size: not a
            # path auto may extend to every size above the sweep.
            keyed = [dataclasses.replace(r, op=f"cuda:{r.op}") for r in rows
                     if r.path != "xelink:copy_engine"] if cuda else rows
            fp = fingerprint(job_topo.name, world.hosts, job_place)
            merged = save_merged(build_table(keyed, fp, manifest=meta), args.tune)
            ctx.notes.append(f"tuning table written to {args.tune}" + (" (merged with the entries already there)"
                                                                      if merged else ""))
    return rows

