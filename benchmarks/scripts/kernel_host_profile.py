"""Where the host time of one eager kernel call goes (gemm 2048^3, rmsnorm 8x4096, flash/decode attention,
gemv, qgemm), on one GPU.

Each piece of the eager path is timed on its own (median of rounds of ``CALLS`` back-to-back calls,
the GPU kept busy by ``torch.cuda._sleep`` so that no call waits for the device), next to the whole
call and torch's equivalent; then cProfile lists the Python functions of the whole call.

python3 benchmarks/scripts/kernel_host_profile.py [gemm] [norm] [attention] [gemv] [qgemm]   (default: all)
"""
import cProfile
import importlib
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from xelink.bench import kernel_timing
from xelink.kernels import launcher
from xelink.kernels.common import sm_count
from xelink.ops import decode_attention, flash_attention, gemm, gemv, qgemm, rmsnorm

attn = importlib.import_module("xelink.kernels.attention")
gemv_mod = importlib.import_module("xelink.kernels.gemv")
qgemm_mod = importlib.import_module("xelink.kernels.qgemm")
gemm_mod = importlib.import_module("xelink.kernels.gemm")  # the module (the package re-exports the function)
norm = importlib.import_module("xelink.kernels.norm")
CALLS, ROUNDS = 200, 7


def busy():
    kernel_timing.busy(20_000)  # 20 ms


def per_call_us(fn, gpu=True):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    got = []
    for _ in range(ROUNDS):
        if gpu:
            busy()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        got.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(got)


def row(name, fn, gpu=True):
    try:
        print(f"{name:58s} {per_call_us(fn, gpu):8.2f} us", flush=True)
    except Exception as e:  # a piece that cannot run alone: say so, go on
        print(f"{name:58s} failed: {type(e).__name__}: {e}", flush=True)


def profile(name, fn, n=3000):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        if i % 200 == 0:  # the GPU drained, then kept busy: no launch waits for a full queue
            torch.cuda.synchronize()
            busy()
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"== cProfile of {n} calls of {name}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main():
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    want = sys.argv[1:] or ["gemm", "norm", "attention", "gemv", "qgemm"]
    if "gemm" in want:
        gemm_rows(dev)
    if "norm" in want:
        norm_rows(dev)
    if "attention" in want:
        attention_rows(dev)
    if "gemv" in want:
        gemv_rows(dev)
    if "qgemm" in want:
        qgemm_rows(dev)


