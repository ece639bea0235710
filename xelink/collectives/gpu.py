"""The collectives on CUDA tensors: peer-memory kernels, NCCL through torch.distributed, and compositions.

Semantics are NCCL's: a call enqueues its work on the current CUDA stream and returns; the result is
ready for any later work on that stream. ``async_op=True`` returns a handle whose ``wait()`` makes
the current stream wait for it. Nothing here synchronizes the host, so calls can be captured in CUDA
graphs (after one warm-up call, which sets up peer memory) and traced by ``torch.compile`` (the
``xelink::`` custom ops at the bottom). A kernel whose barrier outlives the deadline records the
missing ranks; the next call on the communicator (or ``xelink.synchronize``) raises
``xelink.TimeoutError`` naming them.

Algorithms (``algo=``), each named in results:
    all_reduce: direct (one-shot), two_shot, hierarchical (reduce-scatter in each package, all-reduce
        across packages, all-gather in each package), nccl
    all_gather: direct (pull from every peer), copy_engine (the DMA engines pull), topo (across
        packages, then inside each), nccl
    reduce_scatter, all_to_all: direct, nccl
"""
from __future__ import annotations

import torch

from ..errors import XelinkError
from ..transport import cuda as peer
from . import _groups

__all__ = ["ALGOS", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
           "barrier", "synchronize", "device_barrier", "synchronize_group", "GpuWork"]

ALGOS = {"all_reduce": ("direct", "two_shot", "hierarchical", "nccl"),
         "all_gather": ("direct", "copy_engine", "topo", "nccl"),
         "reduce_scatter": ("direct", "nccl"),
         "all_to_all": ("direct", "nccl")}
# CPU algorithm names that mean the same thing on GPUs.
_ALIASES = {"dest_split": "direct", "one_shot": "direct"}
# Size rule for algo="auto" when no tuning table says otherwise (bytes of the buffer reduced).
_DIRECT_MAX = 512 << 10
_BLOCK = {1: 4096, 2: 4096, 4: 2048, 8: 1024}  # elements per tile: 16-byte vectors x 8 warps x 2
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
_OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "prod": 4}  # the kernels' OP codes
_kernels_module = None


def _kernels():
    """``xelink.kernels.collectives``, imported on first use (it imports Triton); kept for the hot path."""
    global _kernels_module
    if _kernels_module is None:
        from ..kernels import collectives

        _kernels_module = collectives
    return _kernels_module


def _device(comm) -> torch.device:
    dev = comm.__dict__.get("_cuda_device")
    if dev is None:
        dev = comm._cuda_device = torch.device(comm.device)
    return dev


def _check(fn, comm, name, t):
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (call .contiguous() first)")
    if t.device != _device(comm):
        raise ValueError(f"{fn}: {name} is on {t.device} but this rank of {comm.name} drives {comm.device}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{fn}: {name}.dtype={t.dtype} is not supported on GPUs; use one of "
                        f"{', '.join(str(d).replace('torch.', '') for d in _DTYPES)}")


def _algo(fn, op_family, algo, comm, nbytes):
    algo = _ALIASES.get(algo, algo)
    algos = ALGOS[op_family]
    if algo == "auto":
        return _auto(comm, op_family, nbytes)
    if algo not in algos:
        raise ValueError(f"{fn}: algo={algo!r} is not one of auto, {', '.join(algos)} for CUDA tensors")
    if algo == "nccl" or "_cuda_team" in comm.__dict__:
        return algo
    if not peer.available(comm):
        raise ValueError(f"{fn}: algo={algo!r} needs peer memory: every rank of {comm.name} on one host's "
                         f"CUDA GPUs, at most {peer.MAX_WORLD} ranks (use algo='nccl' or 'auto')")
    if not _kernels().available():
        raise XelinkError(f"{fn}: algo={algo!r} runs Triton kernels, and Triton is not installed")
    return algo


def _auto(comm, op_family, nbytes):
    """Measured tuning table first, then the size rule; NCCL where peer memory is unavailable."""
    cache = comm.__dict__.setdefault("_gpu_auto", {})
    key = (op_family, max(nbytes, 1).bit_length())
    if key not in cache:
        choice = None
        if not (peer.available(comm) and _kernels().available()):
            choice = "nccl"
        else:
            from ..runtime import tuning_table

            table = tuning_table()
            if table is not None:
                found = table.lookup(op_family, "cuda", nbytes)
                if found is not None:
                    found = found.split(":", 1)[-1]
                    choice = found if found in ALGOS[op_family] else None
        if choice is None:
            if op_family == "all_reduce":
                choice = "direct" if nbytes <= _DIRECT_MAX else "two_shot"
            else:
                choice = "direct"
        cache[key] = choice
    return cache[key]


