"""Where the gated GEMM's arrival rows lose their time at 2048x4096x4096 (issue 22), on one GPU, in CUDA graphs:

- ``flags set``: the GEMM alone, every flag set (the reference).
- ``copies beside``: the same GEMM with every flag set while the side stream copies A in as the arrival rows do
  (column slices, strided copy-engine copies) and writes no flag: what the copies cost the GEMM by running beside
  it, with no wait at all (the result is then not checked: the GEMM may read A before it lands).
- ``arrivals, flag copies``: the arrival row as ``run_gated`` times it (a 4-byte copy-engine copy sets the flag
  after each slice).
- ``arrivals, flag writes``: the flag set by ``cuStreamWriteValue32`` (a stream memory operation, no copy) instead.
- ``arrivals, flag ring``: flag copies, the flags a ring of one a call of the graph, the next call's zeroed on the
  copy stream after this call's copies instead of on the GEMM's stream after it (``run_gated``'s rows since the
  twenty-eighth session).

    python3 benchmarks/scripts/gated_arrivals_ab.py [slices ...]   (default 4 8)
"""
import ctypes
import statistics
import sys

import torch

from xelink import symm
from xelink.kernels.gated_gemm import column_slices, gated_gemm


def _write_value():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    return fn


def main() -> int:
    M, N, K = 2048, 4096, 4096
    src = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    a = src.clone()
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    want = (src.float() @ b.float())
    err = torch.zeros(64, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    write = _write_value()
    pitch = a.stride(0) * a.element_size()
    print(f"# {torch.cuda.get_device_name()}, {M}x{N}x{K}, CUDA graphs of 5 calls, median of 7 rounds")
    for slices in [int(x) for x in sys.argv[1:]] or (4, 8):
        bounds = column_slices(K, slices)
        counts = torch.arange(1, slices + 1, dtype=torch.int32, device="cuda")
        set_flags = torch.full((1,), slices, dtype=torch.int32, device="cuda")
        flags = torch.zeros(1, dtype=torch.int32, device="cuda")
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        opts = dict(chunk_rows=M, k_slices=slices, error=err, impl="cuda", timeout_ns=10**10, out=c)

        def copy_slices(flag_mode, flag=flags, reset=None):
            """The side stream's copies, ``flag`` set after each slice as ``flag_mode`` says, then ``reset``
            zeroed; returns the main stream."""
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for s, (lo, hi) in enumerate(bounds):
                    symm.copy_engine_2d(a[:, lo:].data_ptr(), pitch, src[:, lo:].data_ptr(), pitch,
                                        (hi - lo) * 2, M, side.cuda_stream)
                    if flag_mode == "copy":
                        flag.copy_(counts[s:s + 1], non_blocking=True)
                    elif flag_mode == "write":
                        rc = write(side.cuda_stream, flag.data_ptr(), s + 1, 0)
                        if rc != 0:
                            raise RuntimeError(f"cuStreamWriteValue32: CUDA driver error {rc}")
                if reset is not None:
                    reset.zero_()
            return main

        def flags_set():
            gated_gemm(a, b, set_flags, **opts)

        def beside():
            main = copy_slices(None)
            gated_gemm(a, b, set_flags, **opts)
            main.wait_stream(side)

        def arrivals(mode):
            main = copy_slices(mode)
            gated_gemm(a, b, flags, **opts)
            main.wait_stream(side)
            flags.zero_()

        # call i's flag: ring[i % 5], each 16-byte aligned alike (gated_gemm's plans are keyed by the alignment)
        ring, made = torch.zeros(5, 4, dtype=torch.int32, device="cuda")[:, :1], [0]

        def ring_arrivals():
            i = made[0]
            made[0] += 1
            main = copy_slices("copy", ring[i % 5], ring[(i + 1) % 5])
            gated_gemm(a, b, ring[i % 5], **opts)
            main.wait_stream(side)

        variants = {"flags set": flags_set, "copies beside": beside, "arrivals, flag copies": lambda: arrivals("copy"),
                    "arrivals, flag writes": lambda: arrivals("write"), "arrivals, flag ring": ring_arrivals}
        graphs = {}
        for name, fn in variants.items():
            try:
                fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(5):
                        fn()
                graphs[name] = g
            except Exception as e:  # noqa: BLE001 - reported, the other variants still run
                print(f"slices {slices} {name}: {type(e).__name__}: {str(e)[:200]}")
        times = {n: [] for n in graphs}
        for _ in range(7):
            for name, g in graphs.items():
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                times[name].append(e0.elapsed_time(e1) * 1e3 / 5)
                if name != "copies beside":
                    ok = ((c.float() - want).norm() / want.norm()).item() < 1e-2 and not c.isnan().any()
                    if not ok:
                        print(f"slices {slices} {name}: WRONG result")
        want_ring = torch.full_like(ring, slices)
        want_ring[1] = 0  # (the warm-up was call 0, the graph calls 1-5: the last zeroes the first's)
        if "arrivals, flag ring" in graphs and not torch.equal(ring, want_ring):
            print(f"slices {slices}: the flag ring is not as the calls leave it: {ring.tolist()}")
        base = statistics.median(times["flags set"])
        for name, t in times.items():
            med = statistics.median(t)
            print(f"slices {slices:>2} {name:<24} {med:7.1f} us  {base / med:6.3f} of flags set", flush=True)
        if err.any():
            print("note: a wait ran past its deadline:", err.tolist())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
