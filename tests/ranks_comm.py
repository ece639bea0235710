"""Communicator checks on every rank: identity, barrier, allgather, split, new_group, bridge, timeouts."""
import datetime
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import xelink
from ranks import only
from xelink.transport import Deadline, wait_all

WORLD_SIZES = (1, 2, 4)


def check_ranks_are_distinct(world):
    ranks = world.allgather_object((world.rank, world.size))
    assert ranks == [(r, world.size) for r in range(world.size)]
    assert world.world_ranks == list(range(world.size))


def check_launch_is_recorded(world):
    launch = world.launch
    assert launch.launcher in ("mpich", "openmpi", "torchrun", "single"), launch  # (Open MPI: the GPU image's)
    assert world.transport.name == {"mpich": "mpi", "openmpi": "mpi", "torchrun": "torch",
                                    "single": "self"}[launch.launcher]
    assert (launch.rank, launch.size) == (world.rank, world.size)
    # One host here: local placement equals global placement.
    assert (world.local_rank, world.local_size) == (world.rank, world.size)
    # The launcher's own local ranks: a permutation (Open MPI 5 numbers a host's ranks in its mapping's order:
    # world ranks 1 and 2 are local 2 and 1 on this 2-core machine).
    assert launch.local_size == world.size
    assert sorted(world.allgather_object(launch.local_rank)) == list(range(world.size))
    assert xelink.get_node_local_rank() == launch.local_rank  # (the device init bound: local_rank // rpd)
    assert world.device == torch.device("cpu")


def check_init_returns_the_same_world(world):
    assert xelink.init() is world
    assert xelink.get_world() is world


def check_barrier_and_allgather(world):
    for _ in range(20):
        world.barrier()
    # 1 MiB: large enough for MPI's rendezvous protocol; 9 MB: over torchrun's store's 8 MiB a value (the
    # exchange refused by the store, the connection reset), twice (the parts of one exchange deleted at the next)
    for size in (1 << 20, 9_000_000, 9_000_000, 10):
        big = bytes([world.rank]) * size
        got = world.allgather_object({"rank": world.rank, "blob": big})
        assert [g["rank"] for g in got] == list(range(world.size))
        assert all(g["blob"] == bytes([r]) * size for r, g in enumerate(got))


def check_split_by_parity_reversed(world):
    sub = world.split(world.rank % 2, key=-world.rank)
    members = [r for r in range(world.size) if r % 2 == world.rank % 2][::-1]
    assert sub.size == len(members)
    assert sub.rank == members.index(world.rank)
    assert sub.world_ranks == members
    assert sub.allgather_object(world.rank) == members
    sub.barrier()
    sub.free()
    with pytest.raises(xelink.XelinkError, match="barrier: the communicator was freed"):
        sub.barrier()


def check_split_leaves_out_color_none(world):
    sub = world.split(None if world.rank == 0 else 7)
    if world.rank == 0:
        assert sub is xelink.NON_GROUP_MEMBER and not sub
        with pytest.raises(ValueError, match="^all_reduce: this rank is not a member of the group"):
            xelink.all_reduce(torch.ones(2), group=sub)
    else:
        assert sub.size == world.size - 1 and sub.rank == world.rank - 1
        assert sub.allgather_object(world.rank) == list(range(1, world.size))
        sub.free()


def check_split_bad_arguments(world):
    with pytest.raises(TypeError, match=r"split: color='a' must be an int"):
        world.split("a")
    with pytest.raises(ValueError, match=r"split: color=-1 must be >= 0"):
        world.split(-1)
    with pytest.raises(TypeError, match=r"split: key=1.5 must be an int"):
        world.split(0, key=1.5)
    with pytest.raises(ValueError, match=r"split: color=4294967296 must fit a 32-bit int"):
        world.split(2 ** 32)
    with pytest.raises(ValueError, match=r"split: key=-2147483649 must fit a 32-bit int"):
        world.split(0, key=-2 ** 31 - 1)
    with pytest.raises(ValueError, match=r"all_reduce: tensor is a lazily conjugated or negated view"):
        xelink.all_reduce(torch.ones(3, dtype=torch.complex64).conj())
    world.barrier()  # nothing was sent: the communicator still works


