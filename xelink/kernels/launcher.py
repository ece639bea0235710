"""Eager launches of ``@triton.jit`` kernels with a few microseconds of host time.

``launch(kernel, grid, *args, **kwargs)`` does what ``kernel[grid](*args, **kwargs)`` does. The first
call of a *specialization* (below) goes through Triton's JIT, which compiles (or loads) the kernel,
checks every argument and launches it; the compiled kernel is remembered under the call's key, and a
later call with an equal key goes straight to that kernel's C launcher with the arguments as they are
(tensors, ints, floats; host tensor descriptors already turned into the CUtensorMap plus the shape and
stride integers the launcher takes). Triton 3.6's ``kernel[grid](...)`` spends tens of microseconds of
host time a call on binding, per-argument specialization (a C call per argument), its cache key,
launch metadata and hooks, and (Hopper kernels) a new CUtensorMap per descriptor (issue 20: an eager
``gemm`` cost 92-104 us of host time on an H200, ``torch.matmul`` 17-21 us); this path does none of that
once the key is known: binding and the key in Python, one dictionary lookup, the C launcher.

The key. Triton compiles one kernel per (device, the class of every argument, the constexpr values,
the launch options, two global knobs) and the key holds each of those, never less:

- the current CUDA device (Triton's ``driver.active.get_current_device()``, where the kernel was loaded);
- a tensor argument: its dtype and whether ``data_ptr()`` is a multiple of 16;
- an int: 1 (Triton turns it into a constant), else its range (i32, i64 or u64) and whether it is a
  multiple of 16; a bool (u1) and a float (fp32) by type alone; None (a constant);
- a host tensor descriptor: its dtype, block shape and padding (Triton's ``tensordesc<dtype[block]>``);
- a constexpr parameter: its type and value (``True`` and ``1`` differ);
- every other keyword (``num_warps``, ``num_stages``, ``launch_pdl``, ...): name, type and value, in call order;
- ``triton.knobs.runtime.debug``, ``triton.knobs.compilation.instrumentation_mode`` and the kernel's
  ``debug`` flag (Triton adds them to the options it compiles with).

Where Triton is coarser (``do_not_specialize`` parameters, ints that are not constants) the key still
tells the classes apart: such calls only get their own entry for the same compiled kernel. Set
``XELINK_LAUNCH_CHECK=1`` (or :func:`set_check`) to have every fast launch also compute Triton's own key
and fail if Triton would run another kernel (the GPU tests run with it).

Host tensor descriptors. A kernel argument may be Triton's ``TensorDescriptor`` or this module's
:class:`Descriptor` (the same fields as tuples; no checks or conversions at construction, which keeps
its cost out of every call). Triton 3.6's launcher expands each descriptor argument into a
CUtensorMap (``fill_tma_descriptor`` over the base address, shape, strides, block, element type,
swizzle and padding, the last three from the compiled kernel) followed by the shape and stride
integers, or, for a kernel that did not lower it to TMA, into the base pointer and integers. The
expanded arguments are cached per compiled kernel under (base address, shape, strides, block shape,
dtype, padding), which determines every field of the CUtensorMap, so a cached one is never stale; the
first use of a key builds Triton's ``TensorDescriptor`` from it, whose checks (alignment, strides,
block shape) run then, exactly once per distinct descriptor.

Fallback rule: the plain ``kernel[grid](*args, **kwargs)`` (with :class:`Descriptor` arguments turned
into Triton's ``TensorDescriptor``) runs instead of the fast path, so behaviour never changes, whenever
one of these does not hold:

1. Triton is installed, its version is 3.6.x and its active driver is the CUDA one (not Intel's XPU
   Triton, not another version: the fast path relies on 3.6's launcher), and torch sees a CUDA device;
2. the kernel is a plain ``JITFunction`` or Gluon ``GluonJITFunction`` (not an interpreted one under
   ``TRITON_INTERPRET=1``, not an autotuner) with no pre-run hooks, and torch is not tracing
   (``torch.compiler.is_compiling()``);
3. no Triton launch enter/exit hook is installed (a profiler such as proton sees every launch);
4. every argument is of a kind the key knows (above), every constexpr value is hashable, and the grid
   is a tuple or list of one to three ints;
5. the compiled kernel's launcher is Triton's CUDA launcher, its descriptor handling is the one 3.6
   builds, and it needs no global or profile scratch memory (which Triton allocates per launch);
6. the module globals the kernel read when it was compiled are still the same objects (Triton checks
   their values on every call).

The launch goes to the current stream of the current device, as Triton's does, so CUDA-graph capture
records it like any launch.

Launch plans (the kernels' remembered paths) go one step further: :func:`launch_keyed` keeps a call's
argument list as the C launcher takes it under a key of the call's addresses, so a repeated call skips
building its arguments and the launcher's pointer queries (its docstring: what the key must hold).
"""
from __future__ import annotations

