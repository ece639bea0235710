"""torch.compile traces the collectives as xelink custom ops (CPU tensors here; GPU in ranks_gpu_collectives)."""
import torch

import xelink

WORLD_SIZES = (2,)


def check_compiled_function_calls_the_collectives(world):
    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(x, shard):
        y = x * 2
        xelink.all_reduce(y, op="sum")
        out = torch.empty(world.size * shard.numel(), dtype=shard.dtype)
        xelink.all_gather_into_tensor(out, shard + 1)
        part = torch.empty(shard.numel(), dtype=shard.dtype)
        xelink.reduce_scatter_tensor(part, out, op="max")
        return y + 1, out, part

    n = 6
    x = torch.arange(n, dtype=torch.float32) + world.rank
    shard = torch.full((3,), float(world.rank))
    y, out, part = step(x, shard)
    want_y = sum((torch.arange(n, dtype=torch.float32) + r) * 2 for r in range(world.size)) + 1
    assert torch.equal(y, want_y), (y, want_y)
    assert torch.equal(out, torch.cat([torch.full((3,), r + 1.0) for r in range(world.size)])), out
    full = torch.cat([torch.full((3,), r + 1.0) for r in range(world.size)])
    assert torch.equal(part, full[world.rank * 3:(world.rank + 1) * 3]), part


def check_async_op_is_refused_under_compile(world):
    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(x):
        xelink.all_reduce(x, async_op=True)
        return x

    try:
        step(torch.ones(4))
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the error; its text must carry ours
        assert "async_op=True cannot be traced" in str(e), e
    else:
        raise AssertionError("async_op=True was traced")
