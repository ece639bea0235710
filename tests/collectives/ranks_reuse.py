"""Buffers reused across calls: back-to-back calls that change op, size, dtype and algorithm, late
ranks, a data-parallel training client, and a stalled rank that every rank's error names."""
import os
import time

import pytest
import torch

import xelink
from collective_cases import assert_same, compare_training, expected_reduce, data, run_sequence
from ranks import only
from xelink.collectives import ALGORITHMS

WORLD_SIZES = (2, 3, 4, 5)
LAUNCHERS = ("mpi", "torchrun")
LAUNCH_TIMEOUT = 400

# The parameter shapes of train_mlp's model, in the order its gradients are all-reduced.
MLP_SHAPES = ((64, 32), (64,), (10, 64), (10,))


def _two_packages(world):
    """A copy of the world split into two packages (uneven at odd sizes), so hierarchical/topo layer."""
    comm = world.split(0)
    half = (world.size + 1) // 2
    comm.packages = [list(range(half)), list(range(half, world.size))]
    return comm


@only(launchers=("mpi",))
def check_late_reader_of_direct_all_reduce(world):
    """One rank leaves the peer-memory barrier late (test hook): its peers' next, smaller call must
    not overwrite what it has yet to read. Sizes alternate like a model's gradients; one extra call
    halfway through puts every size on the other slot parity too."""
    comm = world.split(0)
    os.environ["XELINK_TEST_READ_DELAY"] = "1:0.01"
    try:
        case = 0
        for rep in range(4):
            for shape in (((1,),) if rep == 2 else ()) + MLP_SHAPES:
                case += 1
                count = torch.Size(shape).numel()
                x = data(comm.rank, case, count, torch.float32).view(shape)
                # The first call makes comm's peer window, which reads the hook.
                xelink.all_reduce(x, op="avg", group=comm, algo="direct")
                assert_same(x.view(-1), expected_reduce(comm.size, case, count, torch.float32, "avg"),
                            f"direct all_reduce avg {shape}, call {case}, rank 1 reading late")
    finally:
        del os.environ["XELINK_TEST_READ_DELAY"]
    comm.free()


@only(launchers=("mpi",))
def check_control_calls_wait_for_queued_async_collectives(world):
    """An async direct all-reduce whose first call makes its peer window on the worker thread (slow on rank 0:
    a descheduled thread), then at once, from the caller's thread, allgather_object, barrier, split and a
    checked call: each must wait for the queued work, not take the window's exchanges (a race that returned
    another rank's window message, or crashed in split)."""
    from xelink.transport import shm

    made = shm.PeerWindow.__init__

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        made(self, *args, **kwargs)

    n = world.size
    if world.rank == 0:
        shm.PeerWindow.__init__ = slow
    try:
        for i, control in enumerate(("objects", "barrier", "split", "checked")):
            if control == "checked":
                os.environ["XELINK_CHECK"] = "1"  # read when a communicator is made
            try:
                comm = world.split(0)
            finally:
                os.environ.pop("XELINK_CHECK", None)
            x = data(comm.rank, i, 8, torch.float32)
            handle = xelink.all_reduce(x, group=comm, algo="direct", async_op=True)
            if control == "objects":
                assert comm.allgather_object(("mine", comm.rank)) == [("mine", r) for r in range(n)]
            elif control == "barrier":
                comm.barrier()
            elif control == "split":
                sub = comm.split(0)
                assert sub.allgather_object(sub.rank) == list(range(n))
                sub.free()
            else:
                assert comm.check_calls
                y = data(comm.rank, i + 10, 4, torch.float32)
                xelink.all_reduce(y, group=comm, algo="direct", async_op=True).wait()
                assert_same(y, expected_reduce(n, i + 10, 4, torch.float32, "sum"), "a checked call after an async one")
            handle.wait()
            assert_same(x, expected_reduce(n, i, 8, torch.float32, "sum"), f"async direct all_reduce then {control}")
            comm.free()
    finally:
        shm.PeerWindow.__init__ = made


def check_back_to_back_calls(world):
    """The same random sequence of calls on every rank, random per-rank delays, every result checked."""
    run_sequence(world, 150, seed=1, delay=time.sleep, what="flat")
    # the 1- and 2-byte dtypes CPU ranks also reduce, between wider ones (slots of odd byte counts)
    run_sequence(world, 100, seed=3, delay=time.sleep, what="narrow dtypes",
                 dtypes=(torch.int8, torch.uint8, torch.int16, torch.bool, torch.float16, torch.float64))
    comm = _two_packages(world)
    run_sequence(comm, 100, seed=2, delay=time.sleep, what=f"packages {comm.packages}")
    comm.free()


def check_data_parallel_training(world):
    """Averaged gradients give one process's weights, with algo auto and with each algorithm named."""
    compare_training(world, ("auto",), steps=30)
    compare_training(world, ALGORITHMS["all_reduce"], steps=10)
    comm = _two_packages(world)
    compare_training(comm, ("auto", "hierarchical"), steps=10)
    comm.free()


@only(launchers=("mpi",))
def check_stalled_rank_is_named_by_every_rank(world):
    """Rank 1 stops (here: sleeps past the deadline) before a ring all-reduce. Ranks that wait on a
    neighbour name rank 1 as the rank furthest behind; so does rank 1 itself when it arrives late."""
    comm = world.split(0)
    xelink.all_reduce(torch.ones(4), group=comm)  # the progress board is made by the first collective
    if comm.rank == 1:
        time.sleep(0.9)
    with pytest.raises(xelink.TimeoutError) as info:
        xelink.all_reduce(torch.ones(1000), group=comm, algo="ring", timeout=0.5)
    err = info.value
    assert err.behind == [1], f"rank {comm.rank}: {err} (behind={err.behind}, missing={err.missing})"
    assert "furthest behind: rank(s) 1" in str(err), str(err)
    comm.free()
    world.barrier()