import inspect
import threading

import torch

try:
    import triton
except ImportError:  # CPU-only installs: every launch is the plain call (which the callers never reach)
    triton = None

__all__ = ["Descriptor", "Slot", "fast_path", "launch", "launch_keyed", "launch_plan", "launch_slot", "set_check"]

_MAX_ENTRIES = 512      # specializations remembered per kernel (then forgotten, all at once)
_MAX_DESCRIPTORS = 1024  # expanded descriptors remembered per compiled kernel
_MAX_READY = 1024        # argument lists remembered per slot (launch_keyed), per key of the caller's (a
                         # model's layers each pass their own weight to one geometry: 80 layers x a few
                         # calls must fit, or every call builds its list again)
_I32, _I64, _U64 = 1 << 31, 1 << 63, 1 << 64
_MISSING = object()
_PLAIN = object()  # an entry whose compiled kernel the fast path cannot launch: always the plain call


class Descriptor:
    """A host tensor descriptor: ``base`` (a tensor; its address and dtype are what count), and the
    ``shape``, ``strides`` (elements, the last one 1) and ``block_shape`` of the tiles a kernel loads, as
    Triton's ``TensorDescriptor`` takes them; ``layout``: a Gluon kernel's shared-memory layout (then it
    stands for Gluon's Hopper ``TensorDescriptor``, which carries it). Nothing is checked here: Triton's
    checks run the first time a launch sees these fields (:mod:`launcher`), or on every call of the plain
    path."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding", "layout")

    def __init__(self, base, shape, strides, block_shape, padding: str = "zero", layout=None):
        self.base = base
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.block_shape = tuple(block_shape)
        self.padding = padding
        self.layout = layout

    def triton(self):
        """Triton's ``TensorDescriptor`` of the same fields (its constructor checks them), or Gluon's with
        the layout."""
        if self.layout is not None:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

            return GluonDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                   self.layout, self.padding)
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                self.padding)

    def __repr__(self) -> str:
        return (f"Descriptor({self.base.dtype} at {self.base.data_ptr():#x}, shape={self.shape}, "
                f"strides={self.strides}, block_shape={self.block_shape}, padding={self.padding!r})")


class _Unsupported(Exception):
    """An argument the key does not know: this call takes the plain path."""


_DESC = "tensordesc"
_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_TRITON_DESCRIPTOR = None  # triton.tools.tensor_descriptor.TensorDescriptor once the fast path is on


def _spec(v):
    """The class of a non-constexpr argument that Triton specializes on, as a hashable value.

    Triton 3.6 (``native_specialize_impl``): tensors by dtype and 16-byte alignment of the address;
    ints equal to 1 become the constant 1, others i32 / i64 / u64 by range plus divisibility by 16;
    bools u1, floats fp32, None a constant; host tensor descriptors by dtype and block shape.
    """
    t = v.__class__
    if t is _TENSOR or t is _PARAMETER:
        return (v.dtype, (v.data_ptr() & 15) == 0)
    if t is int:
        if v == 1:
            return 1
        aligned = 2 if (v & 15) == 0 else 0  # two's complement: -16 & 15 == 0, as Triton's v % 16 == 0
        if -_I32 <= v < _I32:
            return aligned
        if -_I64 <= v < _I64:
            return aligned | 4
        if 0 <= v < _U64:
            return aligned | 8
        raise _Unsupported("an int beyond 64 bits")
    if t is bool:
        return "u1"
    if t is float:
        return "fp32"
    if v is None:
        return None
    if t is Descriptor:
        return (_DESC, v.base.dtype, v.block_shape, v.padding, v.layout)
    if t is _TRITON_DESCRIPTOR:  # (None until the fast path is on; None itself returned above)
        return (_DESC, v.base.dtype, tuple(v.block_shape), v.padding)
    if isinstance(v, _TENSOR) or hasattr(v, "data_ptr") and hasattr(v, "dtype"):  # Triton takes any such pointer
        return (v.dtype, (v.data_ptr() & 15) == 0)
    raise _Unsupported(type(v).__name__)


def _binder(params):
    """A function with the kernel's signature (``params``: ``(name, is_constexpr, default)``, default
    ``inspect.Parameter.empty`` when there is none) plus ``**options``, returning
    ``(key of the arguments, all arguments in order, options)``: Python binds positional and keyword
    arguments and fills the defaults, as Triton's generated binder does. None where the names cannot be
    used (they would shadow the helpers)."""
    names = [p[0] for p in params]
    if not names or len(set(names)) != len(names) or any(not n.isidentifier() or n.startswith("_xl_")
                                                         for n in names):
        return None
    namespace = {"_xl_spec": _spec}
    sig, keys = [], []
    for name, constexpr, default in params:
        if default is inspect.Parameter.empty:
            sig.append(name)
        else:
            namespace[f"_xl_default_{name}"] = default
            sig.append(f"{name}=_xl_default_{name}")
        keys.append(f"({name}.__class__, {name})" if constexpr else f"_xl_spec({name})")
    src = (f"def _xl_bind({', '.join(sig)}, **_xl_options):\n"
           f"    return ({', '.join(keys)},), ({', '.join(names)},), _xl_options\n")
    exec(compile(src, "<xelink.kernels.launcher binder>", "exec"), namespace)  # noqa: S102 - our own source
    return namespace["_xl_bind"]


def _kernel_params(fn):
    """``(name, is_constexpr, default)`` of a JIT function's parameters, or None for a signature the
    binder does not reproduce (positional-only, keyword-only, ``*args``)."""
    out = []
    for p, kp in zip(fn.signature.parameters.values(), fn.params):
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return None
        out.append((p.name, bool(kp.is_constexpr), p.default))
    return out


# -- what the fast path needs from Triton, looked up once ------------------------------------------

class _Triton:
    """Triton 3.6's pieces the fast path uses; ``reason`` says why it is off (None: on)."""

    def __init__(self):
        self.reason = None
        try:
            self._load()
        except (ImportError, AttributeError, RuntimeError, AssertionError, OSError) as e:
            # Off, and why: the plain call then raises whatever made Triton's driver fail, or runs.
            self.reason = f"Triton's pieces could not be set up ({type(e).__name__}: {e})"

    def _load(self):
        if triton is None:
            self.reason = "Triton is not installed"
            return
        version = getattr(triton, "__version__", "?")
        if not version.startswith("3.6."):
            self.reason = f"Triton {version}: the fast path knows 3.6's launcher only"
            return
        if not torch.cuda.is_available():
            self.reason = "no CUDA device"
            return
        from triton import knobs
        from triton.backends.nvidia import driver as nvidia
        from triton.runtime.driver import driver as driver_config
        from triton.runtime.jit import JITFunction, compute_cache_key
        from triton.tools.tensor_descriptor import TensorDescriptor

        try:
            from triton.experimental.gluon._runtime import GluonJITFunction
        except ImportError:
            GluonJITFunction = JITFunction
        self.jit_types = (JITFunction, GluonJITFunction)
        self.knobs = knobs
        self.runtime, self.compilation = knobs.runtime, knobs.compilation
        self.hook_chain = knobs.HookChain
        self.driver_config = driver_config
        self.driver = self.driver_config.active
        if not isinstance(self.driver, nvidia.CudaDriver):
            self.reason = f"the active Triton driver is {type(self.driver).__name__}, not CUDA's"
            return
        self.launcher_type = nvidia.CudaLauncher
        self.make_tensordesc_arg = nvidia.make_tensordesc_arg
        self.compute_cache_key = compute_cache_key
        self.descriptor_type = TensorDescriptor
        self.raw_type = type(len)  # the C launcher is a builtin function of the module 3.6 compiles
        self.get_device = torch._C._cuda_getDevice
        self.get_stream = torch._C._cuda_getCurrentRawStream
        global _TRITON_DESCRIPTOR
        _TRITON_DESCRIPTOR = TensorDescriptor

    def quiet(self, fn) -> bool:
        """No pre-run hook, launch hook, other driver or tracing that the plain call would honour."""
        rt = self.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        chain = self.hook_chain
        if enter is not None and (enter.__class__ is not chain or enter.calls):
            return False
        if leave is not None and (leave.__class__ is not chain or leave.calls):
            return False
        return not fn.pre_run_hooks and self.driver_config.active is self.driver \
            and not torch.compiler.is_compiling()


