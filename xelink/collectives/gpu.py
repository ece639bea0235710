"""The collectives on CUDA tensors: peer-memory kernels, NCCL through torch.distributed, and compositions.

Semantics are NCCL's: a call enqueues its work on the current CUDA stream and returns; the result is
ready for any later work on that stream. ``async_op=True`` returns a handle whose ``wait()`` makes
the current stream wait for it. Nothing here synchronizes the host, so calls can be captured in CUDA
graphs (after one warm-up call, which sets up peer memory) and traced by ``torch.compile`` (the
``xelink::`` custom ops of ``compiled.py``). A kernel whose barrier outlives the deadline records the
missing ranks; the next call on the communicator (or ``xelink.synchronize``) raises
``xelink.TimeoutError`` naming them.

Algorithms (``algo=``), each named in results:
    all_reduce: direct (one-shot, push), two_shot, copy_engine (two-shot whose all-gather half is
        pulled by the DMA engines; input from ``xelink.empty``), hierarchical (reduce-scatter in each
        package, all-reduce across packages, all-gather in each package), nccl
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

ALGOS = {"all_reduce": ("direct", "two_shot", "copy_engine", "hierarchical", "nccl"),
         "all_gather": ("direct", "copy_engine", "topo", "nccl"),
         "reduce_scatter": ("direct", "nccl"),
         "all_to_all": ("direct", "nccl")}
# CPU algorithm names that mean the same thing on GPUs.
_ALIASES = {"dest_split": "direct", "one_shot": "direct"}
# Size rule for algo="auto" when no tuning table says otherwise (bytes of the buffer reduced): the
# one-shot push moves (n-1) buffers per rank, two-shot 2(n-1)/n; on 2 x H200 one-shot won at every
# size with torch.empty tensors (benchmarks/results/h200x2-gpu-collectives), so two ranks always take it.
_DIRECT_MAX = 512 << 10
_BLOCK = {1: 4096, 2: 4096, 4: 2048, 8: 1024}  # elements per tile: 16-byte vectors x 8 warps x 2
_NUM_WARPS = 8
_SMALL = 512 << 10  # bytes up to which the direct all-reduce runs the small configuration
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
_OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "prod": 4}  # the kernels' OP codes
_kernels_module = None
_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


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


def _check_pair(fn, comm, out, inp):
    _check(fn, comm, "output", out)
    _check(fn, comm, "input", inp)
    if out.dtype != inp.dtype:
        raise TypeError(f"{fn}: output.dtype={out.dtype} != input.dtype={inp.dtype}")


def _alone(comm, fn, async_op, out, inp):
    """One rank (or nothing to move): the output is this rank's own data."""
    if out.numel():
        out.view(-1).copy_(inp.view(-1)[: out.numel()])
    return _done(comm, fn, async_op)


def _algo(fn, op_family, algo, comm, nbytes, dtype):
    algo = _ALIASES.get(algo, algo)
    algos = ALGOS[op_family]
    if algo == "auto":
        return _auto(comm, op_family, nbytes, dtype)
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


def _auto(comm, op_family, nbytes, dtype):
    """Measured tuning table first, then the size rule; NCCL where peer memory is unavailable.

    Only paths that take any tensor are candidates (the table is built from such rows).
    """
    cache = comm.__dict__.setdefault("_gpu_auto", {})
    key = (op_family, dtype, max(nbytes, 1).bit_length())
    if key not in cache:
        choice = None
        if not (peer.available(comm) and _kernels().available()):
            choice = "nccl"
        else:
            from ..runtime import tuning_table

            table = tuning_table()
            if table is not None:  # GPU rows are stored as "cuda:<op>" ("xelink bench gpu-collectives --tune")
                found = table.lookup(f"cuda:{op_family}", dtype, nbytes)
                if found is not None:
                    found = found.split(":", 1)[-1]
                    choice = found if found in ALGOS[op_family] else None
        if choice is None:
            if op_family == "all_reduce":
                choice = "direct" if nbytes <= _DIRECT_MAX or comm.size == 2 else "two_shot"
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