def check_send_to_self_is_refused(world):
    x = torch.zeros(3)
    for call, name, peer in ((xelink.send, "send", "dst"), (xelink.isend, "isend", "dst"),
                             (xelink.recv, "recv", "src"), (xelink.irecv, "irecv", "src")):
        with pytest.raises(ValueError, match=rf"{name}: {peer}={world.rank} is this rank itself"):
            call(x, world.rank)
    with pytest.raises(ValueError, match=rf"^batch_isend_irecv: dst={world.rank} is this rank itself"):
        xelink.batch_isend_irecv([xelink.P2POp(xelink.isend, x, world.rank)])
    world.barrier()


@only(sizes=(4,))
def check_timeouts_inside_sub_groups_name_the_callers_ranks(world):
    """Rank 3 skips a hierarchical all-reduce over packages [[0, 1], [2, 3]]: rank 2 waits for it inside
    its package's sub-communicator (where it is rank 1), and the error names rank 3 of the caller's group."""
    comm = world.split(0)
    comm.packages = [[0, 1], [2, 3]]
    xelink.all_reduce(torch.ones(8), group=comm, algo="hierarchical")  # makes the package sub-communicators
    if comm.rank == 2:
        with pytest.raises(xelink.TimeoutError) as info:
            xelink.all_reduce(torch.ones(8), group=comm, algo="hierarchical", timeout=0.5)
        assert info.value.missing == [3] and info.value.group is comm, (str(info.value), info.value.missing)
    comm.free()
    world.barrier()


@only(launchers=("mpi",))
def check_members_keep_the_mpi_communicators_a_peers_timed_out_call_may_still_send_into(world):
    """Rank 0 times out alone in a hierarchical all-reduce the others never enter, then every rank frees the group.
    Rank 0 may still send into the group's MPI communicators (its sub-groups' too), and a rank that took no part
    cannot know it: had it freed them, MPI would give their ids to later communicators (Open MPI then delivered the
    late message to one of the next check's and aborted). So every member keeps them until MPI_Finalize: those of
    the group and of its package and cross groups that hold rank 0; the others and a cleanly used group's are
    freed. Then 20 groups made, used and freed leave no frees waiting."""
    from mpi4py import MPI
    from xelink.transport import mpi as transport

    clean, bad = world.split(0), _two_packages(world)
    xelink.all_reduce(torch.ones(4), group=clean)
    xelink.all_reduce(torch.ones(4), group=bad, algo="hierarchical")  # makes the package sub-groups
    package, cross = bad.package_groups()
    if world.rank == 0:
        with pytest.raises(xelink.TimeoutError):
            xelink.all_reduce(torch.ones(4), group=bad, algo="hierarchical", timeout=0.3)
    # (name, whether this rank must keep its MPI communicators: rank 0 in it and a call of rank 0's timed out)
    held = {name: (c is not clean and 0 in c.world_ranks, (c.transport.ctl, c.transport.comm))
            for name, c in (("the group", bad), ("its package group", package), ("its cross group", cross),
                            ("a clean group", clean))}
    clean.free()
    bad.free()
    for _ in range(1000):  # (every rank the same number of calls: the decision is agreed)
        transport._settle_frees()
        if not any(world.allgather_object(bool(transport._FREEING))):  # (MPI progress too)
            break
    assert not transport._FREEING, f"rank {world.rank}: frees still waiting for their members: {transport._FREEING}"
    for name, (must_keep, comms) in held.items():
        abandoned = [any(c is a for a in transport._ABANDONED) for c in comms]
        freed = [c == MPI.COMM_NULL for c in comms]
        assert abandoned == [must_keep] * 2 and freed == [not must_keep] * 2, (world.rank, name, abandoned, freed)
    for i in range(20):
        comm = world.split(0)
        xelink.all_reduce(torch.ones(4), group=comm)
        comm.free()
    assert len(transport._FREEING) <= 4, f"rank {world.rank}: {len(transport._FREEING)} frees still waiting"
    world.barrier()


def check_a_timed_out_call_leaves_nothing_for_later_communicators(world):
    """Rank 0 times out alone in an exchange and in a collective, leaving messages queued at rank 1 for
    a communicator that is then freed; the communicators made next (MPI may give them the freed one's
    context) must not take those messages for theirs."""
    n = world.size
    subs = [world.split(0), world.split(0)]  # a timeout leaves a communicator unusable: one for each
    if world.rank == 0:
        with pytest.raises(xelink.TimeoutError):
            subs[0].allgather_object(("stale", 12345), timeout=0.3)
        with pytest.raises(xelink.TimeoutError):
            xelink.all_reduce(torch.full((8,), 99.0), group=subs[1], algo="two_shot", timeout=0.3)
        with pytest.raises(xelink.XelinkError, match="unusable after an earlier failure"):
            xelink.all_reduce(torch.full((8,), 99.0), group=subs[1])
    world.barrier()
    for sub in subs:
        sub.free()
    for i in range(12):
        comm = world.split(0)
        assert comm.allgather_object((i, comm.rank)) == [(i, r) for r in range(n)]
        for algo in ("two_shot", "direct", "ring"):
            x = data(comm.rank, i, 8, torch.float32)
            xelink.all_reduce(x, group=comm, algo=algo)
            assert_same(x, expected_reduce(n, i, 8, torch.float32, "sum"), f"new communicator {i} {algo}")
        comm.free()