_T: _Triton | None = None
_LOCK = threading.Lock()
_KERNELS: dict = {}  # id(jit function) -> _Kernel (which holds the function, so the id stays its own)
_CHECK = None        # XELINK_LAUNCH_CHECK, read at the first launch


def _triton() -> _Triton:
    global _T
    if _T is None:
        with _LOCK:
            if _T is None:
                _T = _Triton()
    return _T


def set_check(flag: bool | None) -> None:
    """Check every fast launch against Triton's own cache key (True), not (False), or as
    ``XELINK_LAUNCH_CHECK`` says (None). For tests: it costs Triton's full binding on every call."""
    global _CHECK
    if flag is None:
        from ..config import env_flag

        flag = env_flag("XELINK_LAUNCH_CHECK")
    _CHECK = bool(flag)


class _Kernel:
    """The fast-path state of one JIT function: its binder and its entries, by key."""

    __slots__ = ("fn", "bind", "reason", "entries", "fast", "plain", "runtime_names")

    def __init__(self, fn):
        self.fn, self.entries, self.fast, self.plain = fn, {}, 0, 0
        t = _triton()
        self.reason = t.reason
        self.bind, self.runtime_names = None, frozenset()
        if self.reason is None and type(fn) not in t.jit_types:
            self.reason = f"{type(fn).__name__} is not a plain Triton JIT function (interpreted, autotuned?)"
        if self.reason is None:
            params = _kernel_params(fn)
            self.bind = _binder(params) if params is not None else None
            if self.bind is None:
                self.reason = "a signature the binder does not reproduce"
            else:
                self.runtime_names = frozenset(name for name, constexpr, _ in params if not constexpr)


