"""The peer-memory layer (``xelink.symm``) and point-to-point on CUDA tensors, with several ranks sharing one
GPU: whole-buffer transfers of sizes 0, 1, odd and many chunks in rings of 2 and 3 ranks, several messages
in flight, late receivers, CUDA-graph replays with new inputs, a size mismatch and a stalled peer that must
raise instead of hanging; and a ring exchange composed only of symm's public functions (put, signal, wait,
peer_tensor). Skips without a GPU (CPU CI); run on a GPU machine, log committed."""
import time

import torch

import xelink
from xelink import symm
from xelink.collectives.gpu.p2p import CHUNK_BYTES, SLOTS

WORLD_SIZES = (2, 3)
GPUS = 1
LAUNCH_TIMEOUT = 900
ENV = {"XELINK_RANKS_PER_DEVICE": "4", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

# bytes: empty, one, odd, unaligned words, one chunk and a bit, more chunks than the inbox has slots
SIZES = (0, 1, 7, 4099, CHUNK_BYTES + 3, (SLOTS + 2) * CHUNK_BYTES + 12)
DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.int64)


def _pattern(rank, case, nbytes, dtype, dev):
    """``nbytes`` (rounded down to whole elements) of a pattern unique to (rank, case), on ``dev``."""
    count = nbytes // torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(1000 * case + rank)
    vals = torch.randint(-100, 100, (count,), generator=g)
    return (vals.abs() if dtype == torch.uint8 else vals).to(dtype).to(dev)


def _poisoned(like):
    out = torch.empty_like(like)
    out.fill_(77 if not out.dtype.is_floating_point else float("nan"))
    return out


def _same(got, want, what):
    if got.dtype.is_floating_point:
        ok = torch.equal(got.float().nan_to_num(12345.0), want.float())
    else:
        ok = torch.equal(got, want)
    if not ok:
        bad = (got.float() != want.float()).nonzero()
        raise AssertionError(f"{what}: {bad.numel()} wrong of {want.numel()}, first at {bad[:3].flatten().tolist()}")


def check_ring_of_every_size_and_dtype(world):
    dev, n, r = torch.device(world.device), world.size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    case = 0
    for dtype in DTYPES:
        for nbytes in SIZES:
            case += 1
            x = _pattern(r, case, nbytes, dtype, dev)
            out = _poisoned(_pattern(prv, case, nbytes, dtype, dev))
            works = [xelink.isend(x, nxt), xelink.irecv(out, prv)]
            for w in works:
                w.wait()
            _same(out.cpu(), _pattern(prv, case, nbytes, dtype, "cpu"), f"ring {dtype} {nbytes} B")
    xelink.synchronize()


def check_many_messages_in_flight_arrive_in_order(world):
    """Six sends of different sizes posted before any receive; receives posted late (host and GPU delay)."""
    dev, n, r = torch.device(world.device), world.size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    sizes = [5, CHUNK_BYTES * 2 + 1, 64, 0, 3 * CHUNK_BYTES, 1000]
    xs = [_pattern(r, 50 + i, s, torch.uint8, dev) for i, s in enumerate(sizes)]
    sends = [xelink.isend(x, nxt) for x in xs]
    if r == 0:
        time.sleep(0.2)
    else:
        torch.cuda._sleep(int(2e8))
    outs = [_poisoned(_pattern(prv, 50 + i, s, torch.uint8, dev)) for i, s in enumerate(sizes)]
    recvs = [xelink.irecv(o, prv) for o in outs]
    for w in sends + recvs:
        w.wait()
    for i, (o, s) in enumerate(zip(outs, sizes)):
        _same(o.cpu(), _pattern(prv, 50 + i, s, torch.uint8, "cpu"), f"message {i} of {s} B")
    xelink.synchronize()


def check_receives_posted_before_the_sends_on_a_new_group(world):
    """The first transfers of a new group, each rank posting its receives before its sends (context-parallel
    attention's backward ring: a bf16 block, then float32 partial sums of other lengths), three rounds with
    the next round's receives posted while the last round's sends are in flight."""
    dev, n, r = torch.device(world.device), world.size, world.rank
    group = world.split(0)
    nxt, prv = (r + 1) % n, (r - 1) % n
    kinds = [(torch.bfloat16, 84992), (torch.float32, 169984), (torch.float32, 171008)]

    def size(rank, i, base):  # each rank's messages of another length than its neighbours'
        return base + 512 * ((rank + i) % 3)

    sends = []
    for rnd in range(3):
        cases = [(90 + 10 * rnd + i, dtype, base) for i, (dtype, base) in enumerate(kinds)]
        outs = [_poisoned(_pattern(prv, case, size(prv, i, base), dtype, dev))
                for i, (case, dtype, base) in enumerate(cases)]
        recvs = [xelink.irecv(o, prv, group=group) for o in outs]
        sends += [xelink.isend(_pattern(r, case, size(r, i, base), dtype, dev), nxt, group=group)
                  for i, (case, dtype, base) in enumerate(cases)]
        for w in recvs:
            w.wait()
        for i, ((case, dtype, base), o) in enumerate(zip(cases, outs)):
            nbytes = size(prv, i, base)
            _same(o.cpu(), _pattern(prv, case, nbytes, dtype, "cpu"), f"round {rnd}, message {case} of {nbytes} B")
    for w in sends:
        w.wait()
    xelink.synchronize()
    group.free()