class GpuWork:
    """Handle of an ``async_op=True`` call on CUDA tensors (torch.distributed's Work)."""

    def __init__(self, comm, what):
        self._event = torch.cuda.Event()
        self._event.record()
        self._comm, self._what = comm, what

    def is_completed(self) -> bool:
        return self._event.query()

    def wait(self, timeout=None) -> bool:
        """Make the current stream wait for the operation (the host does not block)."""
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def synchronize(self) -> None:
        """Block the host until the operation has finished; raise its timeout if it had one."""
        self._event.synchronize()
        team = self._comm.__dict__.get("_cuda_team")
        if team is not None:
            team.check(self._what)


def _done(comm, what, async_op):
    return GpuWork(comm, what) if async_op else None


def _timeout_ns(comm, timeout) -> int:
    if timeout is None:
        return int(comm.timeout * 1e9)
    from ..runtime import resolve_timeout

    return int(resolve_timeout(timeout, "timeout") * 1e9)



class _Ctx:
    """What one call needs: the team, the kernel cache, the stream, the deadline."""

    __slots__ = ("team", "stream", "timeout_ns")

    def __init__(self, comm, fn, timeout):
        team = comm.__dict__.get("_cuda_team")
        if team is None:
            team = peer.team_of(comm, fn)
        team.check(fn)
        self.team = team
        self.stream = torch.cuda.current_stream().cuda_stream
        self.timeout_ns = _timeout_ns(comm, timeout)


def _kernel(team, name, dtype, **consts):
    """The team's kernel ``name`` for ``dtype`` and these meta-parameters (built once, then a dict hit)."""
    key = (name, dtype, *consts.values())
    k = team.kernels.get(key)
    if k is None:
        K = _kernels()
        if "ACC" in consts:
            consts["ACC"] = K.acc_type(dtype)
        k = team.kernels[key] = K.Kernel(name, team, dtype, BLOCK=_BLOCK[dtype.itemsize], **consts)
    return k


def _op_code(op):
    return _OPS[op]


def _pieces(count, per_piece):
    """(start, length) of consecutive pieces of at most ``per_piece`` elements (one empty piece for 0)."""
    per_piece = max(per_piece, 1)
    return [(s, min(per_piece, count - s)) for s in range(0, max(count, 1), per_piece)]


def _elems(nbytes, esize):
    return nbytes // esize


