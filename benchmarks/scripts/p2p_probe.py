"""Diagnosis (thirteenth session): cp_attention's ring backward on CUDA stalled (reported as "sent a message of 0 B
to a receive of another size" before 32e727c). Cases, each on a new group of 2 ranks: (A) the backward's message
pattern with isend/irecv; (S) the same with a device synchronize after each send; (W) S after a first transfer
both ways that both ranks finished; (G) one program a transfer; (B) on another thread; (C) cp_attention's ring
forward and backward. A case that stalls takes a deadline (XELINK_TIMEOUT) longer. S and W cannot pass: the
device-wide synchronize after a send waits for this rank's posted receives, whose message the peer sends only after
its own synchronize (a deadlock of the caller's making, as with NCCL); A0 meets CUDA's lazy module loading (the p2p
module's docstring). Measured at ce7385f: benchmarks/results/h100-training.

    XELINK_RANKS_PER_DEVICE=2 mpirun -n 2 python3 benchmarks/scripts/p2p_probe.py
"""
import os
import threading
import time
import traceback

import torch

import xelink


def pattern(comm, tag, sync=False):
    n, r = comm.size, comm.rank
    dev = torch.device(comm.device)
    left = right = 1 - r
    lengths = [167, 166]
    kv = torch.full((2, 1, 2, lengths[r], 64), float(r + 1), dtype=torch.bfloat16, device=dev)
    owners = [r, 1 - r]
    sends, got = [], []
    cur = kv
    for s, owner in enumerate(owners):
        if s < n - 1:
            nxt = kv.new_empty((2, 1, 2, lengths[owners[s + 1]], 64))
            part = torch.empty((2, 1, 2, lengths[owners[s + 1]], 64), dtype=torch.float32, device=dev)
            recvs = [xelink.irecv(nxt, left, group=comm, tag=owners[s + 1]),
                     xelink.irecv(part, left, group=comm, tag=n + owners[s + 1])]
            sends.append(xelink.isend(cur, right, group=comm, tag=owner))
            _sync(sync)
        mine = torch.full((2, 1, 2, lengths[owner], 64), 10.0 * (r + 1), dtype=torch.float32, device=dev)
        sends.append(xelink.isend(mine, right, group=comm, tag=n + owner))
        _sync(sync)  # a send of less than a chunk completes without the receiver
        if s < n - 1:
            recvs[0].wait()
            recvs[1].wait()
            got.append((nxt, part))
            cur = nxt
    total = torch.empty((2, 1, 2, lengths[r], 64), dtype=torch.float32, device=dev)
    xelink.irecv(total, left, group=comm, tag=n + r).wait()
    for h in sends:
        h.wait()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    other = 2 - r
    parts = [("kv", got[0][0].float(), other), ("partial", got[0][1], 10.0 * other), ("total", total, 10.0 * other)]
    bad = [f"{name} has {x.unique()[:6].tolist()} (want {want}; {int((x != want).sum())} of {x.numel()} differ)"
           for name, x, want in parts if not bool((x == want).all())]
    return f"{tag}: {'ok' if not bad else 'WRONG ' + '; '.join(bad)}"


def _sync(on):
    if on and torch.cuda.is_available():
        torch.cuda.synchronize()


def run(name, fn, comm, *args):
    """One case on its group: its result, its seconds (a stall shows as a deadline's worth) and, on CUDA, what
    ``xelink.synchronize`` raises for the group afterwards."""
    start = time.monotonic()
    try:
        out = fn(comm, *args)
        if torch.device(comm.device).type == "cuda":
            xelink.synchronize(comm)
    except Exception as e:  # noqa: BLE001 - a probe reports and the next one runs
        out = f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
    print(f"rank {xelink.get_rank()} [{time.monotonic() - start:.1f} s] {out}", flush=True)


def warmed(comm, tag):
    """The pattern with sends synchronized, after a first transfer both ways that both ranks finished (host
    barrier): whether the first transfers' set-up is what stalls case S."""
    dev = torch.device(comm.device)
    one = torch.zeros(1, device=dev)
    works = [xelink.isend(one, 1 - comm.rank, group=comm), xelink.irecv(one.clone(), 1 - comm.rank, group=comm)]
    for w in works:
        w.wait()
    if dev.type == "cuda":
        xelink.synchronize(comm)
    comm.barrier()
    return pattern(comm, tag, True)


def in_thread(comm, tag):
    box = []
    t = threading.Thread(target=lambda: box.append(pattern(comm, tag)))
    try:
        t.start()
    finally:
        t.join()
    if not box:
        raise RuntimeError("the thread raised (see its traceback above)")
    return box[0]


def cp(comm):
    S = 333
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, S, 64, generator=g).to(torch.bfloat16) for h in (8, 2, 2))
    dev = torch.device(comm.device)
    mine = [xelink.cp_shard(t, group=comm).to(dev).requires_grad_() for t in (q, k, v)]
    out = xelink.cp_attention(*mine, causal=True, group=comm, algo="ring")
    out.float().sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return f"cp ring fwd+bwd: ok, |dq| {mine[0].grad.float().norm():.3f}"


def main():
    xelink.init()
    world = xelink.get_world()
    junk = [torch.empty(int(3e6), device=world.device) for _ in range(5)]  # allocations before the pairs
    for i in range(3):
        run(f"A{i} main thread", pattern, world.split(0), f"A{i} main thread")
    for i in range(3):
        run(f"S{i} synchronized sends", pattern, world.split(0), f"S{i} synchronized sends", True)
        run(f"W{i} set up first", warmed, world.split(0), f"W{i} set up first")
    os.environ["XELINK_P2P_BLOCKS"] = "1"
    run("G one block", pattern, world.split(0), "G one block")
    del os.environ["XELINK_P2P_BLOCKS"]
    run("B other thread", in_thread, world.split(0), "B other thread")
    run("C cp_attention", cp, world.split(0))
    del junk
    xelink.finalize()


if __name__ == "__main__":
    main()
