"""Where a decode-attention call's time goes at B = 1 (issue 23's 1.1x at 8K / 32K, issue 26's 8K row).

    python3 benchmarks/scripts/decode_latency.py [--contexts 64 1024 8192 32768] \
        [--variants 'attention._NAME=V&...' ...]

Llama-3.1-8B's attention (32 / 8 heads of 128, bf16, one token), LAYERS caches of the context's length replayed in
one CUDA graph (more than L2 at 8K and up). For each context, us a call in the graph (and GB/s of keys and values) of

- ``floor``: a Triton kernel of the decode kernel's grid that loads kv_lens and stores one value (launch + one
  round trip);
- ``stream``: the decode kernel's grid, each program summing its split's keys and values with plain loads (the
  bytes the attention reads, nothing else);
- ``decode``: ``decode_attention``; ``rope``: ``rope_decode_attention`` (RoPE + cache write in the launch);
- ``sdpa``: torch's SDPA (cuDNN / flash) on the same caches, the baseline of issue 23.

``--variants 'attention._NAME=V&attention._OTHER=W' ...`` reruns decode / rope with module constants of
``xelink.kernels.attention`` so set, a variant an argument (the launch plans cleared between them). Every decode
output is checked against the reference first. (A GPU script: CUDA, NVIDIA's Triton.)
"""
import argparse
import statistics

import torch
import triton
import triton.language as tl

from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import attention as A

LAYERS = 16
HQ, HKV, D = 32, 8, 128


@triton.jit
def _floor_kernel(KV_LENS, OUT):
    n = tl.load(KV_LENS)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(OUT, n)


@triton.jit
def _stream_kernel(K, V, OUT, chunk, stride_h, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    base = h.to(tl.int64) * stride_h + s.to(tl.int64) * chunk * 128
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, chunk * 128, BLOCK):
        acc += tl.load(K + base + i + tl.arange(0, BLOCK)).to(tl.float32)
        acc += tl.load(V + base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(OUT + h * tl.num_programs(0) + s, tl.sum(acc))


def _row(calls):
    """us a call in the graph."""
    g = cuda_graph(calls, 1)[0]
    per = statistics.median(t for _ in range(5) for t in time_cuda_events(g.replay, warmup=2, iters=10))
    return per / len(calls) * 1e6


def _clear_plans():
    for obj in vars(A).values():
        if hasattr(obj, "clear") and type(obj).__name__ == "Paths":
            obj.clear()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 8192, 32768])
    ap.add_argument("--variants", nargs="*", default=[])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, HQ, 1, D, device="cuda", generator=gen).bfloat16()
    kn, vn = (torch.randn(1, HKV, 1, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    cos, sin = (torch.randn(65536, D, device="cuda", generator=gen) for _ in range(2))
    sink = torch.zeros(4096, device="cuda")
    variants = [("kept", {})] + [(v, {a.split(".", 1)[1]: eval(x) for a, x in (p.split("=", 1) for p in v.split("&"))})
                                 for v in args.variants]  # noqa: S307
    for ctx in args.contexts:
        caches = [(torch.randn(1, HKV, ctx, D, device="cuda", generator=gen).bfloat16(),
                   torch.randn(1, HKV, ctx, D, device="cuda", generator=gen).bfloat16()) for _ in range(LAYERS)]
        lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        k0, v0 = caches[0]
        gb = 2 * k0.numel() * 2 / 1e3  # bytes a call, in units giving GB/s from us
        splits = A._decode_splits(q, k0, A._DECODE_CONFIGS[D][0])
        chunk = -(-ctx // splits)
        rows = {"floor": _row([lambda: _floor_kernel[(splits, HKV)](lens, sink) for _ in caches])}
        for block in (2048, 8192) if ctx % splits == 0 and chunk * D % 8192 == 0 else ():
            rows[f"stream {block}"] = _row([lambda k=k, v=v: _stream_kernel[(splits, HKV)](
                k, v, sink, chunk, ctx * D, BLOCK=block, num_warps=4) for k, v in caches])
        rows["sdpa"] = _row([lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, enable_gqa=True) for k, v in caches])
        for name, sets in variants:
            old = {a: getattr(A, a) for a in sets}
            for a, x in sets.items():
                setattr(A, a, x)
            _clear_plans()
            try:
                got = A.decode_attention(q, k0, v0, lens)
                want = A.reference_decode_attention(q, k0, v0, lens)
                err = float((got.float() - want.float()).norm() / want.float().norm())
                assert err < 2e-2, (name, err)
                kc, vc = k0.clone(), v0.clone()
                got = A.rope_decode_attention(q, kn, vn, cos, sin, kc, vc, lens)
                kr, vr = k0.clone(), v0.clone()
                want = A.reference_rope_decode_attention(q, kn, vn, cos, sin, kr, vr, lens)
                err_r = float((got.float() - want.float()).norm() / want.float().norm())
                # (the new key within one rounding of the reference's: FMA contraction)
                ok = torch.allclose(kc.float(), kr.float(), rtol=2 ** -7, atol=0) and torch.equal(vc, vr)
                assert err_r < 2e-2 and ok, (name, err_r)
                tag = "" if not sets else f" {name}"
                rows["decode" + tag] = _row([lambda k=k, v=v: A.decode_attention(q, k, v, lens) for k, v in caches])
                rows["rope" + tag] = _row([lambda k=k, v=v: A.rope_decode_attention(q, kn, vn, cos, sin, k, v, lens)
                                           for k, v in caches])
            finally:
                for a, x in old.items():
                    setattr(A, a, x)
                _clear_plans()
        print(f"\ncontext {ctx} (splits {splits}, {gb * 1e3 / 1e6:.1f} MB a call):", flush=True)
        for name, per in rows.items():
            print(f"  {name:40s} {per:8.2f} us a call ({gb / per:7.0f} GB/s)", flush=True)
        del caches
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
