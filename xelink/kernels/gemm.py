"""Dense GEMM ``c = a @ b`` in Triton (bf16/fp16 inputs, fp32 accumulation) and its pure-torch twin.

Two Triton paths:

- ``impl="triton"``: the portable kernel. Block pointers (``tl.make_block_ptr``) over any strides, so
  row- and column-major inputs and every M, N, K (tails) go through one kernel; it uses only features
  Intel's Triton 3.3 also has.
- ``impl="cuda"`` (old name ``"hopper"``): for compute capability 9.x. A persistent kernel (one program
  per multiprocessor, tiles handed out in L2-friendly groups) that moves tiles with TMA through
  host-built tensor descriptors and flattens the tile and K loops into one software pipeline, so the
  next tile's loads overlap the current tile's epilogue. TMA needs 16-byte aligned bases and strides
  (of ``out`` too), so ``auto`` picks it only when those hold.

``impl="auto"`` takes the TMA kernel where it applies, else the portable kernel on a GPU, else the
reference (CPU tensors). Setting ``TRITON_INTERPRET=1`` lets the Triton paths run on CPU tensors
through Triton's interpreter (tests on tiny shapes).

``out=`` writes the product into a caller's ``[M, N]`` view (a row block ``big[r0:r1]`` or a column
block ``big[:, c0:c1]`` of a larger buffer), so composed ops need no copy.
"""
from __future__ import annotations

import torch

from .common import (Paths, TensorDescriptor, auto_takes_triton, capability, cdiv, check_impl, check_no_overlap,
                     check_out, check_same_device, check_tensor, forward_only, interpreting, path_key, require_triton,
                     sm_count, tl, triton)
from .launcher import Descriptor, Slot, launch_keyed
from .pdl import pdl_launch, pdl_launch_args, pdl_option, pdl_wait

__all__ = ["GEMM_IMPLS", "gemm", "reference_gemm"]

GEMM_IMPLS = ("auto", "triton", "cuda", "reference")
_FLOAT16 = (torch.bfloat16, torch.float16)


# -- reference ------------------------------------------------------------------------------------