@only(launchers=("mpi",))
def check_a_dropped_communicator_stays_until_freed_on_every_rank(world):
    """A sub-communicator with a peer window (a reference cycle) dropped without free(): the collector runs on
    rank 0 only, as rank-dependent work makes it; every rank must still hold it (finalize frees it on all
    ranks together; a weak registry let rank 0 lose it, and the others then waited for it at finalize)."""
    import gc

    from xelink import comm as C

    def use_and_drop():
        g = world.split(0)
        xelink.all_reduce(torch.ones(16), group=g, algo="direct")
        return g.name

    name = use_and_drop()
    if world.rank == 0:
        gc.collect()
    held = name in [c.name for c in C.live()]
    assert world.allgather_object(held) == [True] * world.size  # (other checks' groups differ by rank: not compared)
    C.named(name).free()


def check_new_group(world):
    ranks = [world.size - 1, 0] if world.size > 1 else [0]
    # torch's numbering: the list sorted (sort_ranks=True, the default), or in its own order (sort_ranks=False)
    for order, g in ((sorted(ranks), xelink.new_group(ranks)), (ranks, xelink.new_group(ranks, sort_ranks=False))):
        if world.rank in ranks:
            assert g.rank == order.index(world.rank) and g.size == len(ranks)
            assert g.allgather_object(world.rank) == order == xelink.get_process_group_ranks(g)
            g.free()
    if world.rank not in ranks:
        # torch's non-member sentinel; None would mean the world, so every call refuses it, before any message
        assert g is xelink.NON_GROUP_MEMBER and not g
        x = torch.ones(4)
        for call, fn in ((lambda: xelink.all_reduce(x, group=g), "all_reduce"),
                         (lambda: xelink.broadcast(x, 0, group=g), "broadcast"),
                         (lambda: xelink.barrier(group=g), "barrier"),
                         (lambda: xelink.all_gather_matmul(x[None], x[:, None], group=g), "all_gather_matmul"),
                         (lambda: xelink.new_group([0], group=g), "new_group")):
            with pytest.raises(ValueError, match=f"^{fn}: this rank is not a member of the group"):
                call()
    world.barrier()  # the refused calls sent nothing


