"""All-to-all: destination-split (every rank sends each block straight to its destination)."""
from __future__ import annotations

from . import gpu
from ._common import check_algo, fingerprint_check, group_of, is_cuda, output_input, run, step, tag_for

__all__ = ["all_to_all_single", "ALGOS"]

ALGOS = ("dest_split",)


def _splits(fn, name, splits, rows, n):
    if splits is None:
        if rows % n:
            raise ValueError(f"{fn}: {name} is None, so dim 0 ({rows}) must divide by world_size={n}")
        return [rows // n] * n
    splits = list(splits)
    if len(splits) != n or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in splits):
        raise ValueError(f"{fn}: {name}={splits} must be {n} non-negative ints (one per rank)")
    if sum(splits) != rows:
        raise ValueError(f"{fn}: sum({name})={sum(splits)} != dim 0 of the tensor ({rows})")
    return splits


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False, algo: str = "auto", timeout=None):
    """Split ``input`` along dim 0 and send block j to rank j; blocks from rank i fill ``output`` in order.

    Args:
        output, input: tensors/arrays of one dtype with equal trailing dims.
        output_split_sizes, input_split_sizes: rows per rank (None: equal splits of dim 0).
            ``input_split_sizes[j]`` on rank i must equal ``output_split_sizes[i]`` on rank j.

    Returns:
        None, or a ``Work`` when ``async_op``.

    Collective: every rank of ``group`` must call this.
    """
    fn = "all_to_all_single"
    comm = group_of(group, fn)
    if is_cuda(output) or is_cuda(input):
        return _gpu(comm, output, input, output_split_sizes, input_split_sizes, algo, async_op, timeout)
    out, inp = output_input(fn, output, input)
    if out.dim() == 0 or inp.dim() == 0:
        raise ValueError(f"{fn}: output and input need at least one dimension")
    if tuple(out.shape[1:]) != tuple(inp.shape[1:]):
        raise ValueError(f"{fn}: trailing dims differ: output {tuple(out.shape)} vs input {tuple(inp.shape)}")
    n = comm.size
    ins = _splits(fn, "input_split_sizes", input_split_sizes, inp.shape[0], n)
    outs = _splits(fn, "output_split_sizes", output_split_sizes, out.shape[0], n)
    if ins[comm.rank] != outs[comm.rank]:
        raise ValueError(f"{fn}: rank {comm.rank} sends itself {ins[comm.rank]} rows but expects "
                         f"{outs[comm.rank]} from itself")
    check_algo(fn, algo, ALGOS)
    fingerprint_check(comm, fn, (fn, tuple(inp.shape[1:]), str(inp.dtype), algo))
    row = 1
    for d in inp.shape[1:]:
        row *= d

    def body(deadline):
        fo, fi = out.view(-1), inp.reshape(-1)
        io = [sum(ins[:j]) * row for j in range(n + 1)]
        oo = [sum(outs[:j]) * row for j in range(n + 1)]
        r = comm.rank
        fo[oo[r]:oo[r + 1]].copy_(fi[io[r]:io[r + 1]])
        if n > 1:
            step(comm, [(p, fi[io[p]:io[p + 1]]) for p in range(n) if p != r],
                 [(p, fo[oo[p]:oo[p + 1]]) for p in range(n) if p != r], tag_for(comm), deadline, fn)

    return run(comm, fn, body, async_op, timeout)


def _gpu(comm, output, input, output_split_sizes, input_split_sizes, algo, async_op, timeout):
    """CUDA tensors: equal splits run xelink's kernel; uneven splits are NCCL's (``algo`` auto or nccl)."""
    fn = "all_to_all_single"
    if output_split_sizes is None and input_split_sizes is None:
        return gpu.all_to_all_single(comm, output, input, algo, async_op, timeout)
    if algo not in ("auto", "nccl"):
        raise ValueError(f"{fn}: split sizes on CUDA tensors run on NCCL only (algo='auto' or 'nccl'), "
                         f"got algo={algo!r}")
    import torch.distributed as dist

    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=comm.process_group(), async_op=async_op)
