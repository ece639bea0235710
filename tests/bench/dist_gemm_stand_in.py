"""A minimal private stand-in for issue 21's ops, for the dist-gemm family's CPU tests only: installed on
the ``xelink`` module while a test runs, and only where the real ops do not exist yet (they are written
elsewhere; once merged, the tests run the family on the real ones)."""
import contextlib

import torch

import xelink

OPS = ("all_gather_matmul", "matmul_reduce_scatter")


def _all_gather_matmul(a_shard, b, *, group=None, gather_dim=0, return_gathered=False, algo="auto", out=None,
                       _wrong=False):
    n = xelink.get_world().size
    gathered = torch.empty(a_shard.shape[0] * n, a_shard.shape[1], dtype=a_shard.dtype)
    xelink.all_gather_into_tensor(gathered, a_shard.contiguous())
    c = gathered @ b
    if _wrong:
        c[0, 0] += 1
    return c


def _matmul_reduce_scatter(a, b, *, group=None, scatter_dim=0, op="sum", algo="auto", out=None, _wrong=False):
    n = xelink.get_world().size
    partial = a @ b
    block = torch.empty(a.shape[0] // n, b.shape[1], dtype=partial.dtype)
    xelink.reduce_scatter_tensor(block, partial)
    if _wrong:
        block[0, 0] += 1
    return block


@contextlib.contextmanager
def ops(*, wrong_algo=None, missing=False):
    """The stand-ins on ``xelink`` (where the real ops are missing); ``wrong_algo``: that algorithm's
    output is off by one in one element; ``missing``: no ops at all while it runs."""
    saved = {name: getattr(xelink, name) for name in OPS if hasattr(xelink, name)}
    fns = {"all_gather_matmul": _all_gather_matmul, "matmul_reduce_scatter": _matmul_reduce_scatter}
    for name in OPS:
        if missing:
            if hasattr(xelink, name):
                delattr(xelink, name)
            continue
        real = saved.get(name)
        stand = fns[name]
        base = real or stand

        def call(*args, _base=base, _stand=stand, _real=real, **kw):
            if wrong_algo is not None and kw.get("algo") == wrong_algo:
                return _stand(*args, _wrong=True, **kw)
            return _base(*args, **kw)

        setattr(xelink, name, call)
    try:
        yield
    finally:
        for name in OPS:
            if name in saved:
                setattr(xelink, name, saved[name])
            elif hasattr(xelink, name):
                delattr(xelink, name)