class _Entry:
    """A compiled kernel and what its C launcher takes besides the arguments."""

    __slots__ = ("c", "raw", "function", "packed", "coop", "pdl", "descs", "globals")

    def __init__(self, c, raw, descs, global_refs):
        run = c.run
        self.c, self.raw, self.function, self.packed = c, raw, c.function, c.packed_metadata
        self.coop, self.pdl = run.launch_cooperative_grid, run.launch_pdl
        self.descs = descs          # [(position, tensordesc metadata or None, cache)], last position first
        self.globals = global_refs  # [(globals dict, name, the object it held at compile time)]


def _entry(t: _Triton, k: _Kernel, c, args: tuple):
    """The fast-path entry of compiled kernel ``c`` (first launched with ``args``), or _PLAIN."""
    run = c.run
    if type(run) is not t.launcher_type or getattr(run, "global_scratch_size", 1) \
            or getattr(run, "profile_scratch_size", 1) or not isinstance(c.function, int):
        return _PLAIN
    signature = list(c.src.signature.values())
    if len(signature) != len(args):
        return _PLAIN
    positions = [i for i, ty in enumerate(signature) if isinstance(ty, str) and ty.startswith("tensordesc")]
    if any((i in positions) != (type(a) in (Descriptor, t.descriptor_type)) for i, a in enumerate(args)):
        return _PLAIN
    raw = run.launch
    descs = []
    if positions:
        # 3.6 wraps the C launcher in a Python function that expands each descriptor on every call;
        # the fast path calls the C launcher itself with the expansions it caches.
        code, cells = getattr(raw, "__code__", None), getattr(raw, "__closure__", None)
        if code is None or cells is None:
            return _PLAIN
        free = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells)))
        raw = free.get("launcher")
        if set(free.get("tensordesc_indices") or ()) != set(positions):
            return _PLAIN
        metas = getattr(c.metadata, "tensordesc_meta", None) or [None] * len(positions)
        if len(metas) != len(positions):
            return _PLAIN
        descs = [(pos, meta, {}) for pos, meta in zip(positions, metas)][::-1]
    if type(raw) is not t.raw_type:
        return _PLAIN
    refs = [(g, name, g.get(name, _MISSING)) for (name, _), (_, g) in k.fn.used_global_vals.items()]
    return _Entry(c, raw, descs, refs)