def check_roots_and_peers_are_world_ranks_or_group_ranks(world):
    """As torch.distributed: ``src``/``dst`` (and P2POp's ``peer``) name world ranks whatever the group,
    ``group_src``/``group_dst`` (``group_peer``) ranks of the group; recv returns the sender's world rank. The
    group lists the world's ranks backwards, so the two numberings differ on every rank but the middle one."""
    n, r = world.size, world.rank
    g = xelink.new_group(list(reversed(range(n))), sort_ranks=False)
    me = g.rank
    assert xelink.get_global_rank(g, me) == r and xelink.get_group_rank(g, r) == me == n - 1 - r
    assert xelink.get_global_rank(None, r) == r == xelink.get_group_rank(None, r)
    for kw, want in ((dict(src=n - 1), n - 1), (dict(group_src=0), n - 1), (dict(src=0), 0),
                     (dict(group_src=n - 1), 0)):
        x = torch.full((3,), float(r))
        xelink.broadcast(x, group=g, **kw)
        assert torch.equal(x, torch.full((3,), float(want))), (kw, x)
    lst = [torch.empty(2) for _ in range(n)] if r == 0 else None
    xelink.gather(torch.full((2,), float(r)), lst, dst=0, group=g)
    if r == 0:  # group rank j is world rank n-1-j
        assert torch.equal(torch.stack(lst)[:, 0], torch.arange(n - 1, -1, -1, dtype=torch.float32)), lst
    objs = ["from world 0"] if r == 0 else [None]
    xelink.broadcast_object_list(objs, src=0, group=g)
    assert objs == ["from world 0"], objs
    if n > 1:
        right = (me + 1) % n  # a ring in the group's order, peers named both ways
        got, got2 = torch.empty(1), torch.empty(1)
        ops = [xelink.P2POp(xelink.isend, torch.full((1,), float(r)), group_peer=right, group=g),
               xelink.P2POp(xelink.irecv, got, g.world_ranks[(me - 1) % n], group=g)]
        for h in xelink.batch_isend_irecv(ops):
            h.wait()
        left_world = g.world_ranks[(me - 1) % n]
        assert got.item() == left_world, (got, left_world)
        # (isend, then recv: a ring of blocking sends may wait for each other, as with gloo)
        w = xelink.isend(torch.full((1,), float(r)), g.world_ranks[right], group=g)
        assert xelink.recv(got2, group=g, group_src=(me - 1) % n) == left_world and got2.item() == left_world
        w.wait()
        w = xelink.isend(torch.full((1,), float(r)), group=g, group_dst=right)
        assert xelink.recv(got2, group=g) == left_world and got2.item() == left_world  # any source
        w.wait()
    with pytest.raises(ValueError, match=r"broadcast: pass src= \(a world rank\) or group_src= \(a rank of the "
                                         r"group\), not both; got src=0, group_src=0"):
        xelink.broadcast(torch.zeros(1), src=0, group=g, group_src=0)
    with pytest.raises(ValueError, match=r"reduce: dst= \(a world rank\) or group_dst= \(a rank of the group\) is "
                                         r"required"):
        xelink.reduce(torch.zeros(1), group=g)
    with pytest.raises(ValueError, match=r"send: dst= \(a world rank\) or group_dst= \(a rank of the group\) is "
                                         r"required"):
        xelink.send(torch.zeros(1), group=g)
    with pytest.raises(ValueError, match=rf"get_global_rank: group_rank={n} is out of range for a group of size {n}"):
        xelink.get_global_rank(g, n)
    g.free()
    if n > 1:
        h = xelink.new_group([n - 1])
        if r == n - 1:
            with pytest.raises(ValueError, match=rf"get_group_rank: global_rank=0 is not a member of {h.name}"):
                xelink.get_group_rank(h, 0)
            with pytest.raises(ValueError, match=rf"broadcast: src=0 is a world rank outside {h.name} \(its world "
                                                 rf"ranks: \[{n - 1}\]\); group_src= takes a rank of the group"):
                xelink.broadcast(torch.zeros(1), src=0, group=h)
            h.free()
    world.barrier()  # the refused calls sent nothing


def check_new_group_of_every_rank(world):
    """new_group() with no ranks: every rank of the parent, in its order (torch.distributed's ranks=None)."""
    g = xelink.new_group()
    assert (g.size, g.rank, g.world_ranks) == (world.size, world.rank, list(range(world.size)))
    x = torch.ones(2)
    xelink.all_reduce(x, group=g)
    assert torch.equal(x, torch.full((2,), float(world.size)))
    g.free()


