"""Latency of the shared-memory peer-counter barrier next to MPI_Barrier, in the same run.

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/scripts/shm_barrier.py [--iters 2000] [--reps 7]

Each repetition times ``iters`` back-to-back barriers of each kind, interleaved (peer counters,
MPI_Barrier on the same node communicator, peer counters, ...), so that both see the same machine
load; the table gives the median over repetitions of the per-barrier time as rank 0 sees it.
"""
from __future__ import annotations

import argparse
import statistics
import time

__all__ = ["main"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)

    import xelink
    from xelink.transport.shm import PeerWindow

    world = xelink.init()
    pw = PeerWindow(world, 64)
    node = pw._node.mpi  # MPI_Barrier over exactly the ranks the peer counters span
    times: dict = {"peer counters": [], "MPI_Barrier": []}

    def run_peer():
        for _ in range(args.iters):
            pw.barrier()

    def run_mpi():
        for _ in range(args.iters):
            node.Barrier()

    for fn in (run_peer, run_mpi):  # warm-up
        fn()
    for _ in range(args.reps):
        for name, fn in (("peer counters", run_peer), ("MPI_Barrier", run_mpi)):
            node.Barrier()
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) / args.iters * 1e6)
    if world.rank == 0:
        print(f"ranks on the node: {pw.node_size}, {args.iters} barriers x {args.reps} repetitions")
        print(f"{'barrier':<16}{'median us':>10}{'min us':>10}{'max us':>10}")
        for name, ts in times.items():
            print(f"{name:<16}{statistics.median(ts):>10.1f}{min(ts):>10.1f}{max(ts):>10.1f}")
    pw.free()
    xelink.finalize()


if __name__ == "__main__":
    main()
