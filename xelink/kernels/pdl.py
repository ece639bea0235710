"""Programmatic dependent launch (CUDA sm90+) for the kernels that use it (gemv, every kernel with
``impl="cuda"``).

A kernel launched with ``launch_pdl=True`` may be placed on the GPU while the kernel before it in the
stream still runs. It calls :func:`pdl_wait` before it reads or writes any memory (``griddepcontrol.wait``:
the previous kernel finished and its writes are visible) and lets the next kernel launch
(``griddepcontrol.launch_dependents``) right after that wait (mode 1, "early") or, by
:func:`pdl_launch`, once its own main loop is done (mode 2, "late"); mode 0 compiles to nothing. Back
to back, one kernel's launch and placement then overlap the other's tail. Both helpers are
``triton.jit`` functions, callable from Triton and Gluon kernels alike.
"""
from __future__ import annotations

from .gemm import tl, triton

__all__ = ["PDL_MODES", "pdl_launch", "pdl_wait"]

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