def gemm_rows(dev):
    M = N = K = 2048
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    print("-- gemm 2048^3 bf16")
    row("torch.matmul(a, b)", lambda: torch.matmul(a, b))
    row("torch.matmul(a, b, out=c)", lambda: torch.matmul(a, b, out=c))
    row("gemm(a, b, impl='cuda')", lambda: gemm(a, b, impl="cuda"))
    row("gemm(a, b, impl='triton')", lambda: gemm(a, b, impl="triton"))
    row("gemm(a, b) auto", lambda: gemm(a, b))
    row("gemm(a, b, impl='cuda', out=c)", lambda: gemm(a, b, impl="cuda", out=c))
    row("torch.empty((M, N), dtype, device)", lambda: torch.empty((M, N), dtype=a.dtype, device=a.device))
    row("a.new_empty((M, N))", lambda: a.new_empty((M, N)))
    row("torch.empty(M, N, dtype=, device=)", lambda: torch.empty(M, N, dtype=a.dtype, device=a.device))
    row("a.device", lambda: a.device, gpu=False)
    row("a.shape, a.stride(), a.dtype, a.data_ptr()", lambda: (a.shape, a.stride(), a.dtype, a.data_ptr()), gpu=False)
    row("path_key (gemm's)", lambda: gemm_mod.path_key(("cuda", None), (a, b), (None,)), gpu=False)
    row("_gemm_config", lambda: gemm_mod._gemm_config(M, N, K), gpu=False)
    cfg = gemm_mod._gemm_config(M, N, K)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]

    def descs():
        return (launcher.Descriptor(a, *gemm_mod._tma_view(a), (bm, bk)),
                launcher.Descriptor(b, *gemm_mod._tma_view(b), (bk, bn)),
                launcher.Descriptor(c, *gemm_mod._tma_view(c), (bm, bn)))

    row("3 Descriptors with _tma_view", descs, gpu=False)
    row("sm_count(a.device)", lambda: sm_count(a.device), gpu=False)
    for impl in ("cuda", "triton"):
        plan = gemm_mod._Launch(a, b, c, impl, "off", cfg, True)
        row(f"_Launch(impl={impl!r}, remembered)(a, b, c): no checks, no alloc", lambda: plan(a, b, c))
    row("_Launch(impl='cuda', not remembered)(a, b, c)", lambda: gemm_mod._Launch(a, b, c, "cuda", "off", cfg, False)(a, b, c))
    ad, bd, cd = descs()
    programs = min(triton_cdiv(M, bm) * triton_cdiv(N, bn), sm_count(dev))
    args = (ad, bd, cd, M, N, K)
    kw = dict(A_ROW_MAJOR=True, B_ROW_MAJOR=True, NUM_PROGRAMS=programs, **cfg, PDL=0)
    row("launcher.launch(tma kernel, prebuilt args)", lambda: launcher.launch(gemm_mod._gemm_tma_kernel, (programs,), *args, **kw))
    k = launcher._KERNELS[id(gemm_mod._gemm_tma_kernel)]
    t = launcher._T
    row("launcher._key", lambda: launcher._key(t, k, args, kw), gpu=False)
    row("launcher._T.quiet", lambda: t.quiet(gemm_mod._gemm_tma_kernel), gpu=False)
    row("triton knobs: runtime.debug + instrumentation_mode", lambda: (t.runtime.debug, t.compilation.instrumentation_mode), gpu=False)
    key, full, device = launcher._key(t, k, args, kw)
    e = k.entries[key]
    row("launcher._expand (cached descriptors)", lambda: launcher._expand(t, e, full), gpu=False)
    x = launcher._expand(t, e, full)
    stream = t.get_stream(device)

    def raw():
        e.raw(programs, 1, 1, stream, e.function, e.coop, e.pdl, None, None, e.packed, None, None, None, *x)

    row("C launcher alone (expanded args)", raw)
    row("torch._C._cuda_getCurrentRawStream", lambda: t.get_stream(device), gpu=False)
    # Does a fresh output keep its address from call to call (so the TMA descriptor cache hits), and does the
    # remembered plan's slot hold its kernel?
    pp = gemm_mod._PATHS.get(gemm_mod.path_key(("cuda", None), (a, b), (None,)))
    se = pp[2].slot.entry if pp is not None and pp[2] is not None else None
    print(f"remembered plan: slot entry {'set' if se is not None else 'EMPTY (every call takes launch())'}", flush=True)
    if se is not None:
        for _, _, cache in se.descs:
            cache.clear()
    ptrs, fast0 = set(), k.fast
    for _ in range(50):
        ptrs.add(gemm(a, b, impl="cuda").data_ptr())
    torch.cuda.synchronize()
    print(f"gemm(a, b, impl='cuda') x50: {len(ptrs)} distinct output addresses; descriptors cached per operand "
          f"{[len(cache) for _, _, cache in se.descs] if se is not None else '?'}; fast launches {k.fast - fast0}",
          flush=True)
    # The whole call with the C launcher replaced by a no-op: what is Python and allocation, what the launch.
    if se is not None:
        raw = se.raw
        se.raw = lambda *args: None
        try:
            row("gemm(a, b, impl='cuda') with a no-op C launcher", lambda: gemm(a, b, impl="cuda"))
            row("gemm(a, b, impl='cuda', out=c) with a no-op C launcher", lambda: gemm(a, b, impl="cuda", out=c))
        finally:
            se.raw = raw
    outs = []
    row("gemm(a, b, impl='cuda'), outputs kept (no reuse)", lambda: outs.append(gemm(a, b, impl="cuda"))
        if len(outs) < 64 else outs.clear())
    row("torch.matmul(a, b), outputs kept (no reuse)", lambda: outs.append(torch.matmul(a, b))
        if len(outs) < 64 else outs.clear())
    outs.clear()
    profile("gemm(a, b, impl='cuda')", lambda: gemm(a, b, impl="cuda"))
    profile("gemm(a, b, impl='triton')", lambda: gemm(a, b, impl="triton"))


