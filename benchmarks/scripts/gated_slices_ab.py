"""Where the gated GEMM's column-slice path loses time with every flag set (issue 22): the TMA kernel's per-load
wait (``gated_gemm._SLICE_WAIT``) swapped for diagnostic variants, each in its own process (Triton keys its cache on
the constexpr), timed by ``run_gated`` (rows and slices, flags set and copy-engine arrivals).

    python3 benchmarks/scripts/gated_slices_ab.py [variant ...]

Variants: ``acquire`` (the kept wait: every thread polls with ld.acquire.sys), ``relaxed`` (ld.relaxed.sys: no
ordering, a diagnostic only), ``gpu`` (ld.acquire.gpu: orders the copy engine's writes on this GPU, not a peer's),
``none`` (no poll: the wait returns max(known, need), so what is left is the loop's other work; wrong under real
arrivals, so its arrival rows are not meaningful). (0bb083e's script also had ``nodiv``, every load waiting for
all slices, and ``nodep``, the loads' coordinates independent of the wait: the tile then divided by K a load, which
they showed cost 3-7%; the tile now counts slices without dividing.) ``--copies``: the copy engine alone, 8
copies of 2048 rows of a 4096-column bf16 matrix, contiguous row chunks against column slices of every row
(``symm.copy_engine_2d``), in a CUDA graph. ``--chunks``: the kept wait at 2048x4096x4096 with 4, 8 and 16 chunks of
rows / column slices (``run_gated``'s ``chunks``; b0091b5 ran it as ``gated_chunks_ab.py``).
"""
import importlib
import subprocess
import sys

VARIANTS = ("acquire", "relaxed", "gpu", "none")


def copies() -> None:
    import torch

    from xelink import symm

    M, K, n = 2048, 4096, 8
    src = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream()
    pitch = K * 2

    def rows():
        for q in range(n):
            dst[q * M // n:(q + 1) * M // n].copy_(src[q * M // n:(q + 1) * M // n], non_blocking=True)

    def slices(k=n):
        for lo in range(0, K, K // k):
            symm.copy_engine_2d(dst[:, lo:].data_ptr(), pitch, src[:, lo:].data_ptr(), pitch, (K // k) * 2, M,
                                torch.cuda.current_stream().cuda_stream)

    for name, fn in (("8 row chunks (contiguous)", rows), ("8 column slices (1 KB a row)", slices),
                     ("4 column slices (2 KB a row)", lambda: slices(4)), ("2 column slices (4 KB a row)",
                                                                          lambda: slices(2))):
        with torch.cuda.stream(side):
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                for _ in range(5):
                    fn()
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(side)
                g.replay()
                b.record(side)
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / 5)
        t = sorted(times)[2]
        ok = torch.equal(dst, src)
        dst.zero_()
        print(f"copies {name:<30} {t:8.1f} us for 16 MiB ({M * K * 2 / t / 1e3:6.1f} GB/s), right: {ok}", flush=True)


def patch(variant: str) -> None:
    gg = importlib.import_module("xelink.kernels.gated_gemm")
    text = gg._SLICE_WAIT.value
    if variant == "relaxed":
        text = text.replace("ld.acquire.sys.global", "ld.relaxed.sys.global")
    elif variant == "gpu":
        text = text.replace("ld.acquire.sys.global", "ld.acquire.gpu.global")
    elif variant == "none":
        text = "{ max.s32 $0, $2, $3; }"
    elif variant != "acquire":
        raise SystemExit(f"unknown variant {variant!r}: {', '.join(VARIANTS)}")
    gg._SLICE_WAIT = gg.tl.constexpr(text)


def one(variant: str) -> None:
    import torch

    from xelink.bench.families.gemm import ROW_BLOCK_SHAPES, run_gated
    from xelink.bench.kernel_timing import KernelReport

    patch(variant)
    report = KernelReport()
    run_gated(report, ROW_BLOCK_SHAPES, rounds=3)
    print(f"# variant {variant}, {torch.cuda.get_device_name()}")
    print_rows(f"{variant:>8}", report)


def chunks() -> None:
    from xelink.bench.families.gemm import run_gated
    from xelink.bench.kernel_timing import KernelReport

    for n in (4, 8, 16):
        report = KernelReport()
        run_gated(report, [(2048, 4096, 4096)], chunks=n, rounds=5)
        print_rows(f"chunks {n:>2}", report)


def print_rows(label: str, report) -> None:
    """The TMA kernel's rows of a ``run_gated`` report (time, ratio to torch.matmul, to its flags-set row)."""
    for r in report.rows:
        if "triton" in r.path:
            continue
        vs = r.extra.get("vs_flags_set")
        print(f"{label} {r.extra['shape']:>16} {r.path:<62} {r.time_us:9.1f} us {(r.ratio or 1.0):6.3f}x torch"
              f"{'' if vs is None else f' {vs:6.3f} of flags set'} #wrong {r.wrong}", flush=True)
    for n in report.notes:
        print("note:", n)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(sys.argv[2])
        return 0
    if sys.argv[1:] == ["--copies"]:
        copies()
        return 0
    if sys.argv[1:] == ["--chunks"]:
        chunks()
        return 0
    rc = 0
    for v in sys.argv[1:] or VARIANTS:
        rc |= subprocess.run([sys.executable, __file__, "--one", v]).returncode
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
