"""Programmatic dependent launch (CUDA sm90+) for the kernels of a decode step: gemv, rmsnorm, rope and
decode_attention (one split kernel, merged in-kernel), and gemm (off unless asked for).

A kernel launched with ``launch_pdl=True`` may be placed on the GPU while the kernel before it in the
stream still runs. It calls :func:`pdl_wait` before it reads or writes any memory (``griddepcontrol.wait``:
the previous kernel finished and its writes are visible) and lets the next kernel launch
(``griddepcontrol.launch_dependents``) right after that wait (mode 1, "early") or, by
:func:`pdl_launch`, once its own main loop is done (mode 2, "late"); mode 0 compiles to nothing. Back
to back, one kernel's launch and placement then overlap the other's tail (a W4A16 decode layer on the
H200: 5-8% faster with every kernel under PDL, 1% with the GEMVs alone; benchmarks/results/h200-kernels
run 16). Both helpers are ``triton.jit`` functions, callable from Triton and Gluon kernels alike.

Prefetch under PDL (:func:`prefetch_l2`; Triton only, gemv_tc.py has its Gluon twin): a kernel placed early
may, before :func:`pdl_wait`, ask L2 for the start of what it will read (a quantized GEMV's weight rows, decode
attention's cache rows), so the first loads after the wait find L2 and HBM is busy while the previous kernel
ends. It is a hint (``cp.async.bulk.prefetch.L2``, sm90) and nothing it fetches is used as such: L2 is where
the GPU's memory is coherent, so a line prefetched before the previous kernel writes it is updated there, and
every value the kernel uses is still loaded after the wait; results do not change (tests/kernels/
test_prefetch.py: the kernel before writes the very bytes). ``XELINK_PREFETCH=0`` turns it off,
``XELINK_PREFETCH_MB`` bounds a launch's (:func:`prefetch_bytes`).

Every one of these functions takes one ``pdl`` argument (None, True, False, "early" or "late"), checked
by :func:`pdl_option` and turned into launch arguments by :func:`pdl_launch_args`; what None means and
where True lets the next kernel go are each kernel's (measured) choice, in its docstring.
"""
from __future__ import annotations

import torch

from ..config import env, env_flag, env_int
from .common import capability, interpreting, sm_count, tl, triton

__all__ = ["PDL_MODES", "PREFETCH_ASM", "pdl_launch", "pdl_launch_args", "pdl_option", "pdl_wait", "prefetch_args",
           "prefetch_bytes", "prefetch_l2", "sm90_kernel"]

# MiB a launch prefetches at most, over its first programs (each kernel sets what a program asks for): the
# first wave's start, not its whole input. On an H200 (benchmarks/results/h200-issue26) a GEMV chain whose
# every program prefetched its whole slice ran 25% slower (the next matrix pushed the current one out of
# L2), and decode attention gained most at about 8 MB of its 33 MB of cache at 8K.
DEFAULT_PREFETCH_MB = 8
# The quantized GEMVs' own default (their launches pass it): a W4A16 Llama-3.1-8B step (tiled weights) took 2.193 /
# 2.477 ms at 1K / 8K on an H200 with 2 MB a launch against 2.260 / 2.549 with 8 MB and 2.242 / 2.523 without
# (benchmarks/results/h200-issue26/prefetch_ab.log); an H100 had 2 MB best too (benchmarks/results/h100-rows).
GEMV_PREFETCH_MB = 2
# Benchmarks' A/B switches, read when a launch is planned: None takes XELINK_PREFETCH / XELINK_PREFETCH_MB.
PREFETCH: bool | None = None
PREFETCH_BYTES: int | None = None
ROW_BYTES = 64 << 10  # what a program prefetches of one row (a GEMV's weight row, decode's keys) at most

PDL_MODES = {False: 0, "early": 1, "late": 2}  # config value -> the kernels' PDL constexpr

# Ask L2 for [$1, $1 + $2) widened to 16-byte bounds (the bulk prefetch's alignment; the widened range stays
# inside the same 16-byte blocks, so inside mapped memory); nothing where $2 <= 0. Shared with gemv_tc's Gluon.
PREFETCH_ASM = """{
    .reg .pred p;
    .reg .b64 a, e;
    setp.gt.s32 p, $2, 0;
    cvta.to.global.u64 a, $1;
    cvt.s64.s32 e, $2;
    add.s64 e, a, e;
    add.s64 e, e, 15;
    and.b64 e, e, -16;
    and.b64 a, a, -16;
    sub.s64 e, e, a;
    cvt.u32.u64 $0, e;
    @p cp.async.bulk.prefetch.L2.global [a], $0;
    }"""

if triton is not None:
    _WAIT = tl.constexpr("griddepcontrol.wait; // $0")
    _LAUNCH = tl.constexpr("griddepcontrol.launch_dependents; // $0")

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Kernel entry (PDL > 0): wait for the previous kernel; PDL == 1: then let the next one launch."""
        if PDL > 0:
            tl.inline_asm_elementwise(_WAIT, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        if PDL == 1:
            tl.inline_asm_elementwise(_LAUNCH, "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def pdl_launch(PDL: tl.constexpr):
        """After the main loop (PDL == 2): let the next kernel launch."""
        if PDL == 2:
            tl.inline_asm_elementwise(_LAUNCH, "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    _PREFETCH_L2 = tl.constexpr(PREFETCH_ASM)

    @triton.jit
    def prefetch_l2(rows, row_bytes, PIECES: tl.constexpr, LIMIT: tl.constexpr):
        """Prefetch into L2 ``row_bytes`` (a scalar), at most LIMIT, from each pointer of ``rows`` (a 1-D
        tensor), each range cut into PIECES bulk prefetches (rows x PIECES about the program's threads)."""
        start = rows.to(tl.pointer_type(tl.uint8))
        row_bytes = tl.minimum(row_bytes, LIMIT).to(tl.int32)
        piece = (tl.cdiv(row_bytes, PIECES) + 15) // 16 * 16
        at = tl.arange(0, PIECES) * piece
        size = tl.minimum(piece, row_bytes - at)
        ptrs = start[:, None] + at[None, :]
        tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l,r", [ptrs, tl.broadcast_to(size[None, :], ptrs.shape)],
                                  dtype=tl.int32, is_pure=False, pack=1)