def _expand(t: _Triton, e: _Entry, args: tuple) -> list:
    """``args`` with every descriptor replaced by what 3.6's launcher expands it into."""
    out = list(args)
    for pos, meta, cache in e.descs:
        d = out[pos]
        base = d.base
        if d.__class__ is Descriptor:
            key = (base.data_ptr(), d.shape, d.strides, d.block_shape, base.dtype, d.padding, d.layout)
        else:
            key = (base.data_ptr(), tuple(d.shape), tuple(d.strides), tuple(d.block_shape), base.dtype, d.padding)
        x = cache.get(key)
        if x is None:
            td = d.triton() if d.__class__ is Descriptor else d  # Triton's checks, once per distinct descriptor
            if len(cache) >= _MAX_DESCRIPTORS:
                cache.clear()
            # A kernel that did not lower the descriptor to TMA takes its base pointer: re-expanded from
            # the call's own tensor every time (nothing keeps a tensor alive here).
            x = cache[key] = tuple(t.make_tensordesc_arg(td, meta)) if meta is not None else ()
        if meta is None:
            x = t.make_tensordesc_arg(d, None)
        out[pos:pos + 1] = x
    return out


def _triton_args(args, kwargs):
    """The arguments with every :class:`Descriptor` replaced by Triton's ``TensorDescriptor``."""
    if any(a.__class__ is Descriptor for a in args):
        args = tuple(a.triton() if a.__class__ is Descriptor else a for a in args)
    if any(a.__class__ is Descriptor for a in kwargs.values()):
        kwargs = {n: a.triton() if a.__class__ is Descriptor else a for n, a in kwargs.items()}
    return args, kwargs


def _plain(k: _Kernel | None, fn, grid, args, kwargs):
    if k is not None:
        k.plain += 1
    args, kwargs = _triton_args(args, kwargs)
    return fn[grid](*args, **kwargs)


def _triton_key(t: _Triton, fn, device: int, args, kwargs) -> str:
    """Triton 3.6's own cache key of ``fn[grid](*args, **kwargs)`` on ``device`` (what ``JITFunction.run``
    computes: the options get the debug and instrumentation knobs, then its binder and
    ``compute_cache_key``)."""
    args, kwargs = _triton_args(args, kwargs)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or t.runtime.debug
    kwargs["instrumentation_mode"] = t.compilation.instrumentation_mode
    _, key_cache, _, _, binder = fn.device_caches[device]
    _, specialization, options = binder(*args, **kwargs)
    return t.compute_cache_key(key_cache, specialization, options)


def _verify(t: _Triton, k: _Kernel, e: _Entry, device: int, args, kwargs) -> None:
    """Fail if Triton's own key for this call names another compiled kernel than the entry's."""
    key = _triton_key(t, k.fn, device, args, kwargs)
    if k.fn.device_caches[device][0].get(key) is not e.c:
        raise RuntimeError(f"launcher: the fast path would run another compiled {k.fn.__name__} than Triton's "
                           f"(Triton's key {key}): a key that is too coarse, a bug in xelink.kernels.launcher")


def _key(t: _Triton, k: _Kernel, args, kwargs):
    """(the fast path's key of this call, all the kernel's arguments in order, the current device)."""
    spec, full, options = k.bind(*args, **kwargs)
    device = t.get_device()
    return ((device, spec, tuple(options.items()), tuple(map(type, options.values())), t.runtime.debug,
             t.compilation.instrumentation_mode, k.fn.debug), full, device)


def fast_path(fn) -> str | None:
    """None when ``launch(fn, ...)`` can take the fast path, else why it takes the plain call."""
    k = _KERNELS.get(id(fn))
    if k is None:
        k = _KERNELS[id(fn)] = _Kernel(fn)
    return k.reason


def launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)`` with the host time of a C call once the specialization is known.

    Args:
        fn: a ``@triton.jit`` (or Gluon) kernel.
        grid: a tuple of 1-3 ints (a callable grid takes the plain call).
        args, kwargs: the kernel's arguments and launch options, as ``fn[grid]`` takes them; host tensor
            descriptors may be :class:`Descriptor` or Triton's ``TensorDescriptor``.

    Returns:
        the compiled kernel (Triton's ``CompiledKernel``), as ``fn[grid](...)`` returns it.
    """
    k = _KERNELS.get(id(fn))
    if k is None:
        k = _KERNELS[id(fn)] = _Kernel(fn)
    if k.bind is None:
        return _plain(k, fn, grid, args, kwargs)
    t = _T
    if not t.quiet(fn) or grid.__class__ not in (tuple, list) or not 1 <= len(grid) <= 3:
        return _plain(k, fn, grid, args, kwargs)
    try:
        key, full, device = _key(t, k, args, kwargs)
        e = k.entries.get(key)
    except (TypeError, RuntimeError, _Unsupported):
        # Wrong arguments, or ones the key does not know (or whose address torch will not give): the
        # plain call runs them, or raises what Triton raises.
        return _plain(k, fn, grid, args, kwargs)
    if e is None:
        c = _plain(k, fn, grid, args, kwargs)
        if c is not None:  # None: a JIT cache hook declined to compile
            try:
                entry = _entry(t, k, c, full)
            except (AttributeError, TypeError, ValueError):  # a compiled kernel not shaped as 3.6's
                entry = _PLAIN
            if len(k.entries) >= _MAX_ENTRIES:
                k.entries.clear()
            k.entries[key] = entry
        return c
    if e is _PLAIN:
        return _plain(k, fn, grid, args, kwargs)
    return _fire(t, k, e, device, grid, full, args, kwargs)


def _fire(t: _Triton, k: _Kernel, e: _Entry, device: int, grid, full, args, kwargs):
    """The fast launch of entry ``e`` (``full``: every argument in order), or the plain call where a global
    the kernel read was rebound since it compiled."""
    if not _globals_held(e):  # rebound since compilation: Triton's check decides
        return _plain(k, k.fn, grid, args, kwargs)
    if _CHECK is None:
        set_check(None)
    if _CHECK:
        _verify(t, k, e, device, args, kwargs)
    return _raw(t, k, e, device, grid, _expand(t, e, full) if e.descs else full)


def _raw(t: _Triton, k: _Kernel, e: _Entry, device: int, grid, full):
    """Entry ``e``'s C launcher on ``full`` (every argument as it takes them), on the current stream."""
    n = len(grid)
    e.raw(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, t.get_stream(device), e.function, e.coop, e.pdl,
          None, None, e.packed, None, None, None, *full)
    k.fast += 1
    return e.c


class Slot:
    """One call site's compiled kernel, for hot callers that keep their own cache of checked calls (gemm's).

    The caller promises that the calls it routes to one slot pass the same kernel, the same grid length,
    equal keyword arguments (constexprs and launch options only) and positional arguments of the same
    classes (a tensor: dtype and 16-byte alignment; an int: 1, i32, i64 or u64 and alignment to 16; a
    descriptor: dtype, block shape, padding; see the module docstring): every part of the launcher's key
    but the current device and Triton's global knobs, which :func:`launch_slot` checks itself. Then a call
    skips the binder and the key (about 5 us on an H200). ``XELINK_LAUNCH_CHECK=1`` verifies every
    slot launch against Triton's own key, so a broken promise fails the GPU tests instead of launching
    another specialization.
    """

    __slots__ = ("fn", "entry", "kwargs", "nargs", "tail", "state", "given", "ready")

    def __init__(self, fn):
        self.fn, self.entry, self.kwargs, self.nargs, self.tail, self.state = fn, None, None, -1, (), None
        # launch_keyed's: the kwargs object the slot was set with, and the argument lists by call key
        self.given, self.ready = None, {}


def launch_slot(slot: Slot, grid, *args, **kwargs):
    """:func:`launch` through ``slot``: the slot's kernel when this call matches it (same keyword
    arguments and argument count, same device and knobs, no hook), else :func:`launch`, whose kernel the
    slot then remembers."""
    e = slot.entry
    if e is not None and len(args) == slot.nargs and kwargs == slot.kwargs:
        t = _T
        device = t.get_device()
        if slot.state == (device, t.runtime.debug, t.compilation.instrumentation_mode, slot.fn.debug) \
                and t.quiet(slot.fn):
            return _fire(t, _KERNELS[id(slot.fn)], e, device, grid, args + slot.tail, args, kwargs)
    c = launch(slot.fn, grid, *args, **kwargs)
    _remember(slot, args, kwargs)
    return c


def launch_keyed(slot: Slot | None, key, grid, make_args, kwargs: dict, fn=None):
    """:func:`launch_slot` of ``slot``'s kernel on ``make_args()`` (a tuple) and ``kwargs``, for a launch plan that
    passes the same ``kwargs`` dict object at every call and whose ``key`` (hashable) determines every
    positional argument: the address of each CUDA tensor and descriptor base among them (descriptors' other
    fields and the integers fixed by the plan). Once the slot holds its kernel, the arguments as the C launcher
    takes them are remembered under ``key`` (descriptors expanded into CUtensorMaps, tensors as their addresses,
    which the launcher takes as they are: no tensor is kept alive, and the launcher skips its ``data_ptr`` call
    and pointer query a tensor), and a call with a known key goes to the C launcher without building them.
    The device, Triton's knobs, hooks, tracing and the kernel's globals are checked every call, as by
    :func:`launch_slot`; ``XELINK_LAUNCH_CHECK=1`` verifies every call against Triton's key. A plan used once
    passes no slot (None) and its kernel ``fn``: :func:`launch`."""
    if slot is None:
        return launch(fn, grid, *make_args(), **kwargs)
    e = slot.entry
    if e is not None and kwargs is slot.given:
        t = _T
        device = t.get_device()
        if slot.state == (device, t.runtime.debug, t.compilation.instrumentation_mode, slot.fn.debug) \
                and t.quiet(slot.fn):
            k = _KERNELS[id(slot.fn)]
            ready = slot.ready.get(key)
            if ready is not None and _CHECK is False and _globals_held(e):
                return _raw(t, k, e, device, grid, ready)
            args = make_args()
            full = args + slot.tail
            c = _fire(t, k, e, device, grid, full, args, kwargs)
            if c is e.c and _globals_held(e):  # the fast launch ran: its argument list may be remembered
                if e.descs:
                    full = _expand(t, e, full)
                if len(slot.ready) >= _MAX_READY:
                    slot.ready.clear()
                slot.ready[key] = tuple(a.data_ptr() if isinstance(a, _TENSOR) else a for a in full)
            return c
    args = make_args()
    c = launch(slot.fn, grid, *args, **kwargs)
    _remember(slot, args, kwargs)
    slot.given, slot.ready = kwargs, {}
    return c


def _globals_held(e: _Entry) -> bool:
    """The module globals the kernel read at compilation are still the same objects."""
    for g, name, obj in e.globals:
        if g.get(name, _MISSING) is not obj:
            return False
    return True


def launch_plan(slot: Slot | None, fn, grid, args: tuple, kwargs: dict):
    """A launch plan's call of ``fn``: through ``slot`` (a remembered plan, which passes its own ``kwargs`` dict
    at every call) with the argument list remembered under the call's own key (each tensor's address, each
    descriptor's fields, every other argument's value: :func:`launch_keyed`), or, for a plan used once (``slot``
    None), :func:`launch`."""
    if slot is None:
        return launch(fn, grid, *args, **kwargs)
    key = []
    for a in args:
        if isinstance(a, _TENSOR):
            key.append(a.data_ptr())
        elif a.__class__ is Descriptor:
            key.append((a.base.data_ptr(), a.shape, a.strides, a.block_shape, a.padding, a.layout))
        else:
            key.append(a)
    return launch_keyed(slot, tuple(key), grid, lambda: args, kwargs)


def _remember(slot: Slot, args, kwargs) -> None:
    """Point ``slot`` at the entry :func:`launch` just used for this call (none: the slot stays empty)."""
    slot.entry = None
    k = _KERNELS.get(id(slot.fn))
    t = _T
    if k is None or k.bind is None or t is None or not t.quiet(slot.fn):
        return
    if any(name in k.runtime_names for name in kwargs):  # a runtime argument by keyword: not a fixed tail
        return
    try:
        key, full, device = _key(t, k, args, kwargs)
    except (TypeError, RuntimeError, _Unsupported):
        return
    e = k.entries.get(key)
    if e.__class__ is _Entry:
        slot.entry, slot.kwargs, slot.nargs, slot.tail = e, dict(kwargs), len(args), tuple(full[len(args):])
        slot.state = (device, t.runtime.debug, t.compilation.instrumentation_mode, slot.fn.debug)
