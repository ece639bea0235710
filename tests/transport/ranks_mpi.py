"""The MPI transport's point-to-point buffers on every rank: torch tensors go to MPI by their address, so a view
moves its own bytes (not its storage's first ones) and a buffer that only the request holds stays alive until the
transfer has completed; numpy arrays and half types move as before."""
import gc

import numpy as np
import torch
from ranks import only

from xelink.transport import Deadline, wait_all


def _ring(world):
    return (world.rank + 1) % world.size, (world.rank - 1) % world.size


@only(sizes=(2, 4))
def check_views_at_an_offset_move_their_own_bytes(world):
    t = world.transport
    right, left = _ring(world)
    base = torch.arange(100, dtype=torch.float64) + 1000 * world.rank
    got = torch.full((80,), -1.0, dtype=torch.float64)
    reqs = [t.irecv(got[20:70], left, tag=11), t.isend(base[10:60], right, tag=11)]
    wait_all(reqs, Deadline(30), "views")
    assert torch.equal(got[20:70], torch.arange(10, 60, dtype=torch.float64) + 1000 * left)
    assert (got[:20] == -1).all() and (got[70:] == -1).all()  # nothing written outside the view
    half = torch.zeros(7, dtype=torch.bfloat16)
    arr = np.zeros(5, dtype=np.int16)
    reqs = [t.irecv(half, left, tag=12), t.irecv(arr, left, tag=13),
            t.isend(torch.full((7,), world.rank, dtype=torch.bfloat16), right, tag=12),
            t.isend(np.full(5, world.rank, dtype=np.int16), right, tag=13)]
    wait_all(reqs, Deadline(30), "types")
    assert (half == left).all() and (arr == left).all()


@only(sizes=(2, 4))
def check_a_send_buffer_only_the_request_holds_stays_alive(world):
    t = world.transport
    right, left = _ring(world)
    n = 1 << 20  # 4 MiB: past the eager limit, so MPI reads the sender's memory only once the receive is posted
    sends = [t.isend(torch.full((n,), float(world.rank)), right, tag=14)]
    gc.collect()
    junk = [torch.full((n,), -5.0) for _ in range(4)]  # would take the freed buffer's memory
    world.barrier()  # every send is posted before any receive
    got = torch.empty(n)
    wait_all([t.irecv(got, left, tag=14)] + sends, Deadline(60), "alive")
    assert (got == left).all()
    del junk
