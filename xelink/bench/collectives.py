"""Collectives benchmark: every op x algorithm over a size sweep, next to the transport's own collective.

Run under a launcher: ``mpiexec -n 4 python -m xelink.bench.collectives`` (or ``xelink bench
collectives``). The baseline is MPI's own collective under mpirun and torch.distributed (gloo) under
torchrun, timed in the same run, interleaved with xelink's paths. Each timed call copies the user's
input into the buffer first (copy-in counted, as a user pays it) and the output of the last timed run
of every block is checked against the known answer (#wrong). Rank 0 prints nccl-tests-style columns,
writes JSON Lines with a run manifest, and can write the tuning table ``algo="auto"`` reads.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from .. import collectives as C
from .harness import JsonlWriter, co_measure, format_table, make_row, manifest, rank_max

__all__ = ["run_sweep", "main", "OPS"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_MPI_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}


def _case(op: str, n: int, rank: int, nbytes: int, dtype):
    """(input, output, expected output, xelink call(algo), baseline call or None) for one size.

    ``nbytes`` is the nccl-tests size: the buffer for all_reduce/all_to_all, the output for
    all_gather, the input for reduce_scatter.
    """
    item = torch.tensor([], dtype=dtype).element_size()
    count = max(n, nbytes // item // n * n)  # divisible by n
    shard = count // n
    pattern = lambda r, k: ((torch.arange(k) + 3 * r) % 5).to(dtype)  # noqa: E731 - small ints: exact
    if op == "all_reduce":
        src, out = pattern(rank, count), torch.empty(count, dtype=dtype)
        want = sum(pattern(r, count).to(torch.float64) for r in range(n)).to(dtype)
        ours = lambda algo: (out.copy_(src), C.all_reduce(out, algo=algo))  # noqa: E731
        return src, out, want, ours, lambda b: (out.copy_(src), b.all_reduce(out))
    if op == "all_gather":
        src, out = pattern(rank, shard), torch.empty(count, dtype=dtype)
        want = torch.cat([pattern(r, shard) for r in range(n)])
        return src, out, want, lambda algo: C.all_gather_into_tensor(out, src, algo=algo), \
            lambda b: b.all_gather(out, src)
    if op == "reduce_scatter":
        src, out = pattern(rank, count), torch.empty(shard, dtype=dtype)
        want = sum(pattern(r, count).to(torch.float64) for r in range(n)).to(dtype)[rank * shard:(rank + 1) * shard]
        return src, out, want, lambda algo: C.reduce_scatter_tensor(out, src, algo=algo), \
            lambda b: b.reduce_scatter(out, src)
    if op == "all_to_all":
        src = (torch.arange(count) + 1000 * rank).to(dtype)
        out = torch.empty(count, dtype=dtype)
        want = torch.cat([(torch.arange(rank * shard, (rank + 1) * shard) + 1000 * r) for r in range(n)]).to(dtype)
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
    """torch.distributed (gloo) collectives on the communicator's process group."""

    def __init__(self, comm):
        import torch.distributed as dist

        self.d, self.pg = dist, comm.process_group()
        self.name = "gloo"

    def all_reduce(self, x):
        self.d.all_reduce(x, group=self.pg)

    def all_gather(self, out, src):
        self.d.all_gather_into_tensor(out, src, group=self.pg)

    def reduce_scatter(self, out, src):
        self.d.reduce_scatter_tensor(out, src, group=self.pg)

    def all_to_all(self, out, src):
        self.d.all_to_all_single(out, src, group=self.pg)


def _predict(topology, n, op, algo, nbytes):
    if topology is None:
        return None
    from ..cost import predict

    try:
        return predict(topology, n, op, algo, nbytes).time_s * 1e6
    except ValueError:
        return None  # an algorithm the model does not describe


def run_sweep(comm, ops=OPS, sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 22), dtype=torch.float32, *,
              warmup=2, iters=5, rounds=3, topology=None, progress=None) -> list:
    """Time every op x algorithm at every size next to the baseline; returns result rows (every rank).

    Collective: every rank of ``comm`` must call this with the same arguments.
    """
    n, rank = comm.size, comm.rank
    base = _MPIBaseline(comm) if comm.transport.name == "mpi" else _TorchBaseline(comm)
    if base.name == "mpi" and dtype not in _MPI_DTYPES:
        raise ValueError(f"run_sweep: dtype={dtype} has no MPI datatype; the MPI baseline needs one of "
                         f"{', '.join(map(str, _MPI_DTYPES))}")
    key = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all"}
    rows = []
    for op in ops:
        algos = C.ALGORITHMS[key.get(op, op)]
        for nbytes in sizes:
            src, out, want, ours, theirs = _case(op, n, rank, nbytes, dtype)
            variants = {f"xelink:{a}": (lambda a=a: ours(a)) for a in algos}
            variants[f"{base.name}:{op}"] = lambda: theirs(base)
            wrong = {name: 0 for name in variants}

            def check(name):
                wrong[name] += int((out != want).sum())

            samples = co_measure(variants, warmup=warmup, iters=iters, rounds=rounds, barrier=comm.barrier,
                                 reduce_max=rank_max(comm), after_block=check)
            wrong = {k: sum(v) for k, v in zip(wrong, zip(*comm.allgather_object(list(wrong.values()))))}
            size = out.numel() * out.element_size() if op == "all_gather" else src.numel() * src.element_size()
            common = dict(size_bytes=size, count=src.numel(), dtype=dtype, nranks=n)
            bname = f"{base.name}:{op}"
            for a in algos:
                rows.append(make_row(op, f"xelink:{a}", samples[f"xelink:{a}"], wrong=wrong[f"xelink:{a}"],
                                     baseline=bname, baseline_samples=samples[bname],
                                     predicted_us=_predict(topology, n, op, a, size), **common))
            rows.append(make_row(op, bname, samples[bname], wrong=wrong[bname], **common))
            if progress:
                progress(op, nbytes)
    return rows


def _size(text: str) -> int:
    from ..cost import parse_size

    return parse_size(text)


def main(argv=None) -> int:
    import xelink

    p = argparse.ArgumentParser(prog="xelink bench collectives", description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--sizes", nargs="+", type=_size, default=[1 << 10, 1 << 14, 1 << 18, 1 << 22],
                   help="sizes in bytes (suffixes K, M, G allowed), nccl-tests convention")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "int32", "int64"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--jsonl", default=None, help="write result rows (with the run manifest) here")
    p.add_argument("--tune", default=None, help="write the tuning table (fastest path per size) here")
    args = p.parse_args(argv)
    world = xelink.init()
    from ..topology import from_env_or_discover

    topo = from_env_or_discover(world)
    rows = run_sweep(world, args.ops, args.sizes, getattr(torch, args.dtype), warmup=args.warmup,
                     iters=args.iters, rounds=args.rounds, topology=topo)
    if world.rank == 0:
        print(f"# {world.size} ranks, {world.launch.launcher}, topology {topo.name}; ratio = baseline time / "
              f"xelink time (>1: xelink faster); pred = cost model")
        print(format_table(rows))
        meta = manifest(world, extra={"family": "collectives", "topology": topo.name})
        if args.jsonl:
            with JsonlWriter(args.jsonl, meta) as w:
                for r in rows:
                    w.write(r)
        if args.tune:
            from .tuning import build_table, fingerprint

            build_table(rows, fingerprint(topo.name, world.hosts), manifest=meta).save(args.tune)
            print(f"tuning table written to {args.tune}")
    bad = sum(r.wrong for r in rows)
    xelink.finalize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
