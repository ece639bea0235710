"""All-to-all on CPU ranks: destination-split (every rank sends each block straight to its destination)."""
from __future__ import annotations

from .base import chunks, step, tag_for

__all__ = ["dest_split"]


def dest_split(comm, fo, fi, io, oo, deadline):
    """``fi[io[p]:io[p+1]]`` goes to rank p, whose block from this rank lands in ``fo[oo[r]:oo[r+1]]``."""
    n, r = comm.size, comm.rank
    ins, outs = chunks(fi, io), chunks(fo, oo)
    outs[r].copy_(ins[r])
    if n > 1:
        step(comm, [(p, ins[p]) for p in range(n) if p != r], [(p, outs[p]) for p in range(n) if p != r],
             tag_for(comm), deadline, "all_to_all_single", empty=True)