def norm_rows(dev):
    print("-- rmsnorm 8x4096 bf16")
    x8 = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16)
    r8 = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    row("F.rms_norm", lambda: F.rms_norm(x8, (4096,), w, 1e-6))
    row("rmsnorm(x, w) (pdl auto)", lambda: rmsnorm(x8, w))
    row("rmsnorm(x, w, pdl=False)", lambda: rmsnorm(x8, w, pdl=False))
    row("rmsnorm(x, w, residual=r)", lambda: rmsnorm(x8, w, residual=r8))
    row("norm._rmsnorm_triton(x, w, eps, None, 'off')", lambda: norm._rmsnorm_triton(x8, w, 1e-6, None, "off"))
    row("norm._rmsnorm_triton(x, w, eps, None, 'auto')", lambda: norm._rmsnorm_triton(x8, w, 1e-6, None, "auto"))
    row("torch.empty(shape) + reshape + 2 views", lambda: (torch.empty(x8.shape, dtype=x8.dtype, device=x8.device),
                                                           x8.reshape(-1, 4096), x8.view(-1, 4096), x8.view(-1, 4096)), gpu=False)
    profile("rmsnorm(x, w)", lambda: rmsnorm(x8, w))


def attention_rows(dev):
    print("-- flash_attention B=1 H=32 S=512 D=128 bf16")
    q, k, v = (torch.randn(1, 32, 512, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q)
    row("F.scaled_dot_product_attention", lambda: F.scaled_dot_product_attention(q, k, v))
    for impl in ("cuda", "triton"):
        row(f"flash_attention(impl={impl!r})", lambda: flash_attention(q, k, v, impl=impl))
        row(f"flash_attention(impl={impl!r}, out=o)", lambda: flash_attention(q, k, v, impl=impl, out=o))
        row(f"attn._flash_forward({impl!r})", lambda: attn._flash_forward(q, k, v, False, 0.088, impl))
    row("path_key(flash, q, k, v, out None)", lambda: attn.path_key(("flash", "cuda", None, False, None, False),
                                                                    (q, k, v), (None,)), gpu=False)
    row("torch.empty_like(q) + torch.empty(lse)", lambda: (torch.empty_like(q, memory_format=torch.contiguous_format),
                                                          torch.empty((1, 32, 512), dtype=torch.float32, device=dev)))
    row("3 Descriptors", lambda: [attn.Descriptor(t, (32 * 512, 128), (128, 1), (128, 128)) for t in (q, k, v)],
        gpu=False)
    row("pdl_launch_args('off', 128, dev)", lambda: attn.pdl_launch_args("off", 128, dev), gpu=False)
    row("_tma_ok(q, k, v)", lambda: attn._tma_ok(q, k, v), gpu=False)
    profile("flash_attention(impl='cuda')", lambda: flash_attention(q, k, v, impl="cuda"))
    print("-- decode_attention B=1 Hq=32 Hkv=8 S=4096 D=128 bf16")
    qd = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, 8, 4096, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((1,), 4096, dtype=torch.int32, device=dev)
    kr, vr = kc.repeat_interleave(4, 1), vc.repeat_interleave(4, 1)
    row("F.scaled_dot_product_attention (repeated KV)", lambda: F.scaled_dot_product_attention(qd, kr, vr))
    row("decode_attention", lambda: decode_attention(qd, kc, vc, lens))
    row("attn._decode_forward", lambda: attn._decode_forward(qd, kc, vc, lens, False, 0.088, 0))
    row("attn._decode_splits", lambda: attn._decode_splits(qd, kc, 64), gpu=False)
    profile("decode_attention", lambda: decode_attention(qd, kc, vc, lens))


def gemv_rows(dev):
    print("-- gemv 1x4096 @ 4096x4096^T bf16, w4a16 4096x14336")
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    x8 = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16)
    w4, s4 = gemv_mod.pack_w4a16(torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16))
    x4 = torch.randn(1, 14336, device=dev, dtype=torch.bfloat16)
    row("torch.matmul(x, w.t())", lambda: torch.matmul(x, w.t()))
    row("F.linear(x, w)", lambda: F.linear(x, w))
    for impl in ("cuda", "triton"):
        row(f"gemv(w, x, impl={impl!r})", lambda: gemv(w, x, impl=impl))
        row(f"gemv(w, x8, impl={impl!r})", lambda: gemv(w, x8, impl=impl))
        row(f"gemv(w4, x4, s4, 'w4a16', impl={impl!r})", lambda: gemv(w4, x4, s4, "w4a16", impl=impl))
    row("_gemv_run(w, x, cuda)", lambda: gemv_mod._gemv_run(w, x, None, "bf16", "cuda", "auto"))
    row("path_key(gemv)", lambda: gemv_mod.path_key(("bf16", "auto", None), (x, w), (None, None)), gpu=False)
    row("_default_config", lambda: gemv_mod._default_config(1, 4096, 4096, "bf16", 132, True), gpu=False)
    profile("gemv(w, x)", lambda: gemv(w, x))
    profile("gemv(w, x8)", lambda: gemv(w, x8))