def check_new_group_bad_arguments(world):
    with pytest.raises(ValueError, match=r"new_group: ranks=\[0, 0\] has duplicates"):
        xelink.new_group([0, 0])
    with pytest.raises(ValueError, match=f"new_group: rank {world.size} is out of range for a group of size"):
        xelink.new_group([world.size])
    with pytest.raises(ValueError, match=r"new_group: ranks=\[\] is empty"):
        xelink.new_group([])
    with pytest.raises(TypeError, match=r"new_group: ranks=3 must be a sequence of ints"):
        xelink.new_group(3)
    with pytest.raises(TypeError, match=r"new_group: group='world' is not an xelink Communicator"):
        xelink.new_group([0], group="world")
    # torch.distributed's options: taken (unused: one communicator serves every device), checked for their types
    with pytest.raises(ValueError, match=r"new_group: use_local_synchronization=True is not supported: every rank"):
        xelink.new_group([0], use_local_synchronization=True)
    for kw, bad in ((dict(backend=3), r"backend=3 must be None or a str"),
                    (dict(group_desc=["x"]), r"group_desc=\['x'\] must be None or a str"),
                    (dict(device_id="cuda:0"), r"device_id='cuda:0' must be None or a torch.device"),
                    (dict(sort_ranks=None), r"sort_ranks=None must be a bool")):
        with pytest.raises(TypeError, match=f"new_group: {bad}"):
            xelink.new_group([0], **kw)
    # torch's arguments in torch's order (a timeout second: new_group(ranks, timedelta) as torch code writes it)
    g = xelink.new_group(list(range(world.size))[::-1], datetime.timedelta(seconds=30), "gloo", object(), False,
                         "all", torch.device("cpu"))
    assert g.world_ranks == list(range(world.size))
    g.free()
    if world.size > 1:
        # Callers that disagree are detected, and every rank gets the error.
        with pytest.raises(ValueError, match=r"new_group: ranks differ between callers"):
            xelink.new_group([0] if world.rank == 0 else [0, 1])
    world.barrier()


