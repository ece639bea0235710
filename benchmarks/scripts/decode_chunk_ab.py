"""A/B of decode_attention's least keys a split of a sequence (``_DECODE_SEQ_MIN_CHUNK``) as the decode model
calls it: B=1, 32 query / 8 KV heads, D=128, bf16, one cache a layer (32 layers, so the caches stream from
HBM), the 32 calls captured in one CUDA graph; us a layer at kv_len 1K of an 8K cache, 8K of 8K and 32K of
32K, for each minimum. Outputs checked against the reference once per (minimum, shape).

python3 benchmarks/scripts/decode_chunk_ab.py
"""
import statistics

import torch

import xelink.kernels.attention as attn
from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import decode_attention, reference_decode_attention

LAYERS, HQ, HKV, D = 32, 32, 8, 128


def main():
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(0), flush=True)
    q = torch.randn(1, HQ, 1, D, device=dev, generator=gen).to(torch.bfloat16)
    for smax, kv in [(8192, 1024), (8192, 8192), (32768, 32768), (32768, 2048)]:
        caches = [(torch.randn(1, HKV, smax, D, device=dev, generator=gen).to(torch.bfloat16),
                   torch.randn(1, HKV, smax, D, device=dev, generator=gen).to(torch.bfloat16)) for _ in range(LAYERS)]
        lens = torch.full((1,), kv, dtype=torch.int32, device=dev)
        ref = reference_decode_attention(q, *caches[0], lens).float()
        for chunk in (64, 128, 256):
            attn._DECODE_SEQ_MIN_CHUNK = chunk
            attn._PATHS.clear()  # plans made with the old minimum
            got = decode_attention(q, *caches[0], lens).float()
            err = float((got - ref).norm() / ref.norm())
            graph, _, _ = cuda_graph([lambda c=c: decode_attention(q, *c, lens) for c in caches], 1)
            us = statistics.median(time_cuda_events(graph.replay, warmup=3, iters=20)) * 1e6 / LAYERS
            print(f"cache {smax:6d} kv_len {kv:6d} min chunk {chunk:4d}: {us:7.2f} us a layer "
                  f"({2 * HKV * kv * D * 2 / us / 1e3:7.1f} GB/s), rel err {err:.1e}", flush=True)
            del graph
        del caches


if __name__ == "__main__":
    main()
