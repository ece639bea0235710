"""What the kernel modules share: the guarded Triton import, the one ``impl`` vocabulary, argument and
``out=`` checks, and device queries.

Every public kernel takes ``impl=`` from one vocabulary (:data:`IMPLS`): ``"auto"``, ``"triton"`` (the
portable Triton kernel), ``"cuda"`` (the NVIDIA-specific kernel: TMA/persistent kernels, inline PTX) and
``"reference"`` (pure torch); each module's ``*_IMPLS`` constant says which of the four its kernels
take. Old spellings are accepted through :data:`IMPL_ALIASES`, mapped here and nowhere else.

Kernels that write into a caller's buffer (``out=``) check it with :func:`check_out` (shape, dtype,
device, strides: traceable, so it runs before a ``torch.compile`` trace too) and, just before they
launch, with :func:`check_no_overlap` (addresses: eager tensors only).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import weakref

import torch

try:  # Kernel modules import without Triton; the Triton paths then raise a clear error when asked for.
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton without host-side tensor descriptors (older, or Intel's): no TMA paths
    TensorDescriptor = None

__all__ = ["IMPLS", "IMPL_ALIASES", "TensorDescriptor", "auto_takes_triton", "capability", "check_distinct",
           "check_impl", "check_no_overlap", "check_out", "check_same_device", "check_tensor", "forward_only",
           "interpreting", "require_triton", "spans_overlap",
           "cdiv", "gc_paused", "geometry", "host_values", "next_power_of_2", "path_key", "Paths", "sm_count", "tl",
           "triton", "triton_can_run"]

IMPLS = ("auto", "triton", "cuda", "reference")
IMPL_ALIASES = {"hopper": "cuda"}  # the Hopper TMA kernels of gemm and flash attention were "hopper" before


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, as ``triton.cdiv``; on the host use this one: ``triton.cdiv`` is a
    ``@triton.jit`` function, and calling it from Python goes through the JIT's ``__call__`` (a few
    microseconds each, measured on an H200: issue 20's host-time rows)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``, without its JIT call."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def geometry(t: torch.Tensor) -> tuple:
    """What a kernel's checks and launch choices read of a tensor, and no address: shape, strides, dtype,
    device and whether the base is 16-byte aligned (Triton specializes on it; TMA needs it)."""
    return (t.shape, t.stride(), t.dtype, t.device, (t.data_ptr() & 15) == 0)


_OPTION_TYPES = frozenset((str, bool, int, float, type(None)))
_TENSOR = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def path_key(options: tuple, tensors: tuple, optional: tuple = (), grad_ok: bool = False):
    """The key a kernel's eager call is remembered under in its :class:`Paths`, or None when the call
    must run its checks: traced, an option that is not a plain str/bool/int/float/None, a tensor (or a
    non-None ``optional`` tensor) that is not a plain ``torch.Tensor`` or that requires grad in grad mode
    (:func:`forward_only` decides its path; ``grad_ok``: a differentiable call's key, whose options say so),
    or a first tensor not on CUDA.
    Options enter with their classes (``True`` and ``1`` differ) and tensors by :func:`geometry`. An
    invalid option needs no test here: only calls whose checks passed are remembered."""
    # One flat tuple built in plain loops, each tensor's geometry() inlined: half the host time of nested
    # generator-made tuples (~1 us a call).
    if _is_compiling():
        return None
    grad = _grad_enabled() and not grad_ok
    key = []
    for o in options:
        if o.__class__ not in _OPTION_TYPES:
            return None
        key.append(o.__class__)
        key.append(o)
    for t in tensors:
        if t.__class__ is not _TENSOR or (grad and t.requires_grad):
            return None
        key.append((t.shape, t.stride(), t.dtype, t.device, (t.data_ptr() & 15) == 0))
    if key[len(options) * 2][3].type != "cuda":  # the first tensor's device
        return None
    for t in optional:
        if t is None:
            key.append(None)
        elif t.__class__ is not _TENSOR or (grad and t.requires_grad):
            return None
        else:
            key.append((t.shape, t.stride(), t.dtype, t.device, (t.data_ptr() & 15) == 0))
    return tuple(key)


# Values already read on the host (host_values), by tensor and version counter.
_HOST_VALUES: dict = {}


def host_values(t: torch.Tensor) -> list:
    """``t.tolist()``, a device tensor's read once a tensor and version: a training step's layers passing one
    ``cu_seqlens`` tensor make its values cross to the host (a sync) once a step, not once a layer. An in-place write
    bumps the version; a tensor that died leaves a dead reference, never a match. (Writes torch does not see, e.g.
    through ``.data`` or a Triton kernel's into the tensor, are not noticed: pass a new tensor then.) A CPU tensor
    (no sync to save; numpy views write it unseen) and an inference-mode one (no version) are read every call."""
    if t.device.type == "cpu":
        return t.tolist()
    try:
        version = t._version
    except RuntimeError:
        return t.tolist()
    hit = _HOST_VALUES.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == version:
        return hit[2]
    if len(_HOST_VALUES) >= 64:
        _HOST_VALUES.clear()
    vals = t.tolist()
    _HOST_VALUES[id(t)] = (weakref.ref(t), version, vals)
    return vals


class Paths(dict):
    """Eager calls that passed every check, remembered by a key of everything the checks read (the
    ``geometry`` of each tensor, the options), so that the next equal call is a dictionary lookup instead
    of the checks (tens of microseconds of host time). Bounded: past ``LIMIT`` entries all are forgotten."""

    LIMIT = 4096

    def remember(self, key, value) -> None:
        if len(self) >= self.LIMIT:
            self.clear()
        self[key] = value


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_impl(fn: str, impl, allowed) -> str:
    """``impl`` in the one vocabulary (aliases mapped), checked against ``allowed``, the paths ``fn`` has."""
    if not isinstance(impl, str):
        raise TypeError(f"{fn}: impl={impl!r} must be a str, one of {', '.join(allowed)}")
    name = IMPL_ALIASES.get(impl, impl)
    if name not in allowed:
        why = f" ({fn} has no {name} kernel)" if name in IMPLS else ""
        alias = f"; {impl!r} is an old name of {name!r}" if name != impl else ""
        raise ValueError(f"{fn}: impl={impl!r} is not one of {', '.join(allowed)}{why}{alias}")
    return name


def forward_only(fn: str, impl: str, *, has_reference: bool = True, **inputs) -> str:
    """``impl`` (checked by :func:`check_impl`) as autograd allows it. The kernels are forward only: where
    grad mode is on and one of ``inputs`` requires grad, ``"auto"`` becomes ``"reference"`` (torch ops,
    differentiable: the result and gradients CPU ranks get) and a named kernel path raises, instead of
    returning an output that silently leaves the autograd graph. A kernel without a reference path
    (``has_reference=False``) raises for ``"auto"`` too.

    Raises:
        ValueError: a kernel path for an input that requires grad.
    """
    if impl == "reference" or not torch.is_grad_enabled():
        return impl
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if impl == "auto" and has_reference:
                return "reference"
            how = ", or pass impl='auto' or 'reference' (torch ops, differentiable)" if has_reference else ""
            raise ValueError(f"{fn}: {name} requires grad, but impl={impl!r} is forward only (no backward); call "
                             f"it under torch.no_grad() or torch.inference_mode(){how}")
    return impl


def check_tensor(fn: str, name: str, t, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{fn}: {name}.shape={tuple(t.shape)} must have {ndim} dims")


def check_same_device(fn: str, **tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"{fn}: tensors must be on one device ({listed})")


def _overlaps_itself(t: torch.Tensor) -> bool:
    # Sufficient for distinct elements: with the dims of size > 1 sorted by stride, each stride reaches
    # past the whole extent of the dims inside it (a stride 0 or a broadcast fails).
    reach = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < reach:
            return True
        reach = stride * size
    return False


def check_out(fn: str, out, shape, dtype: torch.dtype, device: torch.device) -> None:
    """``out`` can take a kernel's output of ``shape`` and ``dtype`` on ``device``: any view (a row or
    column block of a larger buffer) with unit stride along the last dim and no two elements at one address.
    Looks at shapes and strides only, so it runs under ``torch.compile`` too."""
    check_tensor(fn, "out", out)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{fn}: out.shape={tuple(out.shape)} must be {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{fn}: out.dtype={out.dtype} must be {dtype}")
    if out.device != device:
        raise ValueError(f"{fn}: out is on {out.device}, the inputs on {device}")
    if out.dim() and out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"{fn}: out.stride()={out.stride()} must be 1 along the last dim (the kernels store "
                         "rows of contiguous elements)")
    check_distinct(fn, "out", out)


def check_distinct(fn: str, name: str, t: torch.Tensor) -> None:
    """No two elements of the output ``t`` at one address (an expanded view, a stride 0): a write would race."""
    if _overlaps_itself(t):
        raise ValueError(f"{fn}: {name}.stride()={t.stride()} for {name}.shape={tuple(t.shape)} puts several "
                         "elements at one address")


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses ``t`` can touch; empty for an empty tensor."""
    if t.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (on one device) may touch the same bytes: their address ranges meet, so two
    interleaved views of one buffer (column blocks) count even where no element is shared: conservative, and a
    few host operations (a precise test of arbitrary strides is not). Not their storages: a tensor made from a
    numpy view has a storage of its own, starting at the view."""
    (a_lo, a_hi), (b_lo, b_hi) = byte_span(a), byte_span(b)
    return a_lo < b_hi and b_lo < a_hi


def check_no_overlap(fn: str, out: torch.Tensor, **inputs) -> None:
    """``out`` shares no memory with the tensors in ``inputs`` (None entries skipped), which a kernel reads
    while it writes ``out`` (``spans_overlap``)."""
    for name, t in inputs.items():
        if t is not None and t.device == out.device and spans_overlap(out, t):
            raise ValueError(f"{fn}: out overlaps {name} in memory (out must not share memory with an input)")


def triton_can_run(device: torch.device) -> bool:
    """True when a Triton kernel can run on tensors of ``device`` (a GPU, or any device when interpreting)."""
    if triton is None:
        return False
    return device.type in ("cuda", "xpu") or interpreting()


def auto_takes_triton(device: torch.device) -> bool:
    """``impl="auto"`` runs a Triton kernel on GPUs; elsewhere (CPU tensors, interpreter included) the
    reference, so interpreting stays opt-in per call (``impl="triton"``)."""
    return triton is not None and device.type in ("cuda", "xpu")


def require_triton(fn: str, impl: str, device: torch.device) -> None:
    if triton is None:
        raise RuntimeError(f"{fn}: impl={impl!r} needs Triton, which is not installed; use impl='reference'")
    if not triton_can_run(device):
        raise ValueError(f"{fn}: impl={impl!r} needs CUDA or XPU tensors, got device {device} "
                         "(use impl='reference', or set TRITON_INTERPRET=1 to interpret Triton on the CPU)")


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors (CUDA) or subslices (XPU) of ``device``: what grids are sized by."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        props = torch.xpu.get_device_properties(device)
        return int(getattr(props, "gpu_subslice_count", 0) or getattr(props, "max_compute_units", 64))
    return 8  # the interpreter: a few, so grids stay short and decode still splits (tests exercise the merge)


@contextlib.contextmanager
def gc_paused(collect: bool = True):
    """Around a CUDA-graph capture: Python's cyclic collector first (``collect``), then not at all until the
    block ends (it is switched back on if it was on).

    A ``CUDAGraph`` held in a reference cycle (a model and the decode graph it caches hold each other) is
    freed whenever the collector happens to run; inside another capture its destructor's
    ``cudaGraphExecDestroy`` is refused and invalidates that capture (torch stopped collecting at capture
    start). Collecting first also frees such dead graphs' memory before the new graph takes its own."""
    if collect:
        gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

