"""The harness on real ranks: the manifest of a communicator, co-measurement with barrier and rank max."""
import time

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