def check_subgroups_as_torch_distributed(world):
    """new_subgroups / new_subgroups_by_enumeration: one split, this rank's subgroup and NON_GROUP_MEMBER for the
    others' (torch's shape of the answer), the enumeration's order and ranks left out, the refusals."""
    n, r = world.size, world.rank
    size = 2 if n % 2 == 0 else 1
    cur, subs = xelink.new_subgroups(size, backend="nccl", group_desc="pairs")  # (torch options: unused)
    assert len(subs) == n // size and subs[r // size] is cur
    assert all(s is xelink.NON_GROUP_MEMBER for i, s in enumerate(subs) if i != r // size)
    assert xelink.get_process_group_ranks(cur) == list(range(r // size * size, r // size * size + size))
    x = torch.full((3,), float(r))
    xelink.all_reduce(x, group=cur)
    assert torch.equal(x, torch.full((3,), float(sum(range(r // size * size, r // size * size + size)))))
    whole, subs = xelink.new_subgroups()  # the ranks of one host: here all of them
    assert subs == [whole] and whole.size == world.local_size == n
    # lists in an order of their own, rank n - 2 in none where there are 3 ranks or more: [[3, 0], [1]] at 4 ranks;
    # each numbered in the world's order, as torch's (its new_group sorts the ranks)
    lists = [[n - 1, 0] if n > 1 else [0]] + ([list(range(n - 3, 0, -1))] if n > 3 else [])
    cur, subs = xelink.new_subgroups_by_enumeration(lists, None, "gloo", None, "pairs")
    mine = next((sorted(b) for b in lists if r in b), None)
    if mine is None:
        assert cur is None and all(s is xelink.NON_GROUP_MEMBER for s in subs)
    else:
        assert xelink.get_process_group_ranks(cur) == mine and cur.rank == mine.index(r)
        got = [None] * cur.size
        xelink.all_gather_object(got, r, group=cur)
        assert got == mine
    for sub in (s for s in subs if s):
        sub.free()
    with pytest.raises(ValueError, match=rf"new_subgroups: group_size={n + 1} must divide the size of"):
        xelink.new_subgroups(n + 1)
    with pytest.raises(ValueError, match=r"new_subgroups: group_size=0 must be >= 1"):
        xelink.new_subgroups(0)
    with pytest.raises(ValueError, match=r"new_subgroups_by_enumeration: rank 0 is in both subgroup \[0\] and "
                                         r"\[0\]"):
        xelink.new_subgroups_by_enumeration([[0], [0]])
    with pytest.raises(ValueError, match=r"new_subgroups_by_enumeration: subgroup=\[0, 0\] has duplicates"):
        xelink.new_subgroups_by_enumeration([[0, 0]])
    with pytest.raises(ValueError, match=r"new_subgroups_by_enumeration: ranks_per_subgroup_list=\[\] must be"):
        xelink.new_subgroups_by_enumeration([])
    if n > 1:  # callers that disagree: every rank gets the error
        with pytest.raises(ValueError, match=r"new_subgroups_by_enumeration: ranks differ between callers"):
            xelink.new_subgroups_by_enumeration([[0]] if r == 0 else [[1]])
    # split_group: ranks of the parent (here the odd-numbered ranks of the world, in reverse, when there are 3 or
    # more), each split numbered in the parent's order, None on a rank in no split
    parent = xelink.new_group(list(range(n - 1, -1, -2)), sort_ranks=False) if n > 2 else world
    if parent:
        splits = [[parent.size - 1, 0]] if parent.size > 1 else [[0]]
        sub = xelink.split_group(parent, splits, group_desc="ends", backend="nccl")
        mine = parent.rank in splits[0]
        assert (sub is None) == (not mine)
        if mine:
            want = [parent.world_ranks[i] for i in sorted(splits[0])]
            assert xelink.get_process_group_ranks(sub) == want and xelink.get_backend(sub) == "xelink"
            y = torch.tensor([float(r)])
            xelink.all_reduce(y, group=sub)
            assert y.item() == sum(want)
            sub.free()
        with pytest.raises(ValueError, match=r"split_group: split_ranks=\[\] must be a non-empty list"):
            xelink.split_group(parent, [])
        with pytest.raises(ValueError, match=rf"split_group: rank {parent.size} is out of range"):
            xelink.split_group(parent, [[parent.size]])
        if parent is not world:
            parent.free()
    else:
        with pytest.raises(ValueError, match="get_backend"):
            xelink.get_backend(parent)
    first = xelink.split_group(split_ranks=[[0]])  # the world's rank 0 alone; None elsewhere
    assert (first is None) == (r != 0) and (first is None or first.size == 1)
    if first is not None:
        first.free()
    assert xelink.get_backend() == "xelink" == xelink.Backend.XELINK
    # torch's Backend names: plain lowercase strings, equal to torch's own
    assert xelink.Backend("NCCL") == xelink.Backend.NCCL == torch.distributed.Backend.NCCL == "nccl"
    assert set(torch.distributed.Backend.backend_list) - {"fake"} <= set(xelink.Backend.backend_list)
    with pytest.raises(ValueError, match="Backend: name=3 must be a string"):
        xelink.Backend(3)
    # torch's names: group.WORLD / GroupMember, all_gather_single and reduce_scatter_single (the *_tensor calls)
    assert xelink.group.WORLD is xelink.get_world() is xelink.GroupMember.WORLD
    assert xelink.GroupMember.NON_GROUP_MEMBER is xelink.NON_GROUP_MEMBER
    y = torch.full((2,), float(r))
    xelink.all_reduce(y, group=xelink.group.WORLD)
    assert torch.equal(y, torch.full((2,), float(sum(range(n)))))
    out = torch.empty(2 * n)
    xelink.all_gather_single(out, torch.full((2,), float(r)))
    assert torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(2))
    part = torch.empty(2)
    xelink.reduce_scatter_single(part, torch.arange(2 * n, dtype=torch.float32), group=xelink.group.WORLD)
    assert torch.equal(part, n * torch.arange(2 * r, 2 * r + 2, dtype=torch.float32))
    world.barrier()


def check_torch_distributed_bridge(world):
    pg = world.process_group()
    assert world.process_group() is pg
    assert dist.get_rank(pg) == world.rank and dist.get_world_size(pg) == world.size
    x = torch.full((5,), float(world.rank + 1))
    dist.all_reduce(x, group=pg)
    assert torch.equal(x, torch.full((5,), world.size * (world.size + 1) / 2))
    sub = world.split(0, key=-world.rank)  # reversed order must carry over to the torch group
    spg = sub.process_group()
    assert (spg.rank(), spg.size()) == (sub.rank, sub.size)
    y = torch.tensor([float(world.rank)])
    dist.broadcast(y, group=spg, group_src=0)
    assert y.item() == world.size - 1
    dist.all_reduce(y, group=spg)
    assert y.item() == world.size * (world.size - 1)
    # xelink's calls take the torch groups back (as code written for torch.distributed passes them)
    z = torch.ones(3)
    xelink.all_reduce(z, group=spg)
    xelink.all_reduce(z, group=dist.group.WORLD)
    assert torch.equal(z, torch.full((3,), float(world.size * world.size)))
    assert xelink.get_rank(spg) == sub.rank and xelink.get_world_size(pg) == world.size
    with pytest.raises(TypeError, match=r"all_reduce: group=array\(\[1\.\]\) is not an xelink Communicator"):
        xelink.all_reduce(z, group=np.ones(1))
    sub.free()
    if world.size > 1:  # (freed: its group is gone; of one rank it is the world's own)
        with pytest.raises(TypeError, match="nor the torch.distributed group of one"):
            xelink.all_reduce(z, group=spg)


def check_point_to_point_ring(world):
    """The transport moves the bytes of numpy arrays and torch tensors of any dtype."""
    if world.transport.name == "self":  # a plain single process has no peer, not even itself
        with pytest.raises(ValueError, match="isend: dst=0 is this rank itself"):
            world.transport.isend(np.zeros(1), 0)
        return
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    for make in (lambda v: np.full(1000, v, dtype=np.int64),
                 lambda v: torch.full((333,), v, dtype=torch.bfloat16),
                 lambda v: np.full(1 << 18, v, dtype=np.float32)):
        send, recv = make(world.rank), make(-1)
        reqs = [world.transport.irecv(recv, left, tag=3), world.transport.isend(send, right, tag=3)]
        wait_all(reqs, Deadline(30), "ring")
        expect = make(left)
        assert (recv == expect).all() if isinstance(recv, np.ndarray) else torch.equal(recv, expect)


def check_timeout_names_the_missing_rank(world):
    with pytest.raises(ValueError, match=r"barrier: timeout=-1 must be a positive"):
        world.barrier(timeout=-1)
    sub = world.split(0)
    hung = world.size - 1
    if world.size == 1:
        sub.barrier(timeout=0.5)  # nobody to wait for: returns at once
    elif world.rank == hung:
        time.sleep(2.0)  # never calls the barrier
    else:
        start = time.monotonic()
        with pytest.raises(xelink.TimeoutError) as info:
            sub.barrier(timeout=1.0)
        assert time.monotonic() - start < 1.9
        assert info.value.missing == [hung]
        assert f"barrier: timed out after 1 s waiting for rank(s) {hung}" in str(info.value)
        with pytest.raises(xelink.XelinkError, match="unusable after an earlier failure"):
            sub.barrier()
    sub.free()
    world.barrier()


def check_a_groups_timeout_is_its_deadline_and_numpy_ints_are_ranks(world):
    """As torch's: new_group(timeout=) is the group's deadline of every wait (it applied to the split alone, the
    group's collectives took the parent's), and numpy integers name ranks and sizes (ranks taken from arrays)."""
    g = xelink.new_group(np.arange(world.size), timeout=datetime.timedelta(seconds=1))
    own, _ = xelink.new_subgroups(1, timeout=2.5)
    assert g.timeout == 1.0 and own.timeout == 2.5 and own.size == 1
    t = torch.full((3,), float(world.rank))
    xelink.broadcast(t, src=np.int64(world.size - 1))
    assert torch.equal(t, torch.full((3,), float(world.size - 1)))
    out = torch.empty(world.size)
    xelink.all_to_all_single(out, torch.full((world.size,), float(world.rank)),
                             output_split_sizes=list(np.ones(world.size, dtype=np.int64)),
                             input_split_sizes=list(np.ones(world.size, dtype=np.int32)))
    assert torch.equal(out, torch.arange(world.size, dtype=out.dtype))
    hung = world.size - 1
    if world.size > 1 and world.rank == hung:
        time.sleep(2.0)  # never calls the all-reduce
    elif world.size > 1:
        start = time.monotonic()
        with pytest.raises(xelink.TimeoutError) as info:
            xelink.all_reduce(torch.ones(2), group=g)
        assert time.monotonic() - start < 1.9 and info.value.missing == [hung]
    g.free()
    own.free()
    world.barrier()


def check_destroy_process_group_and_node_local_rank(world):
    """torch.distributed's names: destroy_process_group frees a group (the world's: finalize; the non-member
    sentinel: nothing), get_node_local_rank is the rank on this host (its fallback only before init)."""
    from xelink import comm as C

    assert xelink.get_node_local_rank() == world.launch.local_rank == xelink.get_node_local_rank(fallback_rank=7)
    sub = xelink.new_group(list(range(world.size)))
    pair = xelink.new_group([0])
    xelink.destroy_process_group(pair)  # NON_GROUP_MEMBER on ranks > 0: nothing to do
    xelink.destroy_process_group(sub)
    assert sub.name not in [c.name for c in C.live()]
    with pytest.raises(TypeError, match=r"destroy_process_group: group='world' is not an xelink Communicator"):
        xelink.destroy_process_group("world")
    xelink.destroy_process_group()  # the world: finalize, as torch's deinitializes the package
    assert not xelink.is_initialized()
    assert xelink.get_node_local_rank(fallback_rank=3) == 3
    with pytest.raises(xelink.NotInitializedError, match="get_node_local_rank: xelink.init"):
        xelink.get_node_local_rank()
    with pytest.raises(TypeError, match=r"get_node_local_rank: fallback_rank='x' must be an int"):
        xelink.get_node_local_rank(fallback_rank="x")
    xelink.init().barrier()


def check_init_process_group_as_torch_distributed(world):
    """torch.distributed.init_process_group's call joins the job as init() does: its arguments are checked
    before joining (nothing joined after a refusal), the launcher's rank and size and env:// taken, a second call
    refused; destroy_process_group() undoes it."""
    import datetime

    r, n = world.rank, world.size
    xelink.destroy_process_group()
    for kw, kind, text in ((dict(init_method="tcp://10.0.0.1:23456"), ValueError, "init_method='tcp://10.0.0.1:23456' "
                                                                                   "is not used"),
                           (dict(store=object()), ValueError, "store=<object object"),
                           (dict(rank=r + 1), ValueError, f"rank={r + 1}, but the launcher "),
                           (dict(world_size=n + 1), ValueError, f"world_size={n + 1}, but the launcher "),
                           (dict(rank="0"), TypeError, "rank='0' must be an int"),
                           (dict(backend=3), TypeError, "backend=3 must be a string"),
                           (dict(device_id="warp:0"), ValueError, "device_id='warp:0' is not a device")):
        with pytest.raises(kind) as info:
            xelink.init_process_group(**kw)
        assert f"init_process_group: {text}" in str(info.value), (str(info.value), text)
        assert not xelink.is_initialized()
    xelink.init_process_group("nccl", init_method="env://", timeout=datetime.timedelta(seconds=60), world_size=n,
                              rank=r, group_name="trainers", device_id=torch.device("cpu"))
    assert xelink.is_initialized() and xelink.is_available()
    assert (xelink.get_rank(), xelink.get_world_size()) == (r, n)
    assert xelink.get_world().timeout == 60
    with pytest.raises(ValueError, match="init_process_group: trying to initialize the default process group twice"):
        xelink.init_process_group()
    xelink.all_reduce(t := torch.ones(3))
    assert torch.equal(t, torch.full((3,), float(n)))
    xelink.destroy_process_group()
    xelink.init_process_group(backend="cpu:gloo,cuda:nccl")  # torch's defaults otherwise
    xelink.barrier()


def check_finalize_then_init_again(world):
    xelink.finalize()
    assert not xelink.is_initialized()
    with pytest.raises(xelink.NotInitializedError):
        xelink.get_world()
    again = xelink.init()
    assert again is not world and again.size == world.size and again.rank == world.rank
    again.barrier()


def check_device_mesh_as_torch_distributed(world):
    """init_device_mesh lays the world out row-major (the last dimension's ranks consecutive) with one communicator
    a dimension, as torch's DeviceMesh; sub-meshes by name; the arguments checked before any split."""
    r, n = world.rank, world.size
    shape = (2, n // 2) if n % 2 == 0 else (1, n)
    mesh = xelink.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    assert torch.equal(mesh.mesh, torch.arange(n).view(*shape)) and mesh.shape == shape and mesh.ndim == 2
    dp, tp = r // shape[1], r % shape[1]
    assert mesh.get_coordinate() == [dp, tp] and mesh.get_rank() == r and mesh.size() == n
    assert (mesh.get_local_rank("dp"), mesh.get_local_rank(1), mesh.size("tp")) == (dp, tp, shape[1])
    assert mesh.get_group("tp").world_ranks == [dp * shape[1] + j for j in range(shape[1])]
    assert mesh.get_group(0).world_ranks == [i * shape[1] + tp for i in range(shape[0])]
    assert mesh.get_group(-1) is mesh.get_group("tp") and mesh.get_all_groups() == [mesh.get_group(0),
                                                                                    mesh.get_group(1)]
    x = torch.full((3,), float(r))
    xelink.all_reduce(x, group=mesh.get_group("tp"))  # the TP row's sum
    assert torch.equal(x, torch.full((3,), float(sum(mesh.get_group("tp").world_ranks))))
    row = mesh["tp"]
    assert row.ndim == 1 and row.mesh.tolist() == mesh.get_group("tp").world_ranks and row.get_group() is \
        mesh.get_group("tp") and row.get_local_rank() == tp
    assert mesh["dp", "tp"].mesh.tolist() == mesh.mesh.tolist()
    flat = xelink.init_device_mesh("cpu", n)  # one dimension, unnamed: the world's ranks in order
    assert flat.get_group().world_ranks == list(range(n)) and flat.mesh_dim_names is None
    for args, kw, kind, text in (
            (("cuda", (n,)), {}, ValueError, "device_type='cuda', but the ranks drive cpu devices"),
            (("cpu", (n, 2)), {}, ValueError, f"mesh_shape=({n}, 2) holds {2 * n} ranks, the world has {n}"),
            (("cpu", (0, n)), {}, ValueError, "mesh_shape=(0, "),
            (("cpu", shape), dict(mesh_dim_names=("a", "a")), ValueError, "mesh_dim_names=('a', 'a') must be 2 "
                                                                          "distinct names")):
        with pytest.raises(kind) as info:
            xelink.init_device_mesh(*args, **kw)
        assert f"init_device_mesh: {text}" in str(info.value), (str(info.value), text)
    with pytest.raises(ValueError, match=r"DeviceMesh.get_group: this mesh has 2 dimensions \('dp', 'tp'\)"):
        mesh.get_group()
    with pytest.raises(KeyError, match="must name distinct dimensions"):
        mesh["tp", "dp"]
    for m in (mesh, flat):
        for g in m.get_all_groups():
            g.free()
    world.barrier()  # the refused calls split nothing: the ranks are still in step
