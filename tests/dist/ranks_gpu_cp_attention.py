"""Context-parallel attention on CUDA tensors with ranks sharing one GPU (peer memory between processes of one
device): both algorithms, both layouts, causal and not, GQA, bfloat16 (head dims 64 and 128, lengths the
block count does not divide), against one flash_attention over the whole sequence on the same GPU, sliced to
the rank's positions; a package layout (1+1 at 2 ranks, 2+1 at 3: the ring goes package after package);
back-to-back calls that change shape; CUDA-graph capture and replay with new inputs after a warm-up call of
the shape; gradients (the backward's point-to-point and reduce-scatter on CUDA tensors) against autograd of
float64 attention on the CPU; sliding windows (the halo exchange), forward and gradients; packed sequences
(cp_attention_varlen), forward and gradients. Skips without a GPU (CPU CI); run on a GPU machine, log committed."""
import torch

import xelink
from dist_cases import expect_errors, full_attention
from xelink.kernels import flash_attention, flash_attention_varlen

WORLD_SIZES = (2, 3)
GPUS = 1
LAUNCH_TIMEOUT = 600
# The same environment as tests/dist/ranks_gpu_dist_gemm.py (and tests/symm/ranks_gpu_symm.py): one launch.
ENV = {"XELINK_RANKS_PER_DEVICE": "4", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
ALGOS = ("ring", "all_gather")
LAYOUTS = ("zigzag", "contiguous")
PACKAGES = {2: [[0], [1]], 3: [[0, 1], [2]]}


def _dev(world):
    return torch.device(world.device)


def _qkv(B, hq, hkv, S, D, seed, dev, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, S, D, generator=g).to(dtype).to(dev) for h in (hq, hkv, hkv))


def _close(got, want, what, tol=2e-2):
    got, want = got.float().cpu(), want.float().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got.double() - want.double()).norm() / max(want.double().norm().item(), 1e-30)
    if not (err <= tol and torch.isfinite(got).all()):
        raise AssertionError(f"{what}: relative error {err:.3g} > {tol}")


def _case(comm, dev, B, hq, hkv, S, D, causal, layout, algo, seed):
    q, k, v = _qkv(B, hq, hkv, S, D, seed, dev)
    want, want_lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    pos = xelink.cp_positions(S, group=comm, layout=layout).to(dev)
    shard = lambda x: xelink.cp_shard(x, group=comm, layout=layout)  # noqa: E731
    out, lse = xelink.cp_attention(shard(q), shard(k), shard(v), causal=causal, group=comm, layout=layout, algo=algo,
                                   return_lse=True)
    what = f"S={S} D={D} hq={hq} hkv={hkv} causal={causal} {layout} {algo}"
    _close(out, want[:, :, pos], what)
    _close(lse, want_lse[:, :, pos], f"{what} lse", 1e-3)


def check_every_algo_layout_and_mask(world):
    dev = _dev(world)
    sub = world.split(0)
    sub.packages = PACKAGES[world.size]
    for name, comm in (("flat", world), (f"packages {PACKAGES[world.size]}", sub)):
        for layout in LAYOUTS:
            for algo in ALGOS:
                for causal in (False, True):
                    try:
                        _case(comm, dev, 1, 8, 2, 1000, 128, causal, layout, algo, 1)
                        _case(comm, dev, 2, 4, 4, 333, 64, causal, layout, algo, 2)
                    except AssertionError as e:
                        raise AssertionError(f"{name}: {e}") from None
    sub.free()
    xelink.synchronize()


def check_back_to_back_calls_change_shape(world):
    dev = _dev(world)
    for i, (S, D, causal, layout, algo) in enumerate(((512, 128, True, "zigzag", "ring"),
                                                      (77, 64, False, "contiguous", "ring"),
                                                      (512, 128, True, "zigzag", "all_gather"),
                                                      (2049, 128, True, "zigzag", "ring"),
                                                      (512, 128, True, "zigzag", "auto"))):
        _case(world, dev, 1, 4, 2, S, D, causal, layout, algo, 10 + i)
    xelink.synchronize()


def check_all_gather_holds_its_send_buffer_while_the_gather_runs(world):
    """algo="all_gather" gathers the packed KV on a side stream while the current stream attends. Its send buffer
    must live until the gather is joined: freed earlier, the caching allocator hands that memory to the current
    stream's next tensor of the size (here one filled with NaN as soon as the gather is started) while the gather,
    held back on its stream, has not read it yet; the other ranks then attend to NaN (the CP x TP training client's
    wrong loss, 0.1-0.8%, before 6117c39)."""
    from xelink.dist import cp_device, cp_engine

    dev = _dev(world)
    real_gather, real_start = cp_device.all_gather_into_tensor, cp_engine.gather_kv

    def late(stage, send, group):  # the gather starts about a millisecond late on the side stream
        torch.cuda._sleep(2_000_000)
        return real_gather(stage, send, group=group)

    def grab(comm, kv, lengths, start_gather):
        stage, work = real_start(comm, kv, lengths, start_gather)
        two, B, Hkv, _, D = kv.shape
        kv.new_empty((two, B, Hkv, max(lengths), D)).fill_(float("nan"))  # the send buffer's size, just freed
        return stage, work

    cp_device.all_gather_into_tensor, cp_engine.gather_kv = late, grab
    try:
        for seed in range(3):
            _case(world, dev, 1, 4, 2, 96 * world.size + 5, 64, True, "zigzag", "all_gather", 40 + seed)
    finally:
        cp_device.all_gather_into_tensor, cp_engine.gather_kv = real_gather, real_start
    xelink.synchronize()


