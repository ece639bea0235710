"""Topology on every rank: discovery of CPU ranks, XELINK_TOPOLOGY, and package / cross-package groups."""
import pytest

from xelink import topology as T

WORLD_SIZES = (1, 2, 4)

# Packages of 3 and 2 CPU slots: with 4 ranks the placement is uneven (3 + 1), with 5 it would be 3 + 2.
UNEVEN = """\
name = "cpu-3+2"

[device_defaults]
kind = "cpu"
injection_gbps = 8.0
injection_source = "estimate"

[[packages]]
id = "big"
devices = ["c0", "c1", "c2"]

[[packages]]
id = "small"
devices = ["c3", "c4"]

[[links]]
name = "shm-big"
kind = "shm"
joins = ["c0", "c1", "c2"]
bandwidth_gbps = 8.0
bandwidth_source = "estimate"
latency_us = 2.0
latency_source = "estimate"

[[links]]
name = "shm-small"
kind = "shm"
joins = ["c3", "c4"]
bandwidth_gbps = 8.0
bandwidth_source = "estimate"
latency_us = 2.0
latency_source = "estimate"

[[links]]
name = "fabric"
kind = "shm"
joins = ["big", "small"]
bandwidth_gbps = 8.0
bandwidth_source = "estimate"
latency_us = 2.0
latency_source = "estimate"
"""


def check_discover_cpu_ranks(world):
    topo = T.discover(world)
    assert topo.name == "discovered-cpu"
    # one host here: one package holding every rank, in rank order
    assert [p.devices for p in topo.packages] == [tuple(f"rank{r}" for r in range(world.size))]
    assert T.place(topo, world.size).devices == tuple(f"rank{r}" for r in range(world.size))
    assert [l.kind for l in topo.links] == (["shm"] if world.size > 1 else [])
    text = T.dumps(topo)
    assert T.loads(text) == topo
    assert world.allgather_object(text) == [text] * world.size  # every rank found the same machine


def check_env_variable_overrides_discovery(world):
    assert T.from_env_or_discover(world, env={"XELINK_TOPOLOGY": "cpu-2x2"}) == T.load("cpu-2x2")
    assert T.from_env_or_discover(world, env={}).name == "discovered-cpu"


def _check_groups(world, placement, want_package, want_cross):
    comm = world.split(0)
    comm.packages = T.packages(placement) if placement.nranks == world.size else [list(range(world.size))]
    pkg, cross = comm.package_groups()
    try:
        assert pkg.world_ranks == want_package, (pkg.world_ranks, want_package)
        assert cross.world_ranks == want_cross, (cross.world_ranks, want_cross)
        assert pkg.rank == want_package.index(world.rank) and cross.rank == want_cross.index(world.rank)
        # the groups carry messages among exactly their members
        assert pkg.allgather_object(world.rank) == want_package
        assert cross.allgather_object(world.rank) == want_cross
        assert comm.package_groups() == (pkg, cross)  # made once per layout
    finally:
        comm.free()
    assert pkg._freed and cross._freed  # released with the communicator that made them


def check_package_groups_cpu_2x2(world):
    placement = T.place(T.load("cpu-2x2"), world.size)
    r = world.rank
    if world.size == 4:
        want_package = [0, 1] if r < 2 else [2, 3]
        want_cross = [0, 2] if r % 2 == 0 else [1, 3]
        assert (len(want_package), len(want_cross)) == (2, 2)
    else:  # 1 or 2 ranks fill the first package only
        want_package = list(range(world.size))
        want_cross = [r]
    assert T.packages(placement)[T.package_of(placement, r)] == want_package
    assert sorted([r] + T.cross_peers(placement, r)) == want_cross
    _check_groups(world, placement, want_package, want_cross)


def check_package_groups_uneven(world):
    placement = T.place(T.loads(UNEVEN, path="cpu-3+2.toml"), world.size)
    r = world.rank
    if world.size == 4:
        assert T.packages(placement) == [[0, 1, 2], [3]]
        want_package = [0, 1, 2] if r < 3 else [3]
        # local index 1 and 2 have no peer in the one-rank package: those cross groups hold one rank
        want_cross = {0: [0, 3], 1: [1], 2: [2], 3: [0, 3]}[r]
    else:
        want_package = list(range(world.size))
        want_cross = [r]
    _check_groups(world, placement, want_package, want_cross)


def check_a_layout_that_is_not_a_partition_is_refused(world):
    comm = world.split(0)
    with pytest.raises(ValueError, match=rf"packages: \[\[0\], \[{world.size}\]\] is not a partition of ranks "
                                         rf"0..{world.size - 1}"):
        comm.packages = [[0], [world.size]]
    comm.free()
    world.barrier()  # nothing was exchanged: the communicator still works
