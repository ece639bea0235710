"""The harness on real ranks: the manifest of a communicator, co-measurement with barrier and rank max."""
import time

import torch

from xelink.bench import co_measure, manifest, rank_max

WORLD_SIZES = (1, 3)


def check_manifest_of_the_world(world):
    m = manifest(world)
    assert m["world_size"] == world.size and m["hosts"] == world.hosts
    assert m["launcher"] == world.launch.launcher and m["device"] == "cpu"
    if world.launch.launcher == "mpich":
        assert m["versions"]["mpi"].startswith("MPICH")  # MPI is initialised here, so it is described


def check_co_measure_reports_the_slowest_rank(world):
    # Rank r sleeps (r + 1) ms in "slow": every rank must report the last rank's time.
    variants = {"slow": lambda: time.sleep((world.rank + 1) * 1e-3), "fast": lambda: None}
    samples = co_measure(variants, warmup=1, iters=3, rounds=2, barrier=world.barrier, reduce_max=rank_max(world))
    assert samples == world.allgather_object(samples)[0]  # identical on every rank
    assert min(samples["slow"]) >= world.size * 1e-3
    assert len(samples["fast"]) == 6


def check_a_collective_that_writes_nothing_is_counted_wrong(world):
    """The collectives family's checks: an algorithm that writes nothing into the output every variant shares
    (the one before it left the right answer there) is counted wrong, on every rank's row."""
    import types

    import xelink.collectives as real
    from xelink.bench.families import collectives as F

    noop = types.SimpleNamespace(all_reduce=real.all_reduce,
                                 all_gather_into_tensor=lambda out, src, algo: None if algo == "ring" else
                                 real.all_gather_into_tensor(out, src, algo=algo),
                                 reduce_scatter_tensor=real.reduce_scatter_tensor,
                                 all_to_all_single=real.all_to_all_single)
    F.C = noop
    try:
        _, _, _, wrong = F.measure_case(world, "all_gather", 4096, torch.float32, warmup=1, iters=1, rounds=2,
                                        algos=("direct", "ring"))
    finally:
        F.C = real
    assert wrong["xelink:direct"] == 0 and wrong["xelink:ring"] > 0, wrong