def check_cuda_graph_replays_with_new_inputs(world):
    """cp_attention captured once per algorithm and with a sliding window (the halo exchange's point-to-point in
    the graph), each after an eager warm-up call of the shape, replayed with new inputs copied into the captured
    tensors; a rank sleeps before some replays so the peers run ahead."""
    dev, r = _dev(world), world.rank
    S, D, layout = 700, 128, "zigzag"
    pos = xelink.cp_positions(S, layout=layout).to(dev)
    local = pos.numel()
    q = torch.zeros(1, 8, local, D, dtype=torch.bfloat16, device=dev)
    k = torch.zeros(1, 2, local, D, dtype=torch.bfloat16, device=dev)
    v = torch.zeros_like(k)
    for algo, window in [(algo, None) for algo in ALGOS] + [("auto", 100)]:
        def step():
            return xelink.cp_attention(q, k, v, causal=True, layout=layout, algo=algo, seq_len=S, return_lse=True,
                                       window=window)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = step()
        for replay in range(3):
            fq, fk, fv = _qkv(1, 8, 2, S, D, 100 * replay + len(algo), dev)
            q.copy_(fq[:, :, pos])
            k.copy_(fk[:, :, pos])
            v.copy_(fv[:, :, pos])
            if replay % 2:
                torch.cuda._sleep(int(5e7 * (r + 1)))
            graph.replay()
            want, want_lse = flash_attention(fq, fk, fv, causal=True, return_lse=True, window=window)
            _close(out, want[:, :, pos], f"graph {algo} window {window} replay {replay}")
            _close(lse, want_lse[:, :, pos], f"graph {algo} window {window} replay {replay} lse", 1e-3)
        del graph
    xelink.synchronize()


def check_bad_arguments(world):
    dev = _dev(world)
    q = torch.ones(1, 4, 8, 64, device=dev, dtype=torch.bfloat16)
    cases = [(lambda: xelink.cp_attention(q, q.cpu(), q.cpu()), ValueError, "cp_attention: devices differ"),
             (lambda: xelink.cp_attention(q, q.float(), q.float()), TypeError, "cp_attention: dtypes differ")]
    expect_errors(cases)


def check_gradients_on_cuda(world):
    """dq, dk, dv (bfloat16, with the LSE in the loss) of both algorithms and layouts, causal, GQA, against
    autograd of float64 attention over the whole sequence on the CPU; twice in a row (buffers reused)."""
    dev = _dev(world)
    for layout in LAYOUTS:
        for algo in ALGOS:
            for S in (333, 1000):
                q, k, v = (t.cpu() for t in _qkv(1, 8, 2, S, 64, S, dev))
                g = torch.Generator().manual_seed(S + 1)
                dout, dlse = torch.randn(1, 8, S, 64, generator=g), torch.randn(1, 8, S, generator=g)
                full = [t.double().requires_grad_() for t in (q, k, v)]
                want_out, want_lse = full_attention(*full, True)
                ((want_out * dout).sum() + (want_lse * dlse).sum()).backward()
                shard = lambda x: xelink.cp_shard(x, layout=layout).to(dev)  # noqa: E731
                mine = [shard(t).requires_grad_() for t in (q, k, v)]
                out, lse = xelink.cp_attention(*mine, causal=True, layout=layout, algo=algo, return_lse=True)
                ((out.float() * shard(dout)).sum() + (lse * shard(dlse)).sum()).backward()
                for name, got, want in zip("qkv", mine, full):
                    assert got.grad.dtype == torch.bfloat16 and got.grad.device == dev, (name, got.grad)
                    _close(got.grad, xelink.cp_shard(want.grad, layout=layout), f"d{name} S={S} {layout} {algo}")
    xelink.synchronize()