def check_batch_both_directions_and_blocking_calls(world):
    """batch_isend_irecv to both neighbours at once with big messages (flow control both ways), then the
    blocking send/recv between ranks 0 and 1 with a buffer reused across calls of changing size."""
    dev, n, r = torch.device(world.device), world.size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    big = (SLOTS + 1) * CHUNK_BYTES + 8
    a, b = _pattern(r, 70, big, torch.float32, dev), _pattern(r, 71, big, torch.float32, dev)
    from_prv, from_nxt = _poisoned(a), _poisoned(b)
    ops = [xelink.P2POp(xelink.isend, a, nxt), xelink.P2POp(xelink.irecv, from_prv, prv),
           xelink.P2POp(xelink.irecv, from_nxt, nxt), xelink.P2POp(xelink.isend, b, prv)]
    for w in xelink.batch_isend_irecv(ops):
        w.wait()
    _same(from_prv.cpu(), _pattern(prv, 70, big, torch.float32, "cpu"), "batch, from the previous rank")
    _same(from_nxt.cpu(), _pattern(nxt, 71, big, torch.float32, "cpu"), "batch, from the next rank")
    if r < 2:
        buf = torch.empty(1 << 20, dtype=torch.int32, device=dev)
        for i, count in enumerate((10, 1 << 20, 3, 4097)):
            view = buf[:count]
            if r == 0:
                view.copy_(_pattern(0, 80 + i, 4 * count, torch.int32, dev))
                xelink.send(view, 1)
            else:
                view.fill_(-1)
                assert xelink.recv(view, 0) == 0
                _same(view.cpu(), _pattern(0, 80 + i, 4 * count, torch.int32, "cpu"), f"blocking call {i}")
    xelink.synchronize()


