"""Peer memory checks on every rank: shared segments read exactly, growth, typed views, counters, timeouts."""
import time

import numpy as np
import pytest
import torch

import xelink
from xelink.transport import shm
from xelink.transport.shm import PeerCounters, PeerWindow

WORLD_SIZES = (1, 2, 4)


def pattern(rank: int, n: int) -> np.ndarray:
    """Bytes that differ between ranks and along the buffer (a prime period, so no shift matches)."""
    return ((np.arange(n, dtype=np.int64) * 7 + rank * 31 + 1) % 251).astype(np.uint8)


def check_placement(world):
    pw = PeerWindow(world, 64)
    assert pw.node_ranks == list(range(world.size))  # one host: node order is comm order
    assert (pw.node_rank, pw.node_size) == (world.rank, world.size)
    assert pw.spans_comm and pw.node_index(world.size - 1) == world.size - 1
    with pytest.raises(ValueError, match=f"PeerWindow.node_index: comm rank {world.size} is not on this host"):
        pw.node_index(world.size)
    pw.free()
    pw.free()  # idempotent


def check_segments_read_exactly(world):
    for n in (0, 1, 1001, 1 << 20):
        pw = PeerWindow(world, n)
        assert pw.nbytes == n and pw.capacity == -(-n // 64) * 64
        me = pw.local()
        assert me.dtype == np.uint8 and me.shape == (n,)
        me[:] = pattern(world.rank, n)
        pw.barrier()
        for i in range(pw.node_size):
            seg = pw.peer(i)
            assert seg.shape == (n,)
            if n:
                assert seg.ctypes.data % 64 == 0
            assert np.array_equal(seg, pattern(pw.node_ranks[i], n)), (n, i)
        pw.barrier()  # nobody frees (or overwrites) while a peer still reads
        pw.free()


def check_direct_writes_into_peers(world):
    """Every rank writes its pattern into its right neighbour's segment; each reads its own."""
    n = 4099
    pw = PeerWindow(world, n)
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    pw.peer(right)[:] = pattern(world.rank, n)
    pw.barrier()
    assert np.array_equal(pw.local(), pattern(left, n))
    pw.free()


def check_sizes_differ_between_ranks(world):
    pw = PeerWindow(world, 10 + world.rank)
    assert pw.nbytes == 10 + world.size - 1  # the largest asked for, the same on every rank
    pw.free()


def check_bad_arguments(world):
    with pytest.raises(ValueError, match=r"PeerWindow: nbytes=-1 must be >= 0"):
        PeerWindow(world, -1)
    with pytest.raises(TypeError, match=r"PeerWindow: nbytes=1.5 must be an int"):
        PeerWindow(world, 1.5)
    with pytest.raises(TypeError, match=r"PeerWindow: comm='world' is not an xelink Communicator"):
        PeerWindow("world", 8)
    pw = PeerWindow(world, 256)
    with pytest.raises(ValueError, match=rf"PeerWindow.peer: i={world.size} is not a node rank \(0..{world.size - 1}\)"):
        pw.peer(world.size)
    with pytest.raises(TypeError, match=r"PeerWindow.peer: i='0' must be an int"):
        pw.peer("0")
    with pytest.raises(ValueError, match=r"PeerWindow.view: offset=2 is not a multiple of the item size 4"):
        pw.view(0, np.float32, 1, offset=2)
    with pytest.raises(ValueError, match=r"PeerWindow.view: offset=8 \+ count=63 \* itemsize=4 = 260 bytes "
                                         r"exceeds the segment's nbytes=256"):
        pw.view(0, np.float32, 63, offset=8)
    with pytest.raises(TypeError, match=r"PeerWindow.view: dtype=torch.bfloat16 is not a numpy dtype"):
        pw.view(0, torch.bfloat16, 1)
    with pytest.raises(TypeError, match=r"PeerWindow.torch_view: dtype=<class 'numpy.float32'> is not a torch.dtype"):
        pw.torch_view(0, np.float32, 1)
    with pytest.raises(ValueError, match=r"PeerWindow.torch_view: count=-1 must be >= 0"):
        pw.torch_view(0, torch.float32, -1)
    with pytest.raises(ValueError, match=r"PeerCounters.wait_for: rank -1 is not a node rank"):
        pw.counters.wait_for([-1])
    with pytest.raises(ValueError, match=r"PeerCounters.post: value=-1 < the last value posted \(0\)"):
        pw.counters.post(-1)
    with pytest.raises(ValueError, match=r"PeerWindow.barrier: timeout=0 must be a positive"):
        pw.barrier(deadline=0)
    pw.barrier()  # nothing above communicated: the window still works
    pw.free()
    with pytest.raises(xelink.XelinkError, match=r"PeerWindow.peer: the window was freed"):
        pw.peer(0)
    with pytest.raises(xelink.XelinkError, match=r"PeerCounters.barrier: the counters were freed"):
        pw.counters.barrier()


def check_ensure_growth(world):
    pw = PeerWindow(world, 10)
    assert (pw.nbytes, pw.capacity, pw.generation) == (10, 64, 0)
    assert pw.ensure(5) is False and pw.nbytes == 10
    assert pw.ensure(64) is False and (pw.nbytes, pw.capacity) == (64, 64)  # fits: no communication
    epoch = pw.counters.epoch
    steps = ((65, True, 128, 65), (1000, True, 1024, 1000), (1 << 20, True, 1 << 20, 1 << 20),
             (5, False, 1 << 20, 1 << 20))
    for need, grows, cap, nbytes in steps:
        assert pw.ensure(need) is grows
        assert (pw.capacity, pw.nbytes) == (cap, nbytes)
        n = pw.nbytes
        pw.local()[:] = pattern(world.rank, n)
        pw.barrier()
        for i in range(pw.node_size):
            assert np.array_equal(pw.peer(i), pattern(i, n)), (need, i)
        pw.barrier()
    assert pw.generation == 3
    assert pw.counters.epoch == epoch + 8  # growth did not disturb the barrier epochs
    with pytest.raises(ValueError, match=r"PeerWindow.ensure: nbytes=-3 must be >= 0"):
        pw.ensure(-3)
    pw.free()


def check_a_window_without_room_is_refused_alike(world):
    """A window larger than the shared-memory filesystem's free space would kill the ranks with SIGBUS when
    touched: it is refused on every rank alike (node rank 0's reading decides, here the only small one), a
    growth that does not fit leaves the window as it was, and the one-shot all-reduce then goes by messages."""
    real = shm.shm_free_bytes
    shm.shm_free_bytes = (lambda: 1 << 20) if world.rank == 0 else (lambda: 1 << 40)
    try:
        need = world.size * (((1 << 20) + 64 + 4095) // 4096 * 4096)
        with pytest.raises(shm.PeerMemoryUnavailable, match=rf"PeerWindow: a shared window of {1 << 20} B for each "
                           rf"of the {world.size} rank\(s\) on this host needs {need} B of /dev/shm, which has "
                           rf"{1 << 20} B free .*SIGBUS"):
            PeerWindow(world, 1 << 20)
        pw = PeerWindow(world, 1000)  # what fits is still made (nothing left over from the refusal)
        with pytest.raises(shm.PeerMemoryUnavailable, match=r"PeerWindow.ensure: a shared window of"):
            pw.ensure(2 << 20)
        assert (pw.capacity, pw.generation) == (1024, 0)
        pw.local()[:] = pattern(world.rank, 1000)  # the old window still works
        pw.barrier()
        assert all(np.array_equal(pw.peer(i), pattern(i, 1000)) for i in range(pw.node_size))
        pw.barrier()
        assert pw.ensure(1 << 16) and pw.capacity == 1 << 16  # growth that fits
        pw.free()
        # growth takes exactly what is asked where doubling has no room (beside the old window)
        shm.shm_free_bytes = lambda: 1 << 40
        pw = PeerWindow(world, 400_000)
        shm.shm_free_bytes = lambda: world.size * 500_000  # 440 KB a rank fits, 800 KB does not
        assert pw.ensure(440_000) and pw.capacity == 440_000
        pw.free()
        if world.size > 1:
            # the direct all-reduce at sizes with and without room, back to back: right sums every time
            for n in (1 << 18, 1 << 10, 1 << 18, 1 << 12):  # floats: 1 MiB has no room, 4 KiB does
                x = torch.arange(n, dtype=torch.float32) + world.rank
                xelink.all_reduce(x, algo="direct")
                want = torch.arange(n, dtype=torch.float32) * world.size + sum(range(world.size))
                assert torch.equal(x, want), n
    finally:
        shm.shm_free_bytes = real


def check_typed_views(world):
    pw = PeerWindow(world, 8192)
    me = pw.node_rank
    f32 = pw.view(me, np.float32, 100, offset=64)
    f32[:] = np.arange(100, dtype=np.float32) + 1000 * world.rank
    i64 = pw.view(me, "int64", 50, offset=512)
    i64[:] = -np.arange(50) - world.rank
    bf = pw.torch_view(me, torch.bfloat16, 300, offset=1024)
    bf.copy_(torch.arange(300, dtype=torch.float32) % 128 + world.rank)  # small ints: exact in bf16
    # Zero-copy: the tensor aliases the segment, so the raw bits appear in the uint16 numpy view.
    assert bf.data_ptr() == pw.local().ctypes.data + 1024
    assert np.array_equal(pw.view(me, np.uint16, 300, offset=1024), bf.view(torch.int16).numpy().view(np.uint16))
    assert pw.torch_view(me, torch.float32, 0).numel() == 0 and pw.view(me, np.float32, 0).size == 0
    pw.barrier()
    for i in range(pw.node_size):
        assert np.array_equal(pw.view(i, np.float32, 100, offset=64), np.arange(100, dtype=np.float32) + 1000 * i)
        assert np.array_equal(pw.view(i, np.int64, 50, offset=512), -np.arange(50) - i)
        got = pw.torch_view(i, torch.bfloat16, 300, offset=1024)
        assert got.dtype == torch.bfloat16 and torch.equal(got.float(), torch.arange(300.0) % 128 + i)
        assert torch.equal(pw.torch_view(i, torch.float32, 100, offset=64), torch.from_numpy(pw.view(i, np.float32, 100, offset=64)))
    pw.barrier()
    pw.free()


def check_many_barriers_in_a_row(world):
    """Double-buffered rounds, one barrier each: a lost wakeup or a barrier that lets a rank through
    early shows up as a wrong value (or a hang, cut short by the deadline)."""
    pw = PeerWindow(world, 16)
    rounds = 1000
    for k in range(1, rounds + 1):
        slots = pw.view(pw.node_rank, np.int64, 2)
        slots[k % 2] = k * (world.rank + 1)
        pw.barrier(deadline=30)
        for i in range(pw.node_size):
            got = pw.view(i, np.int64, 2)[k % 2]
            assert got == k * (i + 1), (k, i, got)
    assert pw.counters.epoch == rounds
    for i in range(pw.node_size):
        assert pw.counters.peek(i)[0] >= rounds - 1
    pw.free()


def check_wait_for_neighbours_only(world):
    """Each round waits for the two neighbours only; double buffering keeps reads ahead of overwrites."""
    pw = PeerWindow(world, 16)
    c = pw.counters
    left, right = (pw.node_rank - 1) % pw.node_size, (pw.node_rank + 1) % pw.node_size
    for k in range(1, 501):
        pw.view(pw.node_rank, np.int64, 2)[k % 2] = 10 * k + world.rank
        c.arrive()
        c.wait_for({left, right}, deadline=30)
        assert pw.view(left, np.int64, 2)[k % 2] == 10 * k + pw.node_ranks[left]
    c.barrier()
    pw.free()


def check_post_and_wait_value(world):
    """Chunk j of my segment is announced by post(j + 1); the right neighbour reads each as it comes."""
    chunks, size = 64, 256
    pw = PeerWindow(world, chunks * size)
    c = pw.counters
    left, right = (pw.node_rank - 1) % pw.node_size, (pw.node_rank + 1) % pw.node_size
    base = c.posted
    for j in range(chunks):
        pw.local()[j * size:(j + 1) * size] = (j + world.rank) % 256
        c.post(base + j + 1)
        c.wait_value(left, base + j + 1, deadline=30)
        assert (pw.peer(left)[j * size:(j + 1) * size] == (j + pw.node_ranks[left]) % 256).all()
    assert c.peek(right)[1] >= base + 1
    c.barrier()
    pw.free()


def check_counters_alone(world):
    pc = PeerCounters(world)
    assert pc.node_ranks == list(range(world.size))
    for _ in range(100):
        pc.barrier()
    assert pc.epoch == 100
    pc.free()
    pc.free()


def check_split_communicator(world):
    """A reversed sub-communicator: node order follows its ranks, errors and data use its numbering."""
    sub = world.split(world.rank % 2, key=-world.rank)
    pw = PeerWindow(sub, 333)
    assert pw.node_ranks == list(range(sub.size)) and pw.node_rank == sub.rank
    pw.local()[:] = pattern(world.rank, 333)
    pw.barrier()
    for i in range(pw.node_size):
        assert np.array_equal(pw.peer(i), pattern(sub.world_ranks[i], 333))
    pw.barrier()
    pw.free()
    sub.free()


def check_free_all(world):
    sub = world.split(0)
    a, b, c = PeerWindow(sub, 8), PeerCounters(sub), PeerWindow(sub, 0)
    c.free()
    assert shm.free_all(sub) == 2
    assert a.freed and b.freed and c.freed
    assert shm.free_all(sub) == 0
    d = PeerWindow(sub, 8)
    del d  # dropped without free(): the registry holds it weakly and does not keep it alive
    assert shm.free_all(sub) == 0
    # free_all() of every communicator, in name order, the same on every rank: overlapping
    # communicators whose windows are freed in different orders on different ranks would deadlock.
    shm.free_all()  # what earlier checks of this launch left on communicators they never freed (held until freed)
    more = [world.split(0) for _ in range(3)] + [world.split(world.rank % 2)]
    objs = [PeerWindow(c, 8) for c in more] + [PeerWindow(sub, 8), PeerCounters(world), PeerWindow(world, 8)]
    assert shm.free_all() == len(objs) and all(o.freed for o in objs)
    for c in more:
        c.free()
    sub.free()


def check_timeout_names_the_missing_rank(world):
    sub = world.split(0)
    pw = PeerWindow(sub, 64)
    hung = world.size - 1
    if world.size == 1:
        pw.barrier(deadline=0.5)  # nobody to wait for
    elif world.rank == hung:
        time.sleep(1.5)  # never posts
    else:
        start = time.monotonic()
        with pytest.raises(xelink.TimeoutError) as info:
            pw.counters.wait_value(pw.node_index(hung), 1, deadline=0.5)
        assert info.value.missing == [hung]
        assert f"PeerCounters.wait_value: timed out after 0.5 s waiting for rank(s) {hung}" in str(info.value)
        with pytest.raises(xelink.XelinkError, match="unusable after an earlier timeout"):
            pw.barrier()
        assert time.monotonic() - start < 1.4
    pw.free()  # the rendezvous of free is apart from the barrier epochs: it works after a timeout

    pc = PeerCounters(sub)
    if world.size > 1 and world.rank == hung:
        time.sleep(1.5)  # never arrives
    elif world.size > 1:
        start = time.monotonic()
        with pytest.raises(xelink.TimeoutError) as info:
            pc.barrier(deadline=0.5, what="allreduce phase 2")
        assert time.monotonic() - start < 1.4
        assert info.value.missing == [hung]
        assert f"allreduce phase 2: timed out after 0.5 s waiting for rank(s) {hung}" in str(info.value)
    pc.free()
    sub.free()
    world.barrier()