def check_window_on_cuda(world):
    """A sliding window (the halo exchange: CUDA point-to-point between the ranks sharing the GPU): the output
    and LSE of both layouts, causal and not, windows of 1 key, shorter and longer than a block and the whole
    sequence, against one windowed flash_attention over the whole sequence; then dq, dk, dv (bfloat16, the LSE in
    the loss) against autograd of float64 windowed attention on the CPU, twice in a row."""
    dev = _dev(world)
    for layout in LAYOUTS:
        for causal in (True, False):
            for window in (1, 100, 300, 1000):
                q, k, v = _qkv(1, 8, 2, 1000, 128, window, dev)
                want, want_lse = flash_attention(q, k, v, causal=causal, return_lse=True, window=window)
                pos = xelink.cp_positions(1000, layout=layout).to(dev)
                shard = lambda x: xelink.cp_shard(x, layout=layout)  # noqa: E731
                out, lse = xelink.cp_attention(shard(q), shard(k), shard(v), causal=causal, layout=layout,
                                               return_lse=True, window=window)
                what = f"window={window} causal={causal} {layout}"
                _close(out, want[:, :, pos], what)
                _close(lse, want_lse[:, :, pos], f"{what} lse", 1e-3)
        for S in (333, 1000, 1000):
            q, k, v = (t.cpu() for t in _qkv(1, 8, 2, S, 64, S, dev))
            g = torch.Generator().manual_seed(S + 2)
            dout, dlse = torch.randn(1, 8, S, 64, generator=g), torch.randn(1, 8, S, generator=g)
            full = [t.double().requires_grad_() for t in (q, k, v)]
            want_out, want_lse = full_attention(*full, True, window=100)
            ((want_out * dout).sum() + (want_lse * dlse).sum()).backward()
            shard = lambda x: xelink.cp_shard(x, layout=layout).to(dev)  # noqa: E731
            mine = [shard(t).requires_grad_() for t in (q, k, v)]
            out, lse = xelink.cp_attention(*mine, causal=True, layout=layout, return_lse=True, window=100)
            ((out.float() * shard(dout)).sum() + (lse * shard(dlse)).sum()).backward()
            for name, got, want in zip("qkv", mine, full):
                assert got.grad.dtype == torch.bfloat16 and got.grad.device == dev, (name, got.grad)
                _close(got.grad, xelink.cp_shard(want.grad, layout=layout), f"window d{name} S={S} {layout}")
    xelink.synchronize()


def check_varlen_on_cuda(world):
    """Packed sequences (cp_attention_varlen: the gather on CUDA tensors, the Triton varlen kernels), both layouts:
    output and LSE of sequences inside and across the ranks' blocks, causal and not, with a window, head dims 64 and
    128, against one flash_attention_varlen over the whole packed batch on the same GPU; then dq, dk, dv (bfloat16, the
    LSE in the loss) against autograd of float64 attention of each sequence on the CPU, twice in a row (the second
    one KV head at a time, heads_k_stride=1)."""
    dev = _dev(world)
    cu = [0, 100, 101, 700, 1000, 1333]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    T = cu[-1]
    for layout in LAYOUTS:
        pos = xelink.cp_positions(T, layout=layout, cu_seqlens=cu_t)
        shard = lambda x, dim=0: x.index_select(dim, pos.to(x.device))  # noqa: E731
        for D in (64, 128):
            for causal in (True, False):
                for window in (None, 150):
                    g = torch.Generator().manual_seed(D + causal)
                    q, k, v = (torch.randn(T, h, D, generator=g).to(torch.bfloat16).to(dev) for h in (8, 2, 2))
                    want, want_lse = flash_attention_varlen(q, k, v, cu_t, cu_t, causal=causal, return_lse=True,
                                                            window=window)
                    out, lse = xelink.cp_attention_varlen(shard(q), shard(k), shard(v), cu_t, causal=causal,
                                                          layout=layout, return_lse=True, window=window)
                    what = f"varlen {layout} D={D} causal={causal} window={window}"
                    _close(out, shard(want), what)
                    _close(lse, shard(want_lse, 1), f"{what} lse", 1e-3)
        for stride in (None, 1):
            g = torch.Generator().manual_seed(7)
            q, k, v = (torch.randn(T, h, 64, generator=g).to(torch.bfloat16) for h in (8, 2, 2))
            dout, dlse = torch.randn(T, 8, 64, generator=g), torch.randn(8, T, generator=g)
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            outs, lses = [], []
            for a, b in zip(cu, cu[1:]):
                o, s = full_attention(*(t[a:b].transpose(0, 1)[None] for t in ref), True)
                outs.append(o[0].transpose(0, 1))
                lses.append(s[0])
            ((torch.cat(outs) * dout).sum() + (torch.cat(lses, 1) * dlse).sum()).backward()
            mine = [shard(t).to(dev).requires_grad_() for t in (q, k, v)]
            out, lse = xelink.cp_attention_varlen(*mine, cu_t, causal=True, layout=layout, return_lse=True,
                                                  heads_k_stride=stride)
            ((out.float() * shard(dout).to(dev)).sum() + (lse * shard(dlse, 1).to(dev)).sum()).backward()
            for name, got, want in zip("qkv", mine, ref):
                assert got.grad.dtype == torch.bfloat16 and got.grad.device == dev, (name, got.grad)
                _close(got.grad, shard(want.grad), f"varlen {layout} stride={stride} d{name}")
    xelink.synchronize()