# -- all_reduce ---------------------------------------------------------------------------------
def all_reduce(comm, x, op, algo, async_op, timeout):
    fn = "all_reduce"
    _check(fn, comm, "tensor", x)
    if op == "avg" and not x.dtype.is_floating_point:
        raise TypeError(f"{fn}: op='avg' needs a floating dtype, got {x.dtype}")
    nbytes = x.numel() * x.element_size()
    algo = _algo(fn, "all_reduce", algo, comm, nbytes)
    if comm.size == 1 or x.numel() == 0:
        return _done(comm, fn, async_op)
    if algo == "nccl":
        return _nccl(comm, fn, async_op, lambda pg, a: _dist().all_reduce(x, op=_nccl_op(op), group=pg, async_op=a))
    if algo == "hierarchical":
        _hierarchical_all_reduce(comm, x, op, timeout)
        return _done(comm, fn, async_op)
    ctx = _Ctx(comm, fn, timeout)
    team, flat, es = ctx.team, x.view(-1), x.element_size()
    if algo == "two_shot":
        sym = team.peer_addresses(flat)
        if sym is not None:
            k = _kernel(team, "two_shot_all_reduce", x.dtype, OP=_op_code(op), ACC=None, COPY=False, OUT=False)
            chunk = _round16(-(-flat.numel() // team.size))
            k(ctx.stream, X=flat.data_ptr(), Y=flat.data_ptr(), **_peers(sym), n=flat.numel(), chunk=chunk,
              slot=0, timeout_ns=ctx.timeout_ns)
            return _done(comm, fn, async_op)
        slot = team.ensure_scratch(nbytes, fn) // es
        k = _kernel(team, "two_shot_all_reduce", x.dtype, OP=_op_code(op), ACC=None, COPY=True, OUT=True)
        per = (slot // team.size) // 16 * 16 * team.size
        for start, length in _pieces(flat.numel(), per):
            ptr = flat.data_ptr() + start * es
            k(ctx.stream, X=ptr, Y=ptr, **_peers(team.scratch_ptrs), n=length,
              chunk=_round16(-(-length // team.size)), slot=slot, timeout_ns=ctx.timeout_ns)
        return _done(comm, fn, async_op)
    slot = team.ensure_scratch(nbytes, fn) // es
    k = _kernel(team, "direct_all_reduce", x.dtype, OP=_op_code(op), ACC=None)
    for start, length in _pieces(flat.numel(), slot):
        ptr = flat.data_ptr() + start * es
        k(ctx.stream, X=ptr, Y=ptr, **_peers(team.scratch_ptrs), n=length, slot=slot, timeout_ns=ctx.timeout_ns)
    return _done(comm, fn, async_op)


def _round16(v):
    return -(-v // 16) * 16


def _peers(addresses):
    return {f"B{i}": a for i, a in enumerate(addresses)}


def _hierarchical_all_reduce(comm, x, op, timeout):
    """Reduce-scatter inside each package, all-reduce across packages, all-gather inside each package.

    Each rank's 1/k share (k ranks per package) crosses the fabric; packages must be equal in size.
    """
    pkg, cross = _package_and_cross(comm, "all_reduce")
    inner = "sum" if op == "avg" else op
    flat = x.view(-1)
    k = pkg.size
    per = -(-flat.numel() // k)
    padded = torch.empty(per * k, dtype=x.dtype, device=x.device)
    padded[: flat.numel()].copy_(flat)
    if per * k > flat.numel():
        padded[flat.numel():].fill_(1 if op == "prod" else 0)
    part = torch.empty(per, dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(pkg, part, padded, inner, "direct", False, timeout)
    if cross.size > 1:
        all_reduce(cross, part, inner, "auto", False, timeout)
    if op == "avg":
        part.div_(comm.size)
    all_gather_into_tensor(pkg, padded, part, "direct", False, timeout)
    flat.copy_(padded[: flat.numel()])


def _package_and_cross(comm, fn):
    packages = _groups.layout(comm)
    sizes = {len(p) for p in packages}
    if len(sizes) != 1:
        raise ValueError(f"{fn}: algo='hierarchical'/'topo' on CUDA tensors needs packages of equal size; "
                         f"{comm.name} has packages {packages}")
    cache = comm.__dict__.setdefault("_gpu_package_comms", {})
    key = tuple(map(tuple, packages))
    if key not in cache:
        p, i = _groups.where(packages, comm.rank)
        cache[key] = (comm.split(p, key=i), comm.split(i, key=p))
    return cache[key]


# -- all_gather ---------------------------------------------------------------------------------
def all_gather_into_tensor(comm, out, inp, algo, async_op, timeout):
    fn = "all_gather_into_tensor"
    _check(fn, comm, "output", out)
    _check(fn, comm, "input", inp)
    if out.dtype != inp.dtype:
        raise TypeError(f"{fn}: output.dtype={out.dtype} != input.dtype={inp.dtype}")
    if out.numel() != comm.size * inp.numel():
        raise ValueError(f"{fn}: output.numel()={out.numel()} != world_size*input.numel()={comm.size * inp.numel()}")
    nbytes = out.numel() * out.element_size()
    algo = _algo(fn, "all_gather", algo, comm, nbytes)
    if comm.size == 1 or inp.numel() == 0:
        if inp.numel():
            out.view(-1).copy_(inp.view(-1))
        return _done(comm, fn, async_op)
    if algo == "nccl":
        return _nccl(comm, fn, async_op, lambda pg, a: _dist().all_gather_into_tensor(out, inp, group=pg, async_op=a))
    if algo == "topo":
        _topo_all_gather(comm, out, inp, timeout)
        return _done(comm, fn, async_op)
    ctx = _Ctx(comm, fn, timeout)
    if algo == "copy_engine":
        _copy_engine_all_gather(comm, ctx, out.view(-1), inp.view(-1), fn)
    else:
        _gather(comm, ctx, out.view(-1), inp.view(-1), inp.numel(), fn, a2a=False)
    return _done(comm, fn, async_op)


def _gather(comm, ctx, out, inp, n, fn, *, a2a):
    """Y[p*n + i] = rank p's X[(RANK if a2a else 0)*n + i] through the ``gather`` kernel, in pieces."""
    team, es = ctx.team, inp.element_size()
    sym = team.peer_addresses(inp)
    if sym is not None:
        k = _kernel(team, "gather", inp.dtype, A2A=a2a, COPY=False)
        k(ctx.stream, X=inp.data_ptr(), Y=out.data_ptr(), **_peers(sym), n=n, x_stride=n, b_stride=n,
          y_stride=n, slot=0, timeout_ns=ctx.timeout_ns)
        return
    staged = team.size if a2a else 1
    slot = team.ensure_scratch(staged * n * es, fn) // es
    k = _kernel(team, "gather", inp.dtype, A2A=a2a, COPY=True)
    for start, length in _pieces(n, slot // staged // 16 * 16):
        k(ctx.stream, X=inp.data_ptr() + start * es, Y=out.data_ptr() + start * es, **_peers(team.scratch_ptrs),
          n=length, x_stride=n, b_stride=length, y_stride=n, slot=slot, timeout_ns=ctx.timeout_ns)


def _copy_engine_all_gather(comm, ctx, out, inp, fn):
    """Barrier, then the copy engines pull every peer's shard over the links, then a barrier.

    A symmetric input is read in place; another is staged in the scratch buffer first.
    """
    team, es, n = ctx.team, inp.element_size(), inp.numel()
    nbytes = n * es
    barrier_k = _kernel(team, "barrier", torch.int32)
    sym = team.peer_addresses(inp)
    if sym is None:
        team.ensure_scratch(nbytes, fn)
        if nbytes > team.slot:
            raise ValueError(f"{fn}: algo='copy_engine' stages at most {team.slot_max} B of a non-symmetric "
                             f"input (got {nbytes}); allocate the input with xelink.empty")
        barrier_k(ctx.stream, timeout_ns=ctx.timeout_ns)  # peers are done with the scratch buffer
        peer.copy(team.scratch_ptrs[team.rank], inp.data_ptr(), nbytes, ctx.stream)
        sym = team.scratch_ptrs
    barrier_k(ctx.stream, timeout_ns=ctx.timeout_ns)
    for i in range(1, team.size + 1):  # own shard last: the links start first
        p = (team.rank + i) % team.size
        src = inp.data_ptr() if p == team.rank else sym[p]
        peer.copy(out.data_ptr() + p * nbytes, src, nbytes, ctx.stream)
    barrier_k(ctx.stream, timeout_ns=ctx.timeout_ns)


def _topo_all_gather(comm, out, inp, timeout):
    """Gather across packages (peers with my local index), then inside my package.

    Each shard crosses between packages once per remote package; the package then replicates it.
    """
    pkg, cross = _package_and_cross(comm, "all_gather_into_tensor")
    packages = _groups.layout(comm)
    n = inp.numel()
    mine = torch.empty(cross.size * n, dtype=inp.dtype, device=inp.device)
    all_gather_into_tensor(cross, mine, inp, "auto", False, timeout)
    full = torch.empty(comm.size * n, dtype=inp.dtype, device=inp.device)
    all_gather_into_tensor(pkg, full, mine, "auto", False, timeout)
    # full is ordered [local index i][package p]; output wants rank order.
    k = pkg.size
    view = full.view(k, cross.size, n)
    o = out.view(-1)
    for p, members in enumerate(packages):
        for i, r in enumerate(members):
            o[r * n:(r + 1) * n].copy_(view[i, p])


# -- reduce_scatter -----------------------------------------------------------------------------
def reduce_scatter_tensor(comm, out, inp, op, algo, async_op, timeout):
    fn = "reduce_scatter_tensor"
    _check(fn, comm, "output", out)
    _check(fn, comm, "input", inp)
    if out.dtype != inp.dtype:
        raise TypeError(f"{fn}: output.dtype={out.dtype} != input.dtype={inp.dtype}")
    if inp.numel() != comm.size * out.numel():
        raise ValueError(f"{fn}: input.numel()={inp.numel()} != world_size*output.numel()={comm.size * out.numel()}")
    if op == "avg" and not out.dtype.is_floating_point:
        raise TypeError(f"{fn}: op='avg' needs a floating dtype, got {out.dtype}")
    algo = _algo(fn, "reduce_scatter", algo, comm, inp.numel() * inp.element_size())
    if comm.size == 1 or out.numel() == 0:
        if out.numel():
            out.view(-1).copy_(inp.view(-1))
        return _done(comm, fn, async_op)
    if algo == "nccl":
        return _nccl(comm, fn, async_op,
                     lambda pg, a: _dist().reduce_scatter_tensor(out, inp, op=_nccl_op(op), group=pg, async_op=a))
    ctx = _Ctx(comm, fn, timeout)
    team, es, n = ctx.team, inp.element_size(), out.numel()
    x, y = inp.view(-1), out.view(-1)
    sym = team.peer_addresses(x)
    if sym is not None:
        k = _kernel(team, "reduce_scatter", x.dtype, OP=_op_code(op), ACC=None, COPY=False)
        k(ctx.stream, X=x.data_ptr(), Y=y.data_ptr(), **_peers(sym), n=n, x_stride=n, b_stride=n, slot=0,
          timeout_ns=ctx.timeout_ns)
        return _done(comm, fn, async_op)
    slot = team.ensure_scratch(x.numel() * es, fn) // es
    k = _kernel(team, "reduce_scatter", x.dtype, OP=_op_code(op), ACC=None, COPY=True)
    for start, length in _pieces(n, slot // team.size // 16 * 16):
        k(ctx.stream, X=x.data_ptr() + start * es, Y=y.data_ptr() + start * es, **_peers(team.scratch_ptrs),
          n=length, x_stride=n, b_stride=length, slot=slot, timeout_ns=ctx.timeout_ns)
    return _done(comm, fn, async_op)


# -- all_to_all ---------------------------------------------------------------------------------
def all_to_all_single(comm, out, inp, algo, async_op, timeout):
    fn = "all_to_all_single"
    _check(fn, comm, "output", out)
    _check(fn, comm, "input", inp)
    if out.dtype != inp.dtype:
        raise TypeError(f"{fn}: output.dtype={out.dtype} != input.dtype={inp.dtype}")
    if out.numel() != inp.numel() or inp.numel() % comm.size:
        raise ValueError(f"{fn}: input.numel()={inp.numel()} and output.numel()={out.numel()} must be equal and "
                         f"divisible by world_size={comm.size} (equal splits on CUDA tensors)")
    algo = _algo(fn, "all_to_all", algo, comm, inp.numel() * inp.element_size())
    if comm.size == 1 or inp.numel() == 0:
        if inp.numel():
            out.view(-1).copy_(inp.view(-1))
        return _done(comm, fn, async_op)
    if algo == "nccl":
        return _nccl(comm, fn, async_op, lambda pg, a: _dist().all_to_all_single(out, inp, group=pg, async_op=a))
    ctx = _Ctx(comm, fn, timeout)
    _gather(comm, ctx, out.view(-1), inp.view(-1), inp.numel() // comm.size, fn, a2a=True)
    return _done(comm, fn, async_op)


# -- barrier, errors ----------------------------------------------------------------------------
def barrier(comm, timeout=None):
    """A GPU-resident barrier on the current stream: later work waits until every rank reached it."""
    ctx = _Ctx(comm, "barrier", timeout)
    _kernel(ctx.team, "barrier", torch.int32)(ctx.stream, timeout_ns=ctx.timeout_ns)


def synchronize(comm) -> None:
    """Wait for this rank's GPU work, then raise ``xelink.TimeoutError`` if a GPU barrier timed out."""
    torch.cuda.synchronize(_device(comm))
    team = comm.__dict__.get("_cuda_team")
    if team is not None:
        team.check("synchronize")


# -- NCCL through torch.distributed -------------------------------------------------------------
def _dist():
    import torch.distributed as dist

    return dist


def _nccl_op(op):
    R = _dist().ReduceOp
    return {"sum": R.SUM, "avg": R.AVG, "max": R.MAX, "min": R.MIN, "prod": R.PRODUCT}[op]


def _nccl(comm, fn, async_op, call):
    """Run ``call(process_group, async_op)`` on the torch.distributed bridge (NCCL for CUDA tensors)."""
    return call(comm.process_group(), async_op)


# -- public helpers -----------------------------------------------------------------------------
def device_barrier(group=None, timeout=None) -> None:
    """GPU-resident barrier on the current stream: work queued after it runs once every rank got there.

    The host does not wait. A rank that never arrives makes the kernel give up at the deadline;
    the next call (or ``xelink.synchronize``) raises ``xelink.TimeoutError`` naming it.
    Collective: every rank of ``group`` must call this.
    """
    from ..comm import resolve_group

    barrier(resolve_group(group, "device_barrier"), timeout)


def synchronize_group(group=None) -> None:
    """Block until this rank's GPU work is done; raise ``xelink.TimeoutError`` if a GPU wait timed out."""
    from ..comm import resolve_group

    synchronize(resolve_group(group, "synchronize"))
