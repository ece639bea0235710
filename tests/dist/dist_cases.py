"""Inputs the distributed GEMM tests share (CPU and GPU modules): small integers, exact in every
summation order, and b as a contiguous [K, N] or as the transposed view of an nn.Linear-style weight; the
context-parallel tests' attention over the whole sequence in plain torch."""
import torch


def ints(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def weight(k, n, seed, dtype, transposed):
    """[K, N]: contiguous, or the transposed view of an [N, K] nn.Linear-style weight."""
    return ints((n, k), seed, dtype).t() if transposed else ints((k, n), seed, dtype)


def layouts(world, packages_by_size):
    """(name, communicator) of the flat world and of every package layout of ``packages_by_size[world.size]``
    (lists of packages), each a split of the world made on every rank."""
    out = [("flat", world)]
    for packages in packages_by_size.get(world.size, []):
        sub = world.split(0)
        sub.packages = packages
        out.append((f"packages {packages}", sub))
    return out


def free(groups):
    """Free the communicators ``layouts`` made (not the world)."""
    for _, g in groups[1:]:
        g.free()


def expect_errors(cases):
    """Each ``(call, exception type, text)``: the call raises that type with ``text`` in its message."""
    for call, exc, text in cases:
        try:
            call()
        except exc as e:
            assert text in str(e), f"{e!s} lacks {text!r}"
        else:
            raise AssertionError(f"no {exc.__name__} for {text!r}")


def full_attention(q, k, v, causal, scale=None, window=None):
    """(out, lse) of attention over the whole sequence in plain torch, no xelink code (GQA by repeated KV
    heads; causal: position p sees keys <= p; a window: only the ``window`` keys ending at p, or without causal
    the sequence's last ``window``)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    S = q.shape[2]
    p, key = torch.arange(S)[:, None], torch.arange(S)[None, :]
    last = p if causal else torch.full_like(p, S - 1)
    hidden = key > last
    if window is not None:
        hidden |= key <= last - window
    s = s.masked_fill(hidden, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