def qgemm_rows(dev):
    print("-- qgemm 512x14336 @ w4a16 4096x14336 (a 512-token prefill's down projection), 16 rows x w8a16 4096x4096")
    w4, s4 = gemv_mod.pack_w4a16(torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16))
    w8, s8 = gemv_mod.pack_w8a16(torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16))
    x4 = torch.randn(512, 14336, device=dev, dtype=torch.bfloat16)
    x8 = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
    wd = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
    row("torch.matmul(x, w.t()) (dense bf16, the same shape)", lambda: torch.matmul(x4, wd.t()))
    row("qgemm(w4, x, s4, 'w4a16')", lambda: qgemm(w4, x4, s4, "w4a16"))
    row("qgemm(w8, x16, s8, 'w8a16')", lambda: qgemm(w8, x8, s8, "w8a16"))
    row("_qgemm_run(w4, x, s4)", lambda: qgemm_mod._qgemm_run(w4, x4, s4, "w4a16", "triton"))
    M, K = x4.shape
    cfg = dict(qgemm_mod._config(M, 4096, K, sm_count(dev), True), BLOCK_K=qgemm_mod._BLOCK_K)
    y = x4.new_empty((M, 4096))
    tiles = triton_cdiv(M, cfg["BLOCK_M"]) * triton_cdiv(4096, cfg["BLOCK_N"])
    args = (x4, w4, s4, y, y, y, M, 4096, K, x4.stride(0), x4.stride(1), w4.stride(0), s4.stride(0), y.stride(0),
            y.stride(1))
    opts = dict(W4=True, TILED=False, FP16=False, **cfg)
    if cfg["SPLIT_K"] == 1:  # (a K split reads scratch counters: the model's shape here splits none)
        row("its kernel: Triton's JIT call (before)", lambda: qgemm_mod._qgemm_kernel[(tiles, 1)](*args, **opts))
        row("its kernel: launcher.launch (now)", lambda: launcher.launch(qgemm_mod._qgemm_kernel, (tiles, 1), *args,
                                                                        **opts))
    profile("qgemm(w4, x, s4, 'w4a16')", lambda: qgemm(w4, x4, s4, "w4a16"))


def triton_cdiv(a, b):
    return -(-a // b)


if __name__ == "__main__":
    main()