def _launch(comm, fn, timeout, key, build):
    """Enqueue the cached plan ``key`` on the current stream; ``build(team, timeout_ns)`` makes it once.

    A plan is the list of ``Bound`` kernel launches of one call (pieces included), every argument
    fixed, so a repeated call costs a dict lookup and the launches. Keys hold everything a plan
    depends on (addresses, sizes, dtype, op, algorithm, deadline, peers' addresses of a symmetric
    input); growing the scratch buffer drops every plan.
    """
    team = comm.__dict__.get("_cuda_team")
    if team is None:
        team = peer.team_of(comm, fn)
    team.check(fn)
    plan = team.plans.get(key)
    if plan is None:
        plan = build(team, _timeout_ns(comm, timeout))
        if len(team.plans) > 4096:  # many distinct buffers: start over rather than grow without bound
            team.plans.clear()
        team.plans[key] = plan
    stream = _raw_stream(team.device.index)
    for bound in plan:
        bound(stream)
    return team


def _kernel(team, name, dtype, small=False, **consts):
    """The team's kernel ``name`` for ``dtype`` and these meta-parameters (built once, then a dict hit).

    ``small``: half the tile and warps, for latency-bound messages (measured on 2 x H200: 0.2-0.3 us
    less at 32-256 KiB, slower above 1 MiB).
    """
    key = (name, dtype, small, *consts.values())
    k = team.kernels.get(key)
    if k is None:
        K = _kernels()
        if "ACC" in consts:
            consts["ACC"] = K.acc_type(dtype)
        div = 2 if small else 1
        k = team.kernels[key] = K.Kernel(name, team, dtype, num_warps=_NUM_WARPS // div,
                                         BLOCK=_BLOCK[dtype.itemsize] // div, **consts)
    return k


def _pieces(count, per_piece):
    """(start, length) of consecutive pieces of at most ``per_piece`` elements (one empty piece for 0)."""
    per_piece = max(per_piece, 1)
    return [(s, min(per_piece, count - s)) for s in range(0, max(count, 1), per_piece)]


def _symmetric(comm, t):
    """Every rank's address of ``t`` if it is a symmetric tensor of ``comm`` (``xelink.empty``), else None."""
    team = comm.__dict__.get("_cuda_team")
    if team is None or not team.symmetric:
        return None
    sym = team.peer_addresses(t)
    return None if sym is None else tuple(sym)


# -- all_reduce ---------------------------------------------------------------------------------
def all_reduce(comm, x, op, algo, async_op, timeout):
    fn = "all_reduce"
    _check(fn, comm, "tensor", x)
    if op == "avg" and not x.dtype.is_floating_point:
        raise TypeError(f"{fn}: op='avg' needs a floating dtype, got {x.dtype}")
    nbytes = x.numel() * x.element_size()
    algo = _algo(fn, "all_reduce", algo, comm, nbytes, x.dtype)
    if comm.size == 1 or x.numel() == 0:
        return _done(comm, fn, async_op)
    if algo == "nccl":
        return _nccl(comm, fn, async_op, lambda pg, a: _dist().all_reduce(x, op=_nccl_op(op), group=pg, async_op=a))
    if algo == "hierarchical":
        _hierarchical_all_reduce(comm, x, op, timeout)
        return _done(comm, fn, async_op)
    sym = _symmetric(comm, x) if algo != "direct" else None
    if algo == "copy_engine" and sym is None:
        raise ValueError(f"{fn}: algo='copy_engine' reads the input in place on every rank: allocate it with "
                         f"xelink.empty (or use algo='two_shot')")
    key = (fn, x.data_ptr(), x.numel(), x.dtype, op, algo, timeout, sym)
    _launch(comm, fn, timeout, key, lambda team, t_ns: _all_reduce_plan(team, x, op, algo, sym, t_ns))
    return _done(comm, fn, async_op)


def _all_reduce_plan(team, x, op, algo, sym, timeout_ns):
    n, es, ptr = x.numel(), x.element_size(), x.data_ptr()
    code = _OPS[op]
    if algo == "copy_engine":
        return _copy_engine_all_reduce_plan(team, x, code, sym, timeout_ns)
    if sym is not None:  # two-shot in place on a symmetric tensor: no copies at all
        k = _kernel(team, "two_shot_all_reduce", x.dtype, OP=code, ACC=None, COPY=False, OUT=False)
        return [k.bind(X=ptr, Y=ptr, **_peers(sym), n=n, chunk=_round16(-(-n // team.size)), slot=0,
                       timeout_ns=timeout_ns)]
    slot = team.ensure_scratch(n * es, "all_reduce") // es
    if algo == "two_shot":
        k = _kernel(team, "two_shot_all_reduce", x.dtype, OP=code, ACC=None, COPY=True, OUT=True)
        per = (slot // team.size) // 16 * 16 * team.size
        return [k.bind(X=ptr + s * es, Y=ptr + s * es, **_peers(team.scratch_ptrs), n=m,
                       chunk=_round16(-(-m // team.size)), slot=slot, timeout_ns=timeout_ns)
                for s, m in _pieces(n, per)]
    k = _kernel(team, "direct_all_reduce", x.dtype, small=n * es <= _SMALL, OP=code, ACC=None)
    slot = team.ensure_scratch(team.size * _round16(n) * es, "all_reduce") // es  # a region per rank
    return [k.bind(X=ptr + s * es, Y=ptr + s * es, **_peers(team.scratch_ptrs), n=m, region=_round16(m),
                   slot=slot, timeout_ns=timeout_ns) for s, m in _pieces(n, slot // team.size // 16 * 16)]


def _copy_engine_all_reduce_plan(team, x, code, sym, timeout_ns):
    """Reduce-scatter on the SMs (each rank reduces its chunk of the symmetric ``x`` in place), then
    the copy engines pull the peers' reduced chunks, then a barrier (no peer may change ``x`` while
    another still pulls from it). The reduce-scatter kernel's second barrier orders the pulls after
    the peers' chunks are final."""
    n, es, ptr = x.numel(), x.element_size(), x.data_ptr()
    w, r = team.size, team.rank
    chunk = _round16(-(-n // w))
    bounds = [min(q * chunk, n) for q in range(w + 1)]
    rs = _kernel(team, "reduce_scatter", x.dtype, OP=code, ACC=None, COPY=False)
    mine = bounds[r + 1] - bounds[r]
    plan = [rs.bind(X=ptr, Y=ptr + bounds[r] * es, **_peers(sym), n=mine, x_stride=chunk, b_stride=chunk, slot=0,
                    timeout_ns=timeout_ns)]
    for i in range(1, w):
        p = (r + i) % w
        size = (bounds[p + 1] - bounds[p]) * es
        if size:
            plan.append(_Copy(ptr + bounds[p] * es, sym[p] + bounds[p] * es, size))
    plan.append(_kernel(team, "barrier", torch.int32).bind(timeout_ns=timeout_ns))
    return plan


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
    _check_pair(fn, comm, out, inp)
    if out.numel() != comm.size * inp.numel():
        raise ValueError(f"{fn}: output.numel()={out.numel()} != world_size*input.numel()={comm.size * inp.numel()}")
    nbytes = out.numel() * out.element_size()
    algo = _algo(fn, "all_gather", algo, comm, nbytes, inp.dtype)
    if comm.size == 1 or inp.numel() == 0:
        return _alone(comm, fn, async_op, out, inp)
    if algo == "nccl":
        return _nccl(comm, fn, async_op, lambda pg, a: _dist().all_gather_into_tensor(out, inp, group=pg, async_op=a))
    if algo == "topo":
        _topo_all_gather(comm, out, inp, timeout)
        return _done(comm, fn, async_op)
    x, y = inp.view(-1), out.view(-1)
    sym = _symmetric(comm, x)
    key = (fn, y.data_ptr(), x.data_ptr(), x.numel(), x.dtype, algo, timeout, sym)
    if algo == "copy_engine":
        _launch(comm, fn, timeout, key, lambda team, t_ns: _copy_engine_plan(team, y, x, sym, t_ns))
    else:
        _launch(comm, fn, timeout, key, lambda team, t_ns: _gather_plan(team, y, x, x.numel(), sym, False, t_ns))
    return _done(comm, fn, async_op)


def _gather_plan(team, out, inp, n, sym, a2a, timeout_ns):
    """Y[p*n + i] = rank p's X[(RANK if a2a else 0)*n + i] through the ``gather`` kernel, in pieces."""
    es = inp.element_size()
    if sym is not None:
        k = _kernel(team, "gather", inp.dtype, A2A=a2a, COPY=False)
        return [k.bind(X=inp.data_ptr(), Y=out.data_ptr(), **_peers(sym), n=n, x_stride=n, b_stride=n,
                       y_stride=n, slot=0, timeout_ns=timeout_ns)]
    staged = team.size if a2a else 1
    fn = "all_to_all_single" if a2a else "all_gather_into_tensor"
    slot = team.ensure_scratch(staged * n * es, fn) // es
    k = _kernel(team, "gather", inp.dtype, A2A=a2a, COPY=True)
    return [k.bind(X=inp.data_ptr() + s * es, Y=out.data_ptr() + s * es, **_peers(team.scratch_ptrs), n=m,
                   x_stride=n, b_stride=m, y_stride=n, slot=slot, timeout_ns=timeout_ns)
            for s, m in _pieces(n, slot // staged // 16 * 16)]


class _Copy:
    """A copy-engine transfer in a plan: ``copy(stream)``; ``aside`` runs it on a side stream.

    On the side stream (forked from the calling stream and joined back at ``join``) the local copy of
    this rank's own shard overlaps the pulls over the links instead of queueing behind them.
    """

    __slots__ = ("dst", "src", "nbytes", "aside")

    def __init__(self, dst, src, nbytes, aside=None):
        self.dst, self.src, self.nbytes, self.aside = dst, src, nbytes, aside

    def __call__(self, stream):
        if self.aside is None:
            peer.copy(self.dst, self.src, self.nbytes, stream)
            return
        side, forked, done = self.aside
        current = torch.cuda.current_stream()
        forked.record(current)
        side.wait_event(forked)
        peer.copy(self.dst, self.src, self.nbytes, side.cuda_stream)
        done.record(side)


class _Join:
    """Make the calling stream wait for a ``_Copy`` that ran aside."""

    __slots__ = ("done",)

    def __init__(self, done):
        self.done = done

    def __call__(self, stream):
        torch.cuda.current_stream().wait_event(self.done)


def _copy_engine_plan(team, out, inp, sym, timeout_ns):
    """Barrier, then the copy engines pull every peer's shard over the links, then a barrier.

    A symmetric input is read in place; another is first staged in the scratch buffer, after a
    barrier that makes sure no peer still reads the scratch buffer.
    """
    es, n = inp.element_size(), inp.numel()
    nbytes = n * es
    barrier = _kernel(team, "barrier", torch.int32).bind(timeout_ns=timeout_ns)
    plan = []
    if sym is None:
        team.ensure_scratch(nbytes, "all_gather_into_tensor")
        if nbytes > team.slot:
            raise ValueError(f"all_gather_into_tensor: algo='copy_engine' stages at most {team.slot} B of an "
                             f"input that is not from xelink.empty (got {nbytes} B)")
        plan += [barrier, _Copy(team.scratch_ptrs[team.rank], inp.data_ptr(), nbytes)]
        sym = team.scratch_ptrs
    plan.append(barrier)
    aside = (torch.cuda.Stream(team.device), torch.cuda.Event(), torch.cuda.Event())
    plan.append(_Copy(out.data_ptr() + team.rank * nbytes, inp.data_ptr(), nbytes, aside))
    for i in range(1, team.size):
        p = (team.rank + i) % team.size
        plan.append(_Copy(out.data_ptr() + p * nbytes, sym[p], nbytes))
    plan += [_Join(aside[2]), barrier]
    return plan


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
    _check_pair(fn, comm, out, inp)
    if inp.numel() != comm.size * out.numel():
        raise ValueError(f"{fn}: input.numel()={inp.numel()} != world_size*output.numel()={comm.size * out.numel()}")
    if op == "avg" and not out.dtype.is_floating_point:
        raise TypeError(f"{fn}: op='avg' needs a floating dtype, got {out.dtype}")
    algo = _algo(fn, "reduce_scatter", algo, comm, inp.numel() * inp.element_size(), inp.dtype)
    if comm.size == 1 or out.numel() == 0:
        return _alone(comm, fn, async_op, out, inp)
    if algo == "nccl":
        return _nccl(comm, fn, async_op,
                     lambda pg, a: _dist().reduce_scatter_tensor(out, inp, op=_nccl_op(op), group=pg, async_op=a))
    x, y = inp.view(-1), out.view(-1)
    sym = _symmetric(comm, x)
    key = (fn, y.data_ptr(), x.data_ptr(), y.numel(), x.dtype, op, algo, timeout, sym)
    _launch(comm, fn, timeout, key, lambda team, t_ns: _reduce_scatter_plan(team, y, x, op, sym, t_ns))
    return _done(comm, fn, async_op)


def _reduce_scatter_plan(team, y, x, op, sym, timeout_ns):
    es, n, code = x.element_size(), y.numel(), _OPS[op]
    if sym is not None:
        k = _kernel(team, "reduce_scatter", x.dtype, OP=code, ACC=None, COPY=False)
        return [k.bind(X=x.data_ptr(), Y=y.data_ptr(), **_peers(sym), n=n, x_stride=n, b_stride=n, slot=0,
                       timeout_ns=timeout_ns)]
    slot = team.ensure_scratch(x.numel() * es, "reduce_scatter_tensor") // es
    k = _kernel(team, "reduce_scatter", x.dtype, OP=code, ACC=None, COPY=True)
    return [k.bind(X=x.data_ptr() + s * es, Y=y.data_ptr() + s * es, **_peers(team.scratch_ptrs), n=m,
                   x_stride=n, b_stride=m, slot=slot, timeout_ns=timeout_ns)
            for s, m in _pieces(n, slot // team.size // 16 * 16)]


# -- all_to_all ---------------------------------------------------------------------------------
def all_to_all_single(comm, out, inp, algo, async_op, timeout):
    fn = "all_to_all_single"
    _check_pair(fn, comm, out, inp)
    if out.numel() != inp.numel() or inp.numel() % comm.size:
        raise ValueError(f"{fn}: input.numel()={inp.numel()} and output.numel()={out.numel()} must be equal and "
                         f"divisible by world_size={comm.size} (equal splits on CUDA tensors)")
    algo = _algo(fn, "all_to_all", algo, comm, inp.numel() * inp.element_size(), inp.dtype)
    if comm.size == 1 or inp.numel() == 0:
        return _alone(comm, fn, async_op, out, inp)
    if algo == "nccl":
        return _nccl(comm, fn, async_op, lambda pg, a: _dist().all_to_all_single(out, inp, group=pg, async_op=a))
    x, y = inp.view(-1), out.view(-1)
    sym = _symmetric(comm, x)
    key = (fn, y.data_ptr(), x.data_ptr(), x.numel(), x.dtype, algo, timeout, sym)
    n = x.numel() // comm.size
    _launch(comm, fn, timeout, key, lambda team, t_ns: _gather_plan(team, y, x, n, sym, True, t_ns))
    return _done(comm, fn, async_op)


# -- barrier, errors ----------------------------------------------------------------------------
def barrier(comm, timeout=None):
    """A GPU-resident barrier on the current stream: later work waits until every rank reached it."""
    _launch(comm, "device_barrier", timeout, ("barrier", timeout),
            lambda team, t_ns: [_kernel(team, "barrier", torch.int32).bind(timeout_ns=t_ns)])


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
