"""Point-to-point on CUDA tensors: pushes through a ``symm.Pair`` between ranks of one host (NCCL through
torch.distributed where peer memory is missing), stream-ordered like NCCL.

Protocol (kernels ``p2p_send``/``p2p_recv`` in ``kernels.py``): the sender pushes the message in chunks
of ``CHUNK_BYTES`` into the receiver's inbox of ``SLOTS`` slots and signals each chunk; the receiver copies
it out and signals the slot free. So a send completes without the receiver while a slot is free (messages
up to ``SLOTS`` chunks, whatever the receiver is doing) and larger ones flow as the receiver drains them.

Streams: a transfer runs on a side stream of its pair and direction, forked from the caller's current
stream; the handle's ``wait()`` joins it back (torch.distributed's NCCL works do the same). Messages between
two ranks in one direction match in the order posted; tags are checked but, as with NCCL, not matched.
A send and a receive between the same two ranks run on different streams, so a rank may post both before
waiting on either. CUDA-graph capturable (the counters live on the device); set-up happens on the first
transfer of a pair, outside capture.

A receive spins on the GPU until its message lands. Under CUDA's lazy module loading (the default) a kernel's
first launch waits for every running kernel of the process, so a rank that launches a new kernel while its
receive waits for a peer doing the same stalls both until the deadline (as with NCCL's kernels): post a
receive whose message the peer sends after its own kernels once this rank's kernels are launched (as
``xelink.dist``'s ring backward does), or run with ``CUDA_MODULE_LOADING=EAGER``.
"""
from __future__ import annotations

import torch

from ... import symm
from ...errors import XelinkError
from .launch import kernel_module

__all__ = ["start", "CHUNK_BYTES", "SLOTS"]

CHUNK_BYTES = 1 << 20
SLOTS = 4
TILE_BYTES = 16 << 10  # bytes a block moves per step; the same on both sides, whatever the word
_INBOX = SLOTS * CHUNK_BYTES + SLOTS * symm.MAX_BLOCKS * 8  # data slots, then the per-block headers


def _peer_memory(comm) -> bool:
    return symm.available(comm) and kernel_module().available()


def _nccl(comm, x, peer, send):
    import torch.distributed as dist

    pg = comm.process_group()
    return dist.isend(x, group=pg, group_dst=peer) if send else dist.irecv(x, group=pg, group_src=peer)


def start(comm, x: torch.Tensor, peer: int, send: bool, timeout=None):
    """Enqueue a send of ``x`` to ``peer`` (or a receive into ``x`` from it); returns the handle."""
    fn = "isend" if send else "irecv"
    nbytes = x.numel() * x.element_size()
    if nbytes == 0:
        return symm.Work(None, fn)
    if not _peer_memory(comm):
        return _nccl(comm, x, peer, send)
    pair = symm.pair_of(comm, peer, _INBOX, timeout=timeout)
    if not pair.kernels:
        _preload(pair)
    pair.check(fn)
    side = pair.streams.get(send)
    if side is None:
        side = pair.streams[send] = torch.cuda.Stream(pair.device)
    key = (send, x.data_ptr(), nbytes, timeout)
    bound = pair.plans.get(key)
    if bound is None:
        if len(pair.plans) > 4096:
            pair.plans.clear()
        bound = pair.plans[key] = _build(pair, x, nbytes, send, timeout)
    side.wait_stream(torch.cuda.current_stream(pair.device))
    bound(side.cuda_stream)
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing:
        x.record_stream(side)  # the caller may drop x before the transfer ran
    return symm.Work(pair.check, fn, side, keep=(x,) if capturing else ())  # in a capture: held until wait()


def _kernel(pair, send, word):
    w = word.itemsize
    return pair.kernel(kernel_module().KERNELS["p2p_send" if send else "p2p_recv"], ("p2p", send, word),
                       {"X": word, "Y": word, "INBOX": word, "READY": torch.int32, "FREE": torch.int32,
                        "SENT": torch.int32, "GOT": torch.int32, "HEADER": torch.int64},
                       num_warps=4, CHUNK=CHUNK_BYTES // w, SLOTS=SLOTS, TILE=TILE_BYTES // w)


def _arguments(pair, send, addr, nbytes, w, t_ns) -> dict:
    """The kernel's arguments: READY lives at the receiver and FREE at the sender (the first and second
    half of a pair's flags); SENT and GOT are the two halves of each side's own counts."""
    flags, counts, second = pair.flags.data_ptr(), pair.counts.data_ptr(), 4 * symm.MAX_BLOCKS
    if send:
        return dict(X=addr, INBOX=pair.peer_inbox, READY=pair.peer_flags, FREE=flags + second, SENT=counts,
                    HEADER=pair.peer_inbox + SLOTS * CHUNK_BYTES, n=nbytes // w, nbytes=nbytes, timeout_ns=t_ns)
    return dict(Y=addr, INBOX=pair.inbox.data_ptr(), READY=flags, FREE=pair.peer_flags + second, GOT=counts + second,
                HEADER=pair.inbox.data_ptr() + SLOTS * CHUNK_BYTES, n=nbytes // w, nbytes=nbytes, timeout_ns=t_ns)


def _build(pair, x, nbytes, send, timeout):
    word = symm.word_dtype(nbytes, x.data_ptr())
    t_ns = symm.timeout_ns(pair.comm, timeout)
    return _kernel(pair, send, word).bind(**_arguments(pair, send, x.data_ptr(), nbytes, word.itemsize, t_ns))


def _preload(pair) -> None:
    """Compile and load every variant of both kernels (word x 16-byte alignment of the local buffer)
    before the pair's first transfer: a send spinning on a receive of this process on another stream
    would otherwise meet the receive's first load (``symm.Kernel.preload``). Triton caches the compiled
    kernels, so only a process's first pair pays (a few seconds, less from Triton's disk cache). The stand-in
    sizes and deadline key the real launches too (the kernels take them as typed, unspecialized arguments), so
    even a pair's first transfer goes straight to the loaded kernel."""
    base = pair.inbox.data_ptr()  # any 16-byte aligned address: nothing is launched
    for send in (True, False):
        for word, w in symm.WORDS:
            for addr in (base, base + w if w < 16 else None):
                if addr is not None:
                    _kernel(pair, send, word).preload(**_arguments(pair, send, addr, 1 << 40, w, 1 << 40))


def check_tensor(fn: str, x: torch.Tensor, comm) -> None:
    """A CUDA tensor a transfer can move: on this rank's device, contiguous (any dtype)."""
    dev = torch.device(comm.device)
    if dev.type != "cuda":
        raise ValueError(f"{fn}: tensor is on {x.device} but {comm.name} drives {comm.device}")
    if dev.index is not None and x.device != dev:
        raise ValueError(f"{fn}: tensor is on {x.device} but this rank of {comm.name} drives {comm.device}")
    if not x.is_contiguous():
        raise ValueError(f"{fn}: tensor must be contiguous (call .contiguous() first)")


def unsupported(comm) -> XelinkError | None:
    """Why point-to-point on CUDA tensors cannot run on ``comm`` at all (no peer memory and no NCCL)."""
    if _peer_memory(comm):
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return XelinkError(f"point-to-point on CUDA tensors over {comm.name} needs peer memory (one host, at most "
                           f"{symm.MAX_WORLD} ranks, Triton) or NCCL, and has neither")
    return None