else:  # no Triton: the kernel modules import, their Triton paths refuse to run
    pdl_wait = pdl_launch = prefetch_l2 = None


def prefetch_bytes(pdl_mode: int, device: torch.device, gemv: bool = False) -> int:
    """The bytes a launch with PDL constexpr ``pdl_mode`` prefetches before its wait at most, over its first
    programs (``XELINK_PREFETCH_MB``, else ``DEFAULT_PREFETCH_MB``, a quantized GEMV's (``gemv``)
    ``GEMV_PREFETCH_MB``), or 0: off without PDL (no early placement to use), below sm90 (the bulk prefetch) and
    with ``XELINK_PREFETCH=0``."""
    on = PREFETCH if PREFETCH is not None else env("XELINK_PREFETCH") is None or env_flag("XELINK_PREFETCH")
    if not (on and pdl_mode > 0 and (capability(device) or (0, 0)) >= (9, 0)):
        return 0
    if PREFETCH_BYTES is not None:
        return PREFETCH_BYTES
    return env_int("XELINK_PREFETCH_MB", GEMV_PREFETCH_MB if gemv else DEFAULT_PREFETCH_MB, 0) << 20


def prefetch_args(pdl_mode: int, device: torch.device, rows: int, row_bytes: int, warps: int | None = None,
                  gemv: bool = False) -> dict:
    """A kernel's prefetch constexprs for programs of ``rows`` ranges of ``row_bytes`` each: ``PREFETCH``, the
    programs (the first ones) that prefetch within the launch's :func:`prefetch_bytes` (``gemv``: a quantized
    GEMV's), ``LIMIT``, the bytes of a range they ask for (at most ``ROW_BYTES``), and with ``warps`` (a Triton
    kernel's, for :func:`prefetch_l2`) ``PIECES``, a range's pieces so that each thread issues one; {} where the
    prefetch is off."""
    total = prefetch_bytes(pdl_mode, device, gemv)
    if not total:
        return {}
    limit = min(row_bytes, ROW_BYTES)
    args = dict(PREFETCH=max(1, total // (limit * rows)), LIMIT=limit)
    if warps is not None:
        args["PIECES"] = max(1, 32 * warps // rows)
    return args


def sm90_kernel(impl: str, device: torch.device) -> bool:
    """Whether path ``impl`` (any but "reference" is a Triton kernel) runs compiled on a CUDA GPU of compute
    capability >= 9.0, where griddepcontrol and the bulk L2 prefetch exist."""
    return impl != "reference" and not interpreting() and (capability(device) or (0, 0)) >= (9, 0)


def pdl_option(fn: str, pdl, impl: str, device: torch.device, *, name: str = "pdl") -> str:
    """Check a ``pdl`` argument before anything runs; returns "auto", "off", "early" or "late".
    ``impl``: the path that will run (any but "reference" is a Triton kernel); ``name``: what the caller
    called the argument, for the error. None: on where it exists (Triton kernels on CUDA sm90+, not
    interpreted); True: the same, required; "early" / "late": where the next kernel is let go, required;
    False: off."""
    if not (pdl is None or isinstance(pdl, bool) or (isinstance(pdl, str) and pdl in ("early", "late"))):
        raise ValueError(f"{fn}: {name}={pdl!r} must be None, True, False, 'early' or 'late'")
    sm90 = sm90_kernel(impl, device)
    if pdl is None or pdl is False:
        return "auto" if pdl is None and sm90 else "off"
    if not sm90:
        raise ValueError(f"{fn}: {name}={pdl!r} needs a Triton kernel on a CUDA GPU of compute capability >= 9.0 "
                         f"(griddepcontrol), got impl={impl!r} on {device}")
    return "auto" if pdl is True else pdl


def pdl_launch_args(option: str, programs: int, device: torch.device) -> dict:
    """A kernel's ``PDL`` constexpr and launch option for ``option`` (from :func:`pdl_option`): "auto"
    lets the next kernel go early when the grid fits on the GPU at once (decode: a few rows) and late
    otherwise, where early programs would crowd the running grid (the GEMV sweeps,
    benchmarks/results/h200-kernels run 15); "release" (a kernel's own choice, not an argument) is launched
    in stream order, not placed early itself, and lets the next kernel go late (its wait then returns at once;
    :func:`prefetch_args` is off for it: nothing to overlap before the wait)."""
    if option == "release":
        return dict(PDL=PDL_MODES["late"])
    if option == "auto":
        option = "early" if programs <= sm_count(device) else "late"
    mode = PDL_MODES[False if option == "off" else option]
    return dict(PDL=mode, launch_pdl=True) if mode else dict(PDL=0)