def reference_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` computed in float32 and rounded once to ``a.dtype``: what the kernels compute.

    Args:
        a: ``[M, K]``, bf16 or fp16.
        b: ``[K, N]``, same dtype.

    Returns:
        ``[M, N]`` in ``a.dtype``, row-major.
    """
    return (a.float() @ b.float()).to(a.dtype)


# -- kernels --------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
        # GROUP_M consecutive row-blocks walk the column-blocks together, so a wave of programs shares
        # its A rows and B columns in L2 instead of streaming all of B once per row-block.
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % rows
        pid_n = (tile % per_group) // rows
        return pid_m, pid_n

    @triton.jit
    def _block_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, off_m, off_n,
                    A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr, EVEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The fp32 tile ``a[off_m:+BLOCK_M] @ b[:, off_n:+BLOCK_N]`` through block pointers (any strides)."""
        # `order` names the fastest-moving dimension first, which tells the compiler how to vectorize.
        if A_ROW_MAJOR:
            a_blk = tl.make_block_ptr(a_ptr, (M, K), (stride_am, stride_ak), (off_m, 0), (BLOCK_M, BLOCK_K),
                                      order=(1, 0))
        else:
            a_blk = tl.make_block_ptr(a_ptr, (M, K), (stride_am, stride_ak), (off_m, 0), (BLOCK_M, BLOCK_K),
                                      order=(0, 1))
        if B_ROW_MAJOR:
            b_blk = tl.make_block_ptr(b_ptr, (K, N), (stride_bk, stride_bn), (0, off_n), (BLOCK_K, BLOCK_N),
                                      order=(1, 0))
        else:
            b_blk = tl.make_block_ptr(b_ptr, (K, N), (stride_bk, stride_bn), (0, off_n), (BLOCK_K, BLOCK_N),
                                      order=(0, 1))
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            if EVEN:
                a = tl.load(a_blk)
                b = tl.load(b_blk)
            else:
                a = tl.load(a_blk, boundary_check=(0, 1), padding_option="zero")
                b = tl.load(b_blk, boundary_check=(0, 1), padding_option="zero")
            acc = tl.dot(a, b, acc)
            a_blk = tl.advance(a_blk, (0, BLOCK_K))
            b_blk = tl.advance(b_blk, (BLOCK_K, 0))
        return acc

    @triton.jit
    def _store_tile(c_ptr, acc, M, N, stride_cm, stride_cn, off_m, off_n, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        c_blk = tl.make_block_ptr(c_ptr, (M, N), (stride_cm, stride_cn), (off_m, off_n), (BLOCK_M, BLOCK_N),
                                  order=(1, 0))
        tl.store(c_blk, acc.to(c_ptr.dtype.element_ty), boundary_check=(0, 1))

    @triton.jit
    def _tma_tile(a_desc, b_desc, off_m, off_n, K, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The fp32 tile ``a[off_m:+BLOCK_M] @ b[:, off_n:+BLOCK_N]`` through TMA descriptors."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for off_k in range(0, K, BLOCK_K):
            a, b = _tma_operands(a_desc, b_desc, off_m, off_n, off_k, A_ROW_MAJOR, B_ROW_MAJOR)
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _tma_operands(a_desc, b_desc, off_m, off_n, off_k, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr):
        """The K block at ``off_k`` of a tile's operands: ``a`` [BLOCK_M, BLOCK_K], ``b`` [BLOCK_K, BLOCK_N]."""
        # Column-major operands are described by their transpose, which is row-major, and
        # transposed back in shared memory (wgmma reads either orientation of 16-bit types).
        if A_ROW_MAJOR:
            a = a_desc.load([off_m, off_k])
        else:
            a = a_desc.load([off_k, off_m]).T
        if B_ROW_MAJOR:
            b = b_desc.load([off_k, off_n])
        else:
            b = b_desc.load([off_n, off_k]).T
        return a, b

    @triton.jit
    def _gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                     A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)  # a and b may be the previous kernel's output
        pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        acc = _block_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m * BLOCK_M,
                          pid_n * BLOCK_N, A_ROW_MAJOR, B_ROW_MAJOR, EVEN, BLOCK_M, BLOCK_N, BLOCK_K)
        pdl_launch(PDL)
        _store_tile(c_ptr, acc, M, N, stride_cm, stride_cn, pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_M, BLOCK_N)

    @triton.jit
    def _gemm_tma_kernel(a_desc, b_desc, c_desc, M, N, K,
                         A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        # flatten=True fuses the tile loop and the K loop into one pipelined loop: the loads of the next
        # tile are already in flight while this tile's accumulator is converted and stored.
        for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = _grouped_tile(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = _tma_tile(a_desc, b_desc, off_m, off_n, K, A_ROW_MAJOR, B_ROW_MAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
        pdl_launch(PDL)  # the tile loop holds the epilogue: the go comes after the last tile


# -- host side ------------------------------------------------------------------------------------

def _orientation(t: torch.Tensor) -> bool | None:
    """True for row-major, False for column-major, None for neither (a size-1 dim accepts either)."""
    rows, cols = t.shape
    if t.stride(1) == 1 or cols == 1:
        return True
    if t.stride(0) == 1 or rows == 1:
        return False
    return None


def _tma_view(t: torch.Tensor):
    """(shape, strides) of ``t`` (or of ``t.T`` when column-major) as a row-major matrix for TMA; the
    descriptor's base is ``t`` itself (the same address), so no view is made.

    A single-row matrix's row stride is never used, whatever torch reports for it (often 1); TMA still
    needs a multiple of 16 bytes there, so it gets the padded row length.
    """
    if _orientation(t):
        (rows, cols), lead = t.shape, t.stride(0)
    else:
        (cols, rows), lead = t.shape, t.stride(1)
    if rows <= 1:
        lead = -(-cols * t.element_size() // 16) * 16 // t.element_size()
    return (rows, cols), (lead, 1)


def _tma_ok(t: torch.Tensor) -> bool:
    # TMA: 16-byte aligned base and every non-unit stride a multiple of 16 bytes.
    if t.data_ptr() % 16 or _orientation(t) is None:
        return False
    _, (lead, _) = _tma_view(t)
    return lead > 0 and (lead * t.element_size()) % 16 == 0


def _tma_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The TMA kernel can take these inputs: sm90 (or the interpreter) and TMA's alignment."""
    if triton is None or TensorDescriptor is None:
        return False
    cap = capability(a.device)
    if cap is None:
        if not interpreting():
            return False
    elif cap[0] != 9:
        return False
    n = b.shape[1]
    return _tma_ok(a) and _tma_ok(b) and (n * a.element_size()) % 16 == 0


def _tma_out_ok(out: torch.Tensor | None) -> bool:
    # out is stored through a TMA descriptor of its row-major view (check_out made its last stride 1).
    return out is None or _tma_ok(out)


def _gemm_config(M: int, N: int, K: int) -> dict:
    # 128x256x64 with 8 warps: two warpgroups, each owning 64x256 of the accumulator (128 fp32
    # registers a thread), a 48 KiB stage, so 3 stages plus the 64 KiB epilogue tile fit in shared
    # memory. Measured on H200 (benchmarks/results/h200-kernels): the best of the tried shapes at 4096^3,
    # 8192^3 and 16384x8192x1024 for both kernels. Problems with fewer tiles than multiprocessors take
    # 128x128 to spread out.
    if cdiv(M, 128) * cdiv(N, 256) >= 132:
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


def _gemm_output(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None):
    """(c, done): the [M, N] output (``out``, or a new row-major tensor), and True when it is already
    final (empty, or K == 0: zeros)."""
    M, K = a.shape
    N = b.shape[1]
    c = a.new_empty((M, N)) if out is None else out  # (new_empty: ~1 us less host time than torch.empty)
    if M == 0 or N == 0:
        return c, True
    if K == 0:
        return c.zero_(), True
    return c, False


class _Launch:
    """How one gemm path launches, worked out from the shapes, strides and config alone (no addresses):
    the kernel, its grid, the descriptors' fields (``cuda``) or the integer arguments, the constexprs and
    launch options, and (for a remembered path) the launcher slot that skips the launcher's key."""

    __slots__ = ("fn", "grid", "views", "ints", "kwargs", "slot", "shape")

    def __init__(self, a, b, c, impl: str, pdl: str, cfg: dict, remembered: bool):
        (M, K), N = a.shape, b.shape[1]
        self.shape = (M, N)
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        a_row, b_row = _orientation(a), _orientation(b)
        if impl == "cuda":
            # Descriptors over the row-major view; the kernel transposes column-major tiles back. c's
            # descriptor has c's own shape, so a tile past its last row or column (out a block of a wider
            # buffer) is clipped.
            self.fn = _gemm_tma_kernel
            self.views = (_tma_view(a) + ((bm, bk) if a_row else (bk, bm),),
                          _tma_view(b) + ((bk, bn) if b_row else (bn, bk),), _tma_view(c) + ((bm, bn),))
            self.ints = (M, N, K)
            programs = max(1, min(cdiv(M, bm) * cdiv(N, bn), sm_count(a.device)))
            self.grid = (programs,)
            self.kwargs = dict(A_ROW_MAJOR=bool(a_row), B_ROW_MAJOR=bool(b_row), NUM_PROGRAMS=programs, **cfg,
                               **pdl_launch_args(pdl, programs, a.device))
        else:
            self.fn, self.views = _gemm_kernel, None
            self.ints = (M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
            even = M % bm == 0 and N % bn == 0 and K % bk == 0
            self.grid = (cdiv(M, bm) * cdiv(N, bn),)
            self.kwargs = dict(A_ROW_MAJOR=a_row is not False, B_ROW_MAJOR=b_row is not False, EVEN=even, **cfg,
                               **pdl_launch_args(pdl, self.grid[0], a.device))
        self.slot = Slot(self.fn) if remembered else None

    def __call__(self, a, b, c) -> None:
        # the addresses are all that may differ from call to call (no slot: a plan used once)
        launch_keyed(self.slot, (a.data_ptr(), b.data_ptr(), c.data_ptr()), self.grid, lambda: self._args(a, b, c),
                     self.kwargs, self.fn)

    def _args(self, a, b, c) -> tuple:
        if self.views is None:
            return (a, b, c) + self.ints
        av, bv, cv = self.views
        return (Descriptor(a, *av), Descriptor(b, *bv), Descriptor(c, *cv)) + self.ints


def _pick_gemm_impl(a, b, impl: str, out) -> str:
    """``auto`` resolved, and the chosen path checked against the tensors (pointers: not traceable)."""
    if impl == "auto":
        if not auto_takes_triton(a.device):
            return "reference"
        return "cuda" if _tma_applies(a, b) and _tma_out_ok(out) else "triton"
    if impl in ("triton", "cuda"):
        require_triton("gemm", impl, a.device)
    if impl == "cuda" and not _tma_applies(a, b):
        raise ValueError(f"gemm: impl='cuda' needs a compute capability 9.x GPU, Triton tensor descriptors, "
                         f"row- or column-major inputs with 16-byte aligned pointers and strides and N*itemsize "
                         f"a multiple of 16 (got a.stride()={a.stride()}, b.stride()={b.stride()}, N={b.shape[1]}); "
                         "use impl='triton'")
    if impl == "cuda" and not _tma_out_ok(out):
        raise ValueError(f"gemm: impl='cuda' stores through TMA, which needs out at a 16-byte aligned address with "
                         f"a row stride of a multiple of 16 bytes (got out.data_ptr() % 16 = {out.data_ptr() % 16}, "
                         f"out.stride()={out.stride()}); use impl='triton' or 'auto'")
    return impl


def _gemm_run(a, b, impl: str, pdl: str, out=None, cfg: dict | None = None) -> torch.Tensor:
    """The eager call (also the custom op's body): path picked, then ``_gemm_launch``."""
    return _gemm_launch(a, b, _pick_gemm_impl(a, b, impl, out), pdl, out, cfg)


def _gemm_launch(a, b, impl: str, pdl: str, out=None, cfg: dict | None = None) -> torch.Tensor:
    """The picked path: ``out`` checked against the inputs (addresses), the output made, the launch (a
    :class:`_Launch` worked out for this call; ``gemm`` runs a remembered path's own)."""
    if out is not None:
        check_no_overlap("gemm", out, a=a, b=b)
    if impl == "reference":
        c = reference_gemm(a, b)
        return c if out is None else out.copy_(c)
    c, done = _gemm_output(a, b, out)
    if not done:
        _Launch(a, b, c, impl, pdl, cfg or _gemm_config(a.shape[0], b.shape[1], a.shape[1]), False)(a, b, c)
    return c


@torch.library.custom_op("xelink::gemm", mutates_args=("out",))
def _gemm_op(a: torch.Tensor, b: torch.Tensor, impl: str, pdl: str, out: torch.Tensor) -> None:
    _gemm_run(a, b, impl, pdl, out)


@_gemm_op.register_fake
def _gemm_fake(a, b, impl, pdl, out):
    return None


def _check_gemm(a, b, impl, out, pdl) -> tuple[str, str]:
    """Every check that needs no pointer; returns (impl, pdl option), impl still "auto" on a GPU."""
    fn = "gemm"
    impl = check_impl(fn, impl, GEMM_IMPLS)
    check_tensor(fn, "a", a)
    check_tensor(fn, "b", b)
    impl = forward_only(fn, impl, a=a, b=b)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm: a and b must be 2-D, got a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)}")
    if a.dtype not in _FLOAT16:
        raise TypeError(f"gemm: a.dtype={a.dtype} must be torch.bfloat16 or torch.float16")
    if b.dtype != a.dtype:
        raise TypeError(f"gemm: b.dtype={b.dtype} must equal a.dtype={a.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: a.shape[1]={a.shape[1]} != b.shape[0]={b.shape[0]} (a is [M, K], b is [K, N])")
    check_same_device(fn, a=a, b=b)
    if out is not None:
        check_out(fn, out, (a.shape[0], b.shape[1]), a.dtype, a.device)
    if impl == "auto" and not auto_takes_triton(a.device):
        impl = "reference"
    # None is off: a GEMM worth this kernel is compute-bound, and PDL pays where launches dominate
    # (the decode chain's GEMVs and norms); so gemm's launches stay as they were unless asked.
    pdl = "off" if pdl is None else pdl_option(fn, pdl, impl, a.device)
    return impl, pdl


# gemm()'s checks and path choice on CUDA tensors, by everything they read: impl, pdl (None or False:
# off either way), the shapes, strides, dtypes and devices of a, b and out, and the 16-byte alignment of
# their bases (TMA). Only passed checks are kept, so a hit is the same checks passing again, for a
# dictionary lookup instead of ~10 us of Python; what reads addresses (out overlapping an input) runs
# every call. The value is (impl, pdl, the path's _Launch): its grid, descriptor fields and kernel
# arguments follow from the same key, and its launcher slot may skip the launcher's own key because this
# key decides every argument's class (launcher.Slot's promise).
_PATHS = Paths()


def gemm(a: torch.Tensor, b: torch.Tensor, impl: str = "auto", *, out: torch.Tensor | None = None, pdl=None,
         config: dict | None = None) -> torch.Tensor:
    """``c = a @ b`` with fp32 accumulation, rounded once to the input dtype.

    Args:
        a: ``[M, K]`` bf16 or fp16; row- or column-major (other strides work on the portable path).
        b: ``[K, N]``, same dtype and device; row- or column-major.
        impl: ``"auto"`` (the TMA kernel on compute capability 9.x when TMA's alignment holds, else the
            portable Triton kernel on a GPU, else the reference), ``"triton"`` (portable, block
            pointers), ``"cuda"`` (TMA + persistent, sm90; ``"hopper"`` is its old name) or ``"reference"``
            (torch, float32).
        out: optional ``[M, N]`` tensor of a's dtype and device to write ``c`` into: any view with unit
            stride along N (``big[r0:r1]``, ``big[:, c0:c1]``) that shares no memory with a or b (address
            ranges compared: interleaved views of one buffer count as shared). ``impl="cuda"`` also needs
            its base 16-byte aligned and its row stride a multiple of 16 bytes; ``auto`` takes the
            portable kernel where that fails.
        pdl: programmatic dependent launch (``pdl.py``; a Triton path on CUDA sm90+): None or False (off:
            gemm's launches as they always were), True (the next kernel's go early when the grid fits the
            GPU at once, as the persistent kernel's does, else after the main loop), ``"early"`` or
            ``"late"``; True/"early"/"late" elsewhere are an error.
        config: tuning override for the Triton paths (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``,
            ``num_warps``, ``num_stages``), for benchmarks; eager calls only (a traced call uses the table).

    Returns:
        ``out``, or a new ``[M, N]`` row-major tensor in ``a.dtype``.

    Raises:
        TypeError: a non-tensor, a dtype other than bf16/fp16, mixed dtypes, out of another dtype.
        ValueError: shapes that do not chain, mixed devices, an unknown impl, an impl that cannot run on
            these tensors, a bad out (shape, device, strides, memory shared with an input) or pdl.
    """
    # pdl on is not remembered: its check reads the environment (TRITON_INTERPRET).
    key = path_key((impl, pdl), (a, b), (out,)) if config is None and (pdl is None or pdl is False) else None
    path = _PATHS.get(key) if key is not None else None
    if path is not None:
        plan = path[2]
        if plan is None:  # the reference, or an empty product
            return _gemm_launch(a, b, path[0], path[1], out)
        if out is None:
            c = a.new_empty(plan.shape)  # (new_empty: ~1 us less host time than torch.empty)
        else:
            check_no_overlap("gemm", out, a=a, b=b)
            c = out
        plan(a, b, c)
        return c
    impl, pdl = _check_gemm(a, b, impl, out, pdl)
    if torch.compiler.is_compiling():  # traced: the custom op (fake implementation), which picks the path
        out = a.new_empty((a.shape[0], b.shape[1])) if out is None else out
        torch.ops.xelink.gemm(a, b, impl, pdl, out)
        return out
    # Eager (CUDA graph capture included): launch directly; custom-op dispatch costs tens of
    # microseconds of host time a call.
    if key is None:
        return _gemm_run(a, b, impl, pdl, out, config)
    impl = _pick_gemm_impl(a, b, impl, out)
    c = _gemm_launch(a, b, impl, pdl, out)
    (M, K), N = a.shape, b.shape[1]
    plan = None
    if impl != "reference" and M and N and K:  # c has the geometry of every later call's output
        plan = _Launch(a, b, c, impl, pdl, _gemm_config(M, N, K), True)
    _PATHS.remember(key, (impl, pdl, plan))
    return c