def check_graph_replays_of_a_ring_with_new_inputs(world):
    dev, n, r = torch.device(world.device), world.size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    sizes = (12, 2 * CHUNK_BYTES + 40)
    xs = [torch.zeros(s // 4, dtype=torch.float32, device=dev) for s in sizes]
    outs = [torch.zeros_like(x) for x in xs]

    def ring():
        works = []
        for x, o in zip(xs, outs):
            works += [xelink.isend(x, nxt), xelink.irecv(o, prv)]
        for w in works:
            w.wait()

    ring()  # set-up and compilation outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ring()
    for replay in range(4):
        for i, (x, s) in enumerate(zip(xs, sizes)):
            x.copy_(_pattern(r, 90 + 10 * replay + i, s, torch.float32, dev))
        if replay % 2:
            torch.cuda._sleep(int(5e7 * (r + 1)))
        graph.replay()
        for i, (o, s) in enumerate(zip(outs, sizes)):
            _same(o.cpu(), _pattern(prv, 90 + 10 * replay + i, s, torch.float32, "cpu"), f"replay {replay}, {s} B")
    xelink.synchronize()


def check_a_stalled_receiver_and_a_size_mismatch_raise(world):
    """On sub-communicators (the world goes on): rank 0 sends more than the inbox holds to rank 1, which
    never receives it (rank 0's deadline names rank 1); rank 0 sends 100 B into a 200 B receive (rank 1
    reports the mismatch instead of taking the data); rank 1 receives what nobody sends on a duplicate kept
    by a parent (synchronizing the parent raises the deadline)."""
    r = world.rank
    if world.size != 2:
        return
    dev = torch.device(world.device)
    comm = world.split(0)
    comm.timeout = 2.0
    small = torch.zeros(4, dtype=torch.uint8, device=dev)
    if r == 0:  # the pair is set up by a first transfer both ranks take part in
        xelink.send(small, 1, group=comm)
        xelink.send(torch.zeros((SLOTS + 1) * CHUNK_BYTES, dtype=torch.uint8, device=dev), 1, group=comm)
        try:
            xelink.synchronize(comm)
        except xelink.TimeoutError as e:
            assert 1 in e.missing, (e.missing, str(e))
        else:
            raise AssertionError("a send nobody received did not time out")
    else:
        xelink.recv(small, 0, group=comm)
        xelink.synchronize(comm)
    world.barrier()
    mism = world.split(0)
    x = torch.arange(100 if r == 0 else 200, dtype=torch.uint8, device=dev)
    if r == 0:
        xelink.send(x, 1, group=mism)
        xelink.synchronize(mism)
    else:
        xelink.recv(x, 0, group=mism)
        try:
            xelink.synchronize(mism)
        except xelink.XelinkError as e:
            assert "sent a message of 100 B" in str(e), str(e)
        else:
            raise AssertionError("a receive of another size than the message was not reported")
    world.barrier()
    # A receive nobody sends, on a duplicate its parent keeps as a resource (as cp_attention keeps its
    # point-to-point one): synchronizing the parent reports the deadline, naming the sender, not a size.
    parent = world.split(0)
    dup = parent.resource(("test", "dup"), lambda: parent.split(0))
    dup.timeout = 2.0
    if r == 0:
        xelink.send(small, 1, group=dup)
    else:
        xelink.recv(small, 0, group=dup)
        xelink.irecv(torch.zeros(64, dtype=torch.uint8, device=dev), 0, group=dup)
        try:
            xelink.synchronize(parent)
        except xelink.TimeoutError as e:
            assert 0 in e.missing and "0 B" not in str(e), str(e)
        else:
            raise AssertionError("a receive nobody sent, on a kept duplicate, was not reported by its parent")
    world.barrier()


def check_ring_exchange_composed_of_symm(world):
    """A composed op on the public layer only: each rank puts its block into the next rank's symmetric
    buffer, signals it, waits for its own, reads it, and tells the writer the buffer is free again; by
    the copy engine and by the SMs, eagerly and replayed in a CUDA graph with new inputs; then every
    rank reads its neighbour's buffer through peer_tensor after a device barrier."""
    dev, n, r = torch.device(world.device), world.size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    count = 3 * 4096 + 5
    inbox = symm.empty(count, dtype=torch.float32, group=world)
    src = torch.zeros(count, dtype=torch.float32, device=dev)
    got = torch.zeros_like(src)

    def exchange(engine):
        if exchange.turns:
            symm.wait(nxt, slot=1)  # the next rank has read what I put before
        symm.put(inbox, src, nxt, engine=engine)
        symm.signal(nxt, slot=0)
        symm.wait(prv, slot=0)
        got.copy_(inbox)
        symm.signal(prv, slot=1)
        exchange.turns += 1
    exchange.turns = 0

    for i, engine in enumerate(("copy", "sm", "copy", "sm")):
        src.copy_(_pattern(r, 200 + i, 4 * count, torch.float32, dev))
        exchange(engine)
        _same(got.cpu(), _pattern(prv, 200 + i, 4 * count, torch.float32, "cpu"), f"put by {engine}, round {i}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exchange("sm")
    for replay in range(3):
        src.copy_(_pattern(r, 300 + replay, 4 * count, torch.float32, dev))
        graph.replay()
        _same(got.cpu(), _pattern(prv, 300 + replay, 4 * count, torch.float32, "cpu"), f"graph replay {replay}")
    symm.wait(nxt, slot=1)  # balance the last free signal
    inbox.copy_(_pattern(r, 400, 4 * count, torch.float32, dev))
    symm.barrier(world)
    view = symm.peer_tensor(inbox, nxt)
    assert view.shape == inbox.shape and view.device == inbox.device
    _same(view.clone().cpu(), _pattern(nxt, 400, 4 * count, torch.float32, "cpu"), "peer_tensor")
    # a view of several dimensions (its span is the sum of every dimension's farthest step, not the largest)
    cube = inbox[: 2 * 3 * 2048].view(2, 3, 2048)  # (count is 3 x 4096 + 5)
    _same(symm.peer_tensor(cube, nxt).clone().cpu().reshape(-1),
          _pattern(nxt, 400, 4 * count, torch.float32, "cpu")[: 2 * 3 * 2048], "peer_tensor of a 3-D view")
    back = torch.empty_like(got)
    symm.get(back, inbox, nxt, engine="sm")
    _same(back.cpu(), _pattern(nxt, 400, 4 * count, torch.float32, "cpu"), "get by the SMs")
    symm.barrier(world)  # nobody changes its inbox while a peer still reads it
    xelink.synchronize()
