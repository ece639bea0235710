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

Every one of these functions takes one ``pdl`` argument (None, True, False, "early" or "late"), checked
by :func:`pdl_option` and turned into launch arguments by :func:`pdl_launch_args`; what None means and
where True lets the next kernel go are each kernel's (measured) choice, in its docstring.
"""
from __future__ import annotations

import torch

from .common import capability, interpreting, sm_count, tl, triton

__all__ = ["PDL_MODES", "pdl_launch", "pdl_launch_args", "pdl_option", "pdl_wait"]

PDL_MODES = {False: 0, "early": 1, "late": 2}  # config value -> the kernels' PDL constexpr

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
else:  # no Triton: the kernel modules import, their Triton paths refuse to run
    pdl_wait = pdl_launch = None


def pdl_option(fn: str, pdl, impl: str, device: torch.device, *, name: str = "pdl") -> str:
    """Check a ``pdl`` argument before anything runs; returns "auto", "off", "early" or "late".
    ``impl``: the path that will run (any but "reference" is a Triton kernel); ``name``: what the caller
    called the argument, for the error. None: on where it exists (Triton kernels on CUDA sm90+, not
    interpreted); True: the same, required; "early" / "late": where the next kernel is let go, required;
    False: off."""
    if not (pdl is None or isinstance(pdl, bool) or (isinstance(pdl, str) and pdl in ("early", "late"))):
        raise ValueError(f"{fn}: {name}={pdl!r} must be None, True, False, 'early' or 'late'")
    sm90 = impl != "reference" and not interpreting() and (capability(device) or (0, 0)) >= (9, 0)
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
    benchmarks/results/h200-kernels run 15)."""
    if option == "auto":
        option = "early" if programs <= sm_count(device) else "late"
    mode = PDL_MODES[False if option == "off" else option]
    return dict(PDL=mode, launch_pdl=True) if mode else dict(PDL=0)
