"""The fast launcher (xelink.kernels.launcher): its key on CPU (fake pointers: what changes the key and what
keeps it), the whole fast path against a fake Triton (what reaches the C launcher, descriptor caching,
when it falls back), the fallback without Triton 3.6, the key checked against Triton 3.6's own
specialization where that Triton is installed, and (GPU) every wired kernel launched through the fast
path with changing tensors, alignments and shapes, and inside CUDA graphs."""
from __future__ import annotations

import importlib
import inspect
import itertools
import types

import pytest
import torch

from xelink.kernels import launcher as L

EMPTY = inspect.Parameter.empty


class Ptr:
    """A fake pointer argument: what Triton reads of a tensor (data_ptr and dtype)."""

    def __init__(self, addr: int, dtype=torch.float16):
        self.addr, self.dtype = addr, dtype

    def data_ptr(self) -> int:
        return self.addr


# (name, is_constexpr, default) of a small kernel: a pointer, two ints, a float, a constexpr with a default.
PARAMS = [("x_ptr", False, EMPTY), ("n", False, EMPTY), ("m", False, EMPTY), ("eps", False, EMPTY),
          ("BLOCK", True, EMPTY), ("EVEN", True, False)]
BIND = L._binder(PARAMS)


def key(*args, **kwargs):
    spec, _, options = BIND(*args, **kwargs)
    return spec, tuple(options.items()), tuple(map(type, options.values()))


def base(**change):
    args = dict(x_ptr=Ptr(4096), n=64, m=7, eps=1e-6, BLOCK=128)
    args.update(change)
    return key(**args)


# -- the key ------------------------------------------------------------------------------------

def test_equal_specialization_gives_equal_keys():
    assert base() == base()
    # Another 16-byte aligned address, ints of the same classes, another float: the same kernel.
    assert base() == base(x_ptr=Ptr(4096 + 512), n=16 * 1000, m=9, eps=0.5)
    assert base() == key(Ptr(160), 32, 3, 2.0, 128)  # positional as keyword
    assert base() == base(EVEN=False)  # the default, given


@pytest.mark.parametrize("change", [
    dict(x_ptr=Ptr(4096 + 2)),                  # 16-byte alignment of the address
    dict(x_ptr=Ptr(4096, torch.bfloat16)),      # dtype
    dict(x_ptr=None),                           # None is a constant
    dict(n=1), dict(n=17), dict(n=2 ** 31), dict(n=2 ** 63), dict(n=-(2 ** 31) - 16),  # 1, %16, i32/i64/u64
    dict(m=1), dict(m=16), dict(m=2 ** 32 + 1),
    dict(eps=3),                                # an int where a float was
    dict(eps=True),                             # a bool (u1)
    dict(BLOCK=64),                             # constexpr value
    dict(EVEN=True), dict(EVEN=0),              # constexpr value and type (False vs 0)
    dict(BLOCK=128.0),                          # 128 vs 128.0
])
def test_what_changes_the_key(change):
    assert base(**change) != base()


def test_int_classes_follow_triton():
    s = L._spec
    assert s(1) == 1 and s(True) == "u1" and s(1.0) == "fp32" and s(None) is None
    assert s(0) == s(16) == s(-16) == s(2 ** 31 - 16) != s(17)
    assert s(17) == s(2 ** 31 - 1) == s(-(2 ** 31) + 1) != s(2 ** 31 + 1)   # i32: -2^31 .. 2^31 - 1
    assert s(-(2 ** 31)) == s(0) != s(-(2 ** 31) - 16)
    assert s(-(2 ** 31) - 1) == s(2 ** 63 - 1) != s(2 ** 63 + 1)          # i64
    assert s(2 ** 64 - 1) == s(2 ** 63 + 1)                                 # u64
    with pytest.raises(L._Unsupported):
        s(2 ** 64)


def test_options_change_the_key_by_name_type_and_value():
    assert base() == key(Ptr(16), 64, 7, 1e-6, 128)
    k4 = key(Ptr(16), 64, 7, 1e-6, 128, num_warps=4)
    assert k4 != base() and k4 == key(Ptr(16), 64, 7, 1e-6, 128, num_warps=4)
    assert k4 != key(Ptr(16), 64, 7, 1e-6, 128, num_warps=8)
    assert key(Ptr(16), 64, 7, 1e-6, 128, launch_pdl=True) != key(Ptr(16), 64, 7, 1e-6, 128, launch_pdl=1)


def test_tensors_descriptors_and_unknown_arguments():
    buf = torch.empty(64, dtype=torch.float16)
    assert L._spec(buf) == (torch.float16, True) and L._spec(buf[1:]) == (torch.float16, False)
    assert L._spec(torch.nn.Parameter(buf)) == L._spec(buf)
    d = L.Descriptor(buf, [8, 8], [8, 1], [8, 4])
    assert L._spec(d) == ("tensordesc", torch.float16, (8, 4), "zero", None)
    # a Gluon kernel's descriptor (its shared-memory layout rides along) is another class of argument
    assert L._spec(L.Descriptor(buf, [8, 8], [8, 1], [8, 4], "zero", ("a layout",))) != L._spec(d)
    assert L._spec(L.Descriptor(buf, [4, 16], [16, 1], [8, 4])) == L._spec(d)  # shape: not specialized on
    assert L._spec(L.Descriptor(buf, [8, 8], [8, 1], [4, 8])) != L._spec(d)
    assert L._spec(L.Descriptor(buf, [8, 8], [8, 1], [8, 4], "nan")) != L._spec(d)
    for bad in ("x", (1, 2), torch.float16, 2 ** 64):
        with pytest.raises(L._Unsupported):
            L._spec(bad)


def test_binder_binds_like_python_and_refuses_bad_calls():
    spec, args, options = BIND(Ptr(16), 2, 3, 0.5, BLOCK=32, num_warps=4)
    assert args[1:] == (2, 3, 0.5, 32, False) and options == {"num_warps": 4}
    with pytest.raises(TypeError):
        BIND(Ptr(16), 2, 3)  # missing arguments: the plain call raises Triton's error
    with pytest.raises(TypeError):
        BIND(Ptr(16), 2, 3, 0.5, 32, False, 9)
    assert L._binder([("options", False, EMPTY)]) is not None
    assert L._binder([("_xl_spec", False, EMPTY)]) is None  # would shadow the helper


# -- the fast path against a fake Triton ------------------------------------------------------------

class FakeChain:
    def __init__(self):
        self.calls = []


def fake_triton(device=0, stream=77):
    t = L._Triton.__new__(L._Triton)
    t.reason = None
    t.jit_types = (FakeJit,)
    t.hook_chain = FakeChain
    t.runtime = types.SimpleNamespace(debug=False, launch_enter_hook=FakeChain(), launch_exit_hook=FakeChain())
    t.compilation = types.SimpleNamespace(instrumentation_mode="")
    t.driver = object()
    t.driver_config = types.SimpleNamespace(active=t.driver)
    t.launcher_type = FakeLauncher
    t.raw_type = types.MethodType  # FakeJit._raw stands for the C launcher
    t.descriptor_type = type("NoTritonDescriptor", (), {})
    t.expanded = []

    def make_tensordesc_arg(d, meta):
        t.expanded.append(d)
        return [("map", d.base.data_ptr(), tuple(d.shape), tuple(d.strides), meta), *d.shape, *d.strides]

    t.make_tensordesc_arg = make_tensordesc_arg
    t.get_device = lambda: device
    t.get_stream = lambda dev: stream + dev
    return t


class FakeLauncher:
    def __init__(self, raw, descs, scratch=0):
        self.raw = raw
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        if descs:
            def wrap(launcher, tensordesc_indices, tensordesc_meta):
                def inner(*args):  # stands for 3.6's Python wrapper around the C launcher
                    raise AssertionError(f"the fast path must call {launcher} itself, not expand "
                                         f"{tensordesc_indices} with {tensordesc_meta}")
                return inner
            self.launch = wrap(raw, set(descs), [{"swizzle": 128}] * len(descs))
        else:
            self.launch = raw


class FakeJit:
    """A JIT function of ``signature`` (a Python function) whose plain launch records itself."""

    def __init__(self, fn, descs=(), scratch=0):
        self.fn, self.signature = fn, inspect.signature(fn)
        self.__name__ = fn.__name__
        names = list(self.signature.parameters)
        self.params = [types.SimpleNamespace(is_constexpr=n.isupper()) for n in names]
        self.pre_run_hooks, self.debug, self.used_global_vals = [], None, {}
        self.plain, self.raw_calls, self.compiled = [], [], []
        sig = {n: ("tensordesc<fp16[8, 8]>" if i in descs else "constexpr" if n.isupper() else "i32")
               for i, n in enumerate(names)}
        self.descs, self.scratch, self.sig = descs, scratch, sig

    def _raw(self, *args):
        self.raw_calls.append(args)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.plain.append((grid, args, kwargs))
            c = types.SimpleNamespace(run=FakeLauncher(self._raw, self.descs, self.scratch), function=4242,
                                      packed_metadata=(4, 1, 0), src=types.SimpleNamespace(signature=self.sig),
                                      metadata=types.SimpleNamespace(
                                          tensordesc_meta=[{"swizzle": 128}] * len(self.descs) or None))
            self.compiled.append(c)
            return c
        return run


@pytest.fixture
def fake(monkeypatch):
    t = fake_triton()
    monkeypatch.setattr(L, "_T", t)
    monkeypatch.setattr(L, "_triton", lambda: t)
    monkeypatch.setattr(L, "_KERNELS", {})
    monkeypatch.setattr(L, "_CHECK", False)
    return t


def _kernel(x_ptr, n, BLOCK, EVEN=False):
    pass


def test_fast_path_compiles_once_then_calls_the_c_launcher(fake):
    k = FakeJit(_kernel)
    x = torch.empty(32)
    c = L.launch(k, (3,), x, 64, BLOCK=16, num_warps=4)
    assert len(k.plain) == 1 and not k.raw_calls and c is k.compiled[0]
    y = torch.empty(32)
    assert L.launch(k, (5, 2), y, 128, BLOCK=16, num_warps=4) is c  # the same classes: fast
    assert len(k.plain) == 1 and len(k.raw_calls) == 1
    # grid (z defaulted), the current stream, the kernel, cooperative, pdl, no scratch, metadata, no hooks
    assert k.raw_calls[0][:13] == (5, 2, 1, 77, 4242, False, True, None, None, (4, 1, 0), None, None, None)
    assert k.raw_calls[0][13] is y and k.raw_calls[0][14:] == (128, 16, False)
    # Each change of class compiles (the plain call) once.
    L.launch(k, (1,), x, 65, BLOCK=16, num_warps=4)       # n not a multiple of 16
    L.launch(k, (1,), x[1:], 64, BLOCK=16, num_warps=4)   # misaligned
    L.launch(k, (1,), x, 64, BLOCK=32, num_warps=4)       # constexpr
    L.launch(k, (1,), x, 64, BLOCK=16, num_warps=8)       # option
    assert len(k.plain) == 5 and len(k.raw_calls) == 1
    L.launch(k, (1,), x, 64, BLOCK=16, num_warps=8)
    assert len(k.plain) == 5 and len(k.raw_calls) == 2


def test_slot_skips_the_key_while_the_call_matches(fake, monkeypatch):
    keys = []
    real_key = L._key
    monkeypatch.setattr(L, "_key", lambda *a: keys.append(1) or real_key(*a))
    k = FakeJit(_kernel)
    slot = L.Slot(k)
    x, y = torch.empty(32), torch.empty(32)
    L.launch_slot(slot, (1,), x, 64, BLOCK=16)  # compiles (plain call), then the slot remembers the entry
    assert len(k.plain) == 1 and slot.entry is not None
    keys.clear()
    assert L.launch_slot(slot, (2,), y, 128, BLOCK=16) is k.compiled[0]
    assert not keys and len(k.raw_calls) == 1
    assert k.raw_calls[0][:3] == (2, 1, 1) and k.raw_calls[0][13] is y and k.raw_calls[0][14:] == (128, 16, False)
    # Another constexpr, another device, a hook: the slot's entry is not used; launch() decides.
    L.launch_slot(slot, (1,), x, 64, BLOCK=32)
    assert len(k.plain) == 2 and slot.kwargs == {"BLOCK": 32}
    L.launch_slot(slot, (1,), x, 64, BLOCK=32)
    assert len(k.raw_calls) == 2
    fake.get_device = lambda: 1
    L.launch_slot(slot, (1,), x, 64, BLOCK=32)
    assert len(k.plain) == 3
    fake.runtime.launch_enter_hook.calls.append(print)
    L.launch_slot(slot, (1,), x, 64, BLOCK=32)
    assert len(k.plain) == 4 and slot.entry is None
    fake.runtime.launch_enter_hook.calls.clear()
    # A runtime argument passed by keyword is no fixed tail: never remembered, still launched.
    other = L.Slot(k)
    for _ in range(2):
        L.launch_slot(other, (1,), x, n=64, BLOCK=32)
    assert other.entry is None and len(k.raw_calls) == 4  # both fast: launch() knows the key


def test_device_and_knobs_are_in_the_key(fake):
    k = FakeJit(_kernel)
    x = torch.empty(32)
    L.launch(k, (1,), x, 64, BLOCK=16)
    fake.get_device = lambda: 1
    L.launch(k, (1,), x, 64, BLOCK=16)
    fake.runtime.debug = True
    L.launch(k, (1,), x, 64, BLOCK=16)
    fake.runtime.debug = False
    fake.compilation.instrumentation_mode = "consan"
    L.launch(k, (1,), x, 64, BLOCK=16)
    assert len(k.plain) == 4 and not k.raw_calls
    fake.compilation.instrumentation_mode = ""
    L.launch(k, (1,), x, 64, BLOCK=16)
    assert len(k.raw_calls) == 1 and k.raw_calls[0][3] == 78  # device 1's stream


def test_plain_call_whenever_the_fast_path_cannot_be_sure(fake):
    k = FakeJit(_kernel)
    x = torch.empty(32)
    L.launch(k, (1,), x, 64, BLOCK=16)
    L.launch(k, (1,), x, 64, BLOCK=16)
    assert len(k.raw_calls) == 1
    plain = len(k.plain)
    fake.runtime.launch_enter_hook.calls.append(print)  # a profiler's hook
    L.launch(k, (1,), x, 64, BLOCK=16)
    fake.runtime.launch_enter_hook.calls.clear()
    k.pre_run_hooks.append(print)
    L.launch(k, (1,), x, 64, BLOCK=16)
    k.pre_run_hooks.clear()
    fake.driver_config.active = object()  # another driver made active
    L.launch(k, (1,), x, 64, BLOCK=16)
    fake.driver_config.active = fake.driver
    L.launch(k, lambda meta: (1,), x, 64, BLOCK=16)  # a callable grid
    L.launch(k, (1,), "not an argument Triton takes", 64, BLOCK=16)
    L.launch(k, (1,), x, 64, BLOCK=[16])  # unhashable constexpr
    assert len(k.plain) == plain + 6 and len(k.raw_calls) == 1
    L.launch(k, (1,), x, 64, BLOCK=16)
    assert len(k.raw_calls) == 2


def test_rebound_global_and_scratch_take_the_plain_call(fake):
    g = {"C": 3}
    k = FakeJit(_kernel)
    k.used_global_vals = {("C", id(g)): (3, g)}
    x = torch.empty(32)
    L.launch(k, (1,), x, 64, BLOCK=16)
    L.launch(k, (1,), x, 64, BLOCK=16)
    g["C"] = 4  # Triton checks the value on every call: the plain call does
    L.launch(k, (1,), x, 64, BLOCK=16)
    assert len(k.plain) == 2 and len(k.raw_calls) == 1
    s = FakeJit(_kernel, scratch=64)
    for _ in range(3):
        L.launch(s, (1,), x, 64, BLOCK=16)
    assert len(s.plain) == 3 and not s.raw_calls


def _desc_kernel(a_desc, b_desc, n, BLOCK):
    pass


def test_descriptors_expand_once_per_key_and_go_to_the_c_launcher(fake):
    k = FakeJit(_desc_kernel, descs=(0, 1))
    buf = torch.empty(4096, dtype=torch.float16)
    checked = []
    real_triton = L.Descriptor.triton
    L.Descriptor.triton = lambda self: checked.append(self) or self  # Triton's checks (construction)
    try:
        def call(a, b, n=64):
            da, db = L.Descriptor(a, (8, 64), (64, 1), (8, 8)), L.Descriptor(b, (64, 8), (8, 1), (8, 8))
            return L.launch(k, (1,), da, db, n, BLOCK=8)

        call(buf, buf[512:])
        assert len(k.plain) == 1 and len(checked) == 2  # the plain call turns them into Triton's
        call(buf, buf[512:])
        call(buf, buf[512:], n=128)
        assert len(k.raw_calls) == 2 and len(checked) == 4  # checked once each on the fast path
        a_map, *rest = k.raw_calls[0][13:]
        assert a_map == ("map", buf.data_ptr(), (8, 64), (64, 1), {"swizzle": 128})
        assert rest[:4] == [8, 64, 64, 1]
        assert rest[4] == ("map", buf[512:].data_ptr(), (64, 8), (8, 1), {"swizzle": 128})
        assert rest[5:] == [64, 8, 8, 1, 64, 8]
        assert k.raw_calls[1][-2:] == (128, 8)
        other = torch.empty(4096, dtype=torch.float16)
        call(other, buf[512:])  # a new address: a new map for a, b's reused
        assert k.raw_calls[2][13][1] == other.data_ptr() and len(checked) == 5
        assert len(fake.expanded) == 3
    finally:
        L.Descriptor.triton = real_triton


def test_keyed_launches_remember_the_c_launchers_arguments(fake):
    # launch_keyed: the first call (plain) sets the slot, the second (fast) remembers its list under the key,
    # with descriptors expanded and tensors as their addresses; a known key then reaches the C launcher without
    # building its arguments. Another key, another kwargs object, the Triton-key check on or a rebound global
    # of the kernel each take the checked path again; a changed device resets the lists.
    k = FakeJit(_desc_kernel, descs=(0, 1))
    module_globals = {"SCALE": 1}
    k.used_global_vals = {("SCALE", False): (1, module_globals)}  # a global the kernel read when it compiled
    kw = {"BLOCK": 8}
    slot = L.Slot(k)
    made = []
    bufs = [torch.empty(4096, dtype=torch.float16) for _ in range(2)]
    L.Descriptor.triton, real_triton = (lambda self: self), L.Descriptor.triton
    try:
        def call(a, b, n=64, kwargs=kw):
            def args():
                made.append(1)
                return L.Descriptor(a, (8, 64), (64, 1), (8, 8)), L.Descriptor(b, (64, 8), (8, 1), (8, 8)), n
            return L.launch_keyed(slot, (a.data_ptr(), b.data_ptr(), n), (1,), args, kwargs)

        call(*bufs)
        assert len(k.plain) == 1 and slot.given is kw and not slot.ready
        call(*bufs)  # fast, then remembered
        assert len(k.raw_calls) == 1 and len(slot.ready) == 1 and len(made) == 2
        (ready,) = slot.ready.values()
        assert ready == k.raw_calls[0][13:] and ready[0] == ("map", bufs[0].data_ptr(), (8, 64), (64, 1),
                                                            {"swizzle": 128})
        call(*bufs)
        assert len(k.raw_calls) == 2 and len(made) == 2 and k.raw_calls[1] == k.raw_calls[0]  # no arguments built
        call(*bufs, n=128)  # another key: built, launched, remembered
        assert len(made) == 3 and k.raw_calls[2][-2:] == (128, 8) and len(slot.ready) == 2
        call(*bufs, kwargs={"BLOCK": 8})  # an equal dict, not the plan's own object: the checked path
        assert len(made) == 4 and len(k.raw_calls) == 4 and len(k.plain) == 1
        L.set_check(True)  # (the fake Triton has no key of its own to compare: _verify stubbed)
        real_verify, L._verify = L._verify, lambda *a: made.append("verify")
        try:
            call(*bufs, kwargs=slot.given)
            assert made[-2:] == [1, "verify"]
        finally:
            L._verify = real_verify
            L.set_check(False)
        module_globals["SCALE"] = 2  # rebound: Triton's own call decides, even for a remembered key
        call(*bufs, kwargs=slot.given)
        assert len(k.plain) == 2
        module_globals["SCALE"] = 1
        fake.get_device = lambda: 1  # the slot's state no longer holds: launch() and a fresh slot
        call(*bufs, kwargs=slot.given)
        assert len(k.plain) == 3 and not slot.ready
    finally:
        L.Descriptor.triton = real_triton


def test_launch_plan_keys_by_every_argument(fake):
    # launch_plan derives the key: a tensor by its address (new contents at one address: the same list, which
    # holds the address, not the tensor), any other argument by its value.
    k = FakeJit(_kernel)
    slot, kw = L.Slot(k), {"BLOCK": 16}
    x, y = torch.zeros(32), torch.zeros(32)
    for t, n in ((x, 64), (x, 64), (x, 64), (y, 64), (x, 128), (x, 64)):
        L.launch_plan(slot, k, (1,), (t, n), kw)
    def shown(call):  # a tensor as ("tensor", its address), an address (remembered list) as the int
        return [("tensor", a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in call[13:]]

    assert len(k.plain) == 1 and len(k.raw_calls) == 5
    xp, yp = x.data_ptr(), y.data_ptr()
    # the 2nd call fast (then remembered), the 3rd from the list; new keys fast, the first key's list again
    assert [shown(c) for c in k.raw_calls] == [[("tensor", xp), 64, 16, False], [xp, 64, 16, False],
                                               [("tensor", yp), 64, 16, False], [("tensor", xp), 128, 16, False],
                                               [xp, 64, 16, False]]
    assert len(slot.ready) == 3
    L.launch_plan(None, k, (1,), (x, 64), kw)  # no slot: launch()
    assert len(k.raw_calls) == 6 and k.raw_calls[5][13] is x


def test_a_loop_over_many_keys_keeps_every_list(fake):
    # The layers of a model: one geometry, each layer its own weight; from the second pass on, every call goes
    # from its remembered list (its tensors as addresses), none builds its arguments again.
    k = FakeJit(_kernel)
    slot, kw = L.Slot(k), {"BLOCK": 16}
    weights = [torch.zeros(32) for _ in range(200)]
    for _ in range(3):
        for w in weights:
            L.launch_plan(slot, k, (1,), (w, 64), kw)
    last = k.raw_calls[-len(weights):]
    assert all(c[13] == w.data_ptr() for c, w in zip(last, weights)) and len(slot.ready) == len(weights)


def test_fallback_without_triton_or_with_another_version(monkeypatch):
    calls = []

    class Plain:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw)) or "compiled"

    for triton, why in ((None, "not installed"),
                        (types.SimpleNamespace(__version__="3.5.1"), "3.5.1")):
        monkeypatch.setattr(L, "triton", triton)
        monkeypatch.setattr(L, "_T", None)
        monkeypatch.setattr(L, "_KERNELS", {})
        fn = Plain()
        assert why in L.fast_path(fn)
        assert L.launch(fn, (2,), 1, 2, X=3) == "compiled"
        assert calls[-1] == ((2,), (1, 2), {"X": 3})


def test_fallback_for_interpreted_and_other_kernel_objects(fake):
    interp = pytest.importorskip("triton.runtime.interpreter")

    def body(x, BLOCK):
        pass

    fn = interp.InterpretedFunction(body)  # what @triton.jit makes under TRITON_INTERPRET=1
    assert "not a plain Triton JIT function" in L.fast_path(fn)
    assert "not a plain Triton JIT function" in L.fast_path(object())


def test_installed_triton_decides_the_path():
    """Here (CPU, Intel's Triton or none) the fast path is off and says why; on the H200 with Triton
    3.6 it is on."""
    pytest.importorskip("triton")
    from xelink.kernels.gemm import _gemm_kernel

    why = L.fast_path(_gemm_kernel)
    import triton

    if triton.__version__.startswith("3.6.") and torch.cuda.is_available():
        assert why is None
    else:
        assert why


# -- the key against Triton 3.6's own specialization -------------------------------------------------

def _native():
    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"needs NVIDIA Triton 3.6 (found {triton.__version__})")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends import BaseBackend

    return lambda v, specialize, align: native_specialize_impl(BaseBackend, v, False, specialize, align)


def test_key_is_never_coarser_than_triton_specialization():
    """Two arguments with equal keys specialize equally in Triton 3.6, for every specialize/align flag."""
    native = _native()
    ints = [0, 1, 2, 15, 16, 17, 31, 32, -1, -16, -17, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -(2 ** 31),
            -(2 ** 31) - 1, -(2 ** 31) - 16, 2 ** 32, 2 ** 63 - 1, 2 ** 63 - 16, 2 ** 63, 2 ** 63 + 16, 2 ** 64 - 1,
            -(2 ** 63)]
    values = ints + [True, False, 0.0, 1.5, float("inf"), None] + [
        Ptr(a, dt) for a in (0, 16, 4096, 8, 4098) for dt in (torch.float16, torch.bfloat16, torch.int8)]
    for a, b in itertools.combinations(values, 2):
        if L._spec(a) == L._spec(b):
            for flags in ((True, True), (True, False), (False, True), (False, False)):
                assert native(a, *flags) == native(b, *flags), (a, b, flags)


def test_descriptor_key_is_never_coarser_than_triton_specialization():
    native = _native()
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.empty(64, 64, dtype=torch.bfloat16)
    y = torch.empty(64, 64, dtype=torch.float16)
    descs = [TensorDescriptor(t, [64, 64], [64, 1], blk) for t in (x, y) for blk in ([32, 16], [16, 32])]
    descs += [TensorDescriptor(x, [32, 128], [128, 1], [32, 16])]
    mine = [L._spec(L.Descriptor(d.base, d.shape, d.strides, d.block_shape)) for d in descs]
    for (d1, k1), (d2, k2) in itertools.combinations(zip(descs, mine), 2):
        if k1 == k2:
            assert native(d1, True, True) == native(d2, True, True)


# -- against Triton 3.6's own binder, cache key and descriptor expansion (no GPU needed) ---------------

@pytest.fixture
def triton36(monkeypatch):
    """Triton 3.6's CUDA driver made active on a machine without a GPU (it makes no CUDA call here; the
    TMA descriptor fill is stubbed), so JIT functions build their real binders and the launcher finds
    3.6's pieces."""
    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"needs NVIDIA Triton 3.6 (found {triton.__version__})")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU tests check the real launches (XELINK_LAUNCH_CHECK)")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver

    fake = object.__new__(CudaDriver)
    fake.get_current_target = lambda: GPUTarget("cuda", 90, 32)
    fake.get_current_device = lambda: 0
    fake.utils = types.SimpleNamespace(fill_tma_descriptor=lambda *a: ("tma", a))
    monkeypatch.setattr(driver, "_active", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 0, raising=False)
    monkeypatch.setattr(L, "_T", None)
    monkeypatch.setattr(L, "_KERNELS", {})
    return triton


def test_triton36_pieces_are_found(triton36):
    from triton.backends.nvidia.driver import CudaLauncher

    t = L._triton()
    assert t.reason is None and t.launcher_type is CudaLauncher

    tl = triton36.language

    def kern(x_ptr, n, BLOCK: tl.constexpr):
        pass

    assert L.fast_path(triton36.jit(kern)) is None


def test_key_is_never_coarser_than_triton36_cache_key(triton36):
    """Calls whose fast-path keys are equal have equal Triton cache keys (Triton's binder and
    compute_cache_key, as JITFunction.run builds them), over a product of argument classes."""
    import random

    tl = triton36.language

    def _real_kernel(x_ptr, y_ptr, n, m, eps, flag, BLOCK: tl.constexpr, EVEN: tl.constexpr = False):
        pass

    kern = triton36.jit(do_not_specialize=["m"])(_real_kernel)
    t = L._triton()
    k = L._Kernel(kern)
    assert k.reason is None
    buf = torch.empty(256, dtype=torch.float16)
    ptrs = [buf, buf[8:], buf[1:], buf.view(torch.bfloat16), torch.empty(8, dtype=torch.int8)]
    ints = [0, 1, 2, 16, 17, 48, 2 ** 31 - 1, 2 ** 31, 2 ** 40 + 16, 2 ** 63 + 1]
    rng = random.Random(0)
    groups: dict = {}
    for _ in range(600):
        args = [rng.choice(ptrs), rng.choice(ptrs + [None]), rng.choice(ints), rng.choice(ints),
                rng.choice([0.5, 1e30, 3]), rng.choice([True, False])]
        kwargs = {"BLOCK": rng.choice([16, 32, 16.0])}
        if rng.random() < 0.5:
            kwargs["EVEN"] = rng.choice([True, False, 0])
        for opt, values in (("num_warps", [4, 8]), ("launch_pdl", [True, False, 1])):
            if rng.random() < 0.5:
                kwargs[opt] = rng.choice(values)
        mine = L._key(t, k, args, kwargs)[0]
        groups.setdefault(mine, set()).add(L._triton_key(t, kern, 0, args, kwargs))
    assert len(groups) > 50
    assert all(len(v) == 1 for v in groups.values()), [v for v in groups.values() if len(v) > 1][:2]


def test_descriptor_key_and_expansion_match_triton36(triton36):
    from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc
    from triton.tools.tensor_descriptor import TensorDescriptor

    tl = triton36.language

    def _real_desc_kernel(a_desc, n, BLOCK: tl.constexpr):
        pass

    kern = triton36.jit(_real_desc_kernel)
    t = L._triton()
    k = L._Kernel(kern)
    x = torch.empty(64, 64, dtype=torch.float16)
    descs = [L.Descriptor(b, s, st, blk) for b in (x, x[8:], x.view(torch.bfloat16))
             for s, st in (((64, 64), (64, 1)), ((32, 128), (128, 1))) for blk in ((16, 16), (8, 32))]
    groups: dict = {}
    for d in descs:
        for n in (16, 17):
            mine = L._key(t, k, (d, n), {"BLOCK": 8})[0]
            groups.setdefault(mine, set()).add(L._triton_key(t, kern, 0, (d, n), {"BLOCK": 8}))
            mine_td = L._key(t, k, (d.triton(), n), {"BLOCK": 8})[0]
            assert mine_td == mine  # Triton's TensorDescriptor and ours have the same key
    assert all(len(v) == 1 for v in groups.values())

    # The expansion the fast path hands the C launcher is what 3.6's wrapper hands it, with and without
    # TMA metadata.
    signature = {"a_desc": "tensordesc<fp16[16, 16]>", "n": "i32", "BLOCK": "constexpr"}
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [16, 16], "fp4_padded": False}
    for metas in (None, [meta]):
        got = []
        run = object.__new__(CudaLauncher)
        run.launch = wrap_handle_tensordesc(lambda *a: got.append(a), signature, metas)
        run.global_scratch_size = run.profile_scratch_size = 0
        run.launch_cooperative_grid, run.launch_pdl = False, True
        c = types.SimpleNamespace(run=run, function=7, packed_metadata=(4, 1, 0),
                                  src=types.SimpleNamespace(signature=signature),
                                  metadata=types.SimpleNamespace(tensordesc_meta=metas))
        t.raw_type = types.FunctionType
        d = descs[0]
        e = L._entry(t, k, c, (d, 16, 16))
        assert e is not L._PLAIN and e.descs[0][:2] == (0, None if metas is None else meta)
        run.launch(*range(13), TensorDescriptor(x, [64, 64], [64, 1], [16, 16]), 16, 16)  # 3.6's own path
        for _ in range(2):  # a miss, then the cached expansion
            assert L._expand(t, e, (d, 16, 16)) == list(got[0][13:])


def test_every_call_site_keys_like_triton36(triton36, monkeypatch):
    """The arguments xelink's wrappers pass at each launch site (captured on CPU tensors, TRITON_INTERPRET
    set for the wrappers' device checks while the kernels stay JIT functions): every one is of a kind the
    key knows, and equal keys give equal Triton cache keys, over shapes, layouts, alignments, dtypes."""
    import importlib

    mods = {m: importlib.import_module(f"xelink.kernels.{m}") for m in ("gemm", "gemv", "norm", "attention")}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []
    def capture(fn, grid, *a, **kw):
        seen.append((fn, grid, a, kw))

    for m in mods.values():
        if hasattr(m, "launch"):  # the sites that call launch themselves
            monkeypatch.setattr(m, "launch", capture)
    monkeypatch.setattr(L, "launch", capture)  # the launch plans' launch_plan (no slot: these calls are not remembered)
    gemm, gemv, norm, A = (mods[m] for m in ("gemm", "gemv", "norm", "attention"))
    g = torch.Generator().manual_seed(5)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    for dtype in (torch.bfloat16, torch.float16):
        for M, N, K in ((64, 64, 64), (128, 256, 64), (33, 48, 80), (256, 256, 4096)):
            for a_col, b_col in ((False, False), (False, True), (True, False)):
                a = rnd(K, M, dtype=dtype).T if a_col else rnd(M, K, dtype=dtype)
                b = rnd(N, K, dtype=dtype).T if b_col else rnd(K, N, dtype=dtype)
                for impl in ("cuda", "triton"):
                    if impl == "triton" or gemm._tma_applies(a, b):
                        gemm.gemm(a, b, impl=impl)
            big = rnd(M * K + 8, dtype=dtype)
            gemm.gemm(big[1:1 + M * K].view(M, K), rnd(K, N, dtype=dtype), impl="triton")  # misaligned
    for fmt in ("bf16", "w8a16", "w4a16"):
        for N, K, M in ((256, 512, 1), (256, 512, 8), (4096, 1024, 2), (128, 8192, 1)):
            w = rnd(N, K)
            wq, sc = (w, None) if fmt == "bf16" else (gemv.pack_w8a16(w) if fmt == "w8a16" else gemv.pack_w4a16(w))
            gemv.gemv(wq, rnd(M, K), sc, fmt, "triton")
    for rows, H in ((8, 4096), (3, 1000), (2, 20000)):
        for res in (None, rnd(rows, H)):
            norm.rmsnorm(rnd(rows, H), rnd(H), residual=res, impl="triton")
            norm.rmsnorm(rnd(rows * H + 1)[1:].view(rows, H), rnd(H), residual=res, impl="triton")
    for S in (1, 7, 64):
        norm.rope(rnd(1, 8, S, 128), rnd(1, 2, S, 128), rnd(S, 128), rnd(S, 128), impl="triton")
        norm.rope(rnd(2, 4, S, 64), rnd(2, 4, S, 64), rnd(2, S, 64), rnd(2, S, 64), impl="triton")
    for B, HQ, HKV, SQ, SK, D, causal in ((1, 4, 2, 128, 256, 128, True), (2, 2, 2, 65, 65, 64, False),
                                          (1, 2, 1, 100, 300, 256, True)):
        q, k, v = rnd(B, HQ, SQ, D), rnd(B, HKV, SK, D), rnd(B, HKV, SK, D)
        for impl in ("cuda", "triton"):
            A.flash_attention(q, k, v, causal=causal, impl=impl)
            A.flash_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, causal=causal, impl=impl)
        lens = torch.full((B,), SK - 3, dtype=torch.int32)
        A.decode_attention(q[:, :, :1], k, v, lens, impl="triton")
        o, lse = rnd(B, HQ, 1, D), torch.randn(B, HQ, 1)
        A.merge_attention([o, o, o], [lse, lse, lse], impl="triton")
    t = L._triton()
    groups: dict = {}
    kernels = set()
    for fn, grid, args, kwargs in seen:
        k = L._KERNELS.get(id(fn)) or L._KERNELS.setdefault(id(fn), L._Kernel(fn))
        assert k.reason is None, (fn, k.reason)
        mine = L._key(t, k, args, kwargs)[0]
        groups.setdefault((id(fn), mine), set()).add(L._triton_key(t, fn, 0, args, kwargs))
        kernels.add(fn.__name__)
    assert {"_gemm_kernel", "_gemm_tma_kernel", "_gemv_kernel", "_gemv_fma_kernel", "_gemv_words_kernel",
            "_rmsnorm_kernel", "_rope_kernel", "_flash_fwd_kernel", "_flash_fwd_tma_kernel",
            "_decode_split_kernel", "_merge_kernel"} <= kernels
    assert all(len(v) == 1 for v in groups.values())
    assert len(groups) > 60


# -- GPU: every wired kernel through the fast path ---------------------------------------------------

def _fast_counts():
    return {id(k.fn): k.fast for k in L._KERNELS.values()}


@pytest.fixture
def checked_launches(requires_gpus):
    """GPU launches with every fast launch checked against Triton's own key; yields a function that says
    whether the fast path ran since the last call (always True where Triton 3.6 is installed)."""
    requires_gpus(1)
    pytest.importorskip("triton")
    import triton

    L.set_check(True)
    on = triton.__version__.startswith("3.6.")
    before = [_fast_counts()]

    def ran_fast():
        now = _fast_counts()
        moved = any(v > before[0].get(k, 0) for k, v in now.items())
        before[0] = now
        return moved or not on

    yield ran_fast
    L.set_check(None)


def _rel(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _took_fast_path(*kernels) -> bool:
    """Each of ``kernels`` launched through the fast path at least once (where Triton 3.6 makes it on)."""
    import triton

    if not triton.__version__.startswith("3.6."):
        return True
    return all(L._KERNELS[id(k)].fast > 0 for k in kernels)


@pytest.mark.gpu
def test_gpu_gemm_fast_path_new_tensors_alignments_shapes(checked_launches):
    from xelink.kernels.gemm import gemm, reference_gemm

    g = torch.Generator(device="cuda").manual_seed(0)
    for impl in ("cuda", "triton", "auto"):
        for M, N, K, layout in ((256, 256, 128, "rr"), (256, 256, 128, "rr"), (192, 128, 320, "rc"),
                                (64, 512, 256, "cr"), (130, 72, 48, "rr"), (256, 256, 128, "cc")):
            for _ in range(3):  # fresh tensors each time (often at the same addresses)
                a = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
                b = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
                if layout[0] == "c":
                    a = a.T.contiguous().T
                if layout[1] == "c":
                    b = b.T.contiguous().T
                out = gemm(a, b, impl=impl)
                assert _rel(out, reference_gemm(a, b)) < 1e-2, (impl, M, N, K, layout)
        assert checked_launches()
    from xelink.kernels.gemm import _gemm_kernel, _gemm_tma_kernel

    assert _took_fast_path(_gemm_kernel, _gemm_tma_kernel)  # the TMA kernel's descriptors included
    # A misaligned view after aligned calls of the same shape: auto leaves the TMA kernel, cuda refuses it.
    buf = torch.randn(257 * 128 + 8, device="cuda").to(torch.bfloat16)
    b = torch.randn(128, 128, device="cuda").to(torch.bfloat16)
    a = buf[:256 * 128].view(256, 128)
    assert _rel(gemm(a, b), reference_gemm(a, b)) < 1e-2
    a1 = buf[1:1 + 256 * 128].view(256, 128)
    assert _rel(gemm(a1, b), reference_gemm(a1, b)) < 1e-2
    with pytest.raises(ValueError, match="impl='cuda' needs"):
        gemm(a1, b, impl="cuda")
    # out= blocks of one buffer, aligned and not, twice each; an out overlapping an input is refused every
    # time (the remembered checks hold no addresses).
    big = torch.zeros(256, 640, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 256, device="cuda").to(torch.bfloat16)
    for _ in range(2):
        for c0 in (0, 256, 8, 1):
            out = big[:, c0:c0 + 256]
            assert gemm(a, b, out=out) is out and _rel(out, reference_gemm(a, b)) < 1e-2, c0
        for _ in range(2):
            with pytest.raises(ValueError, match="overlaps"):
                gemm(big[:, :128], b, out=big[:, 128:384])


@pytest.mark.gpu
def test_gpu_keyed_launches_remember_argument_lists(requires_gpus):
    # launch_keyed (gemm's remembered plans): with the Triton-key check off, a known (a, b, c) address triple goes
    # straight to the C launcher with its remembered CUtensorMaps. Rotating inputs and outputs among buffers
    # (addresses coming back with new contents, a new output each call, out= blocks) must give each call's
    # own product, in eager calls and in a graph captured after the lists were remembered.
    requires_gpus(1)
    triton = pytest.importorskip("triton")
    G = importlib.import_module("xelink.kernels.gemm")  # (the package's gemm is the function)

    g = torch.Generator(device="cuda").manual_seed(5)
    L.set_check(False)
    try:
        for impl in ("cuda", "triton") if torch.cuda.get_device_capability()[0] == 9 else ("triton",):
            As = [torch.randn(256, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
            Bs = [torch.randn(128, 384, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
            outs = [torch.empty(256, 384, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            for i in range(24):
                a, b = As[i % 3], Bs[i % 2]
                if i % 5 == 4:
                    a.copy_(torch.randn(256, 128, device="cuda", generator=g))  # same address, new contents
                c = G.gemm(a, b, impl=impl) if i % 2 else G.gemm(a, b, impl=impl, out=outs[i % 4 // 2])
                assert _rel(c, G.reference_gemm(a, b)) < 1e-2, (impl, i)
            plan = G._PATHS[G.path_key((impl, None), (As[0], Bs[0]), (None,))][2]
            if triton.__version__.startswith("3.6.") and impl == "cuda":
                assert plan.slot.ready, "the TMA plan remembered no argument list"
            x, y = As[0].clone(), Bs[1].clone()
            G.gemm(x, y, impl=impl)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                z = G.gemm(x, y, impl=impl)
            for _ in range(3):
                x.copy_(torch.randn(256, 128, device="cuda", generator=g))
                graph.replay()
                assert _rel(z, G.reference_gemm(x, y)) < 1e-2, impl
    finally:
        L.set_check(None)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
def test_gpu_gemv_fast_path(checked_launches, fmt):
    from xelink.kernels.gemv import gemv, pack_w4a16, pack_w8a16, reference_gemv

    g = torch.Generator(device="cuda").manual_seed(1)
    for impl in ("cuda", "triton"):
        for N, K, M in ((512, 1024, 1), (512, 1024, 1), (1024, 4096, 8), (384, 256, 3), (8192, 512, 1)):
            for _ in range(2):
                w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16) * 0.05
                x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
                wq, s = (w, None) if fmt == "bf16" else (pack_w8a16(w) if fmt == "w8a16" else pack_w4a16(w))
                out = gemv(wq, x, s, fmt, impl)
                assert _rel(out, reference_gemv(wq, x, s, fmt)) < 1e-2, (impl, N, K, M)
        # Remembered checks (gemv._PATHS): a 1-D x with and without out= (a block of a larger buffer), the
        # same geometry at new addresses, each twice.
        big = torch.zeros(2, 1024, device="cuda", dtype=torch.bfloat16)
        for i in range(4):
            w = torch.randn(512, 1024, device="cuda", generator=g).to(torch.bfloat16) * 0.05
            x1 = torch.randn(1024, device="cuda", generator=g).to(torch.bfloat16)
            wq, s = (w, None) if fmt == "bf16" else (pack_w8a16(w) if fmt == "w8a16" else pack_w4a16(w))
            want = reference_gemv(wq, x1, s, fmt)
            got = gemv(wq, x1, s, fmt, impl) if i % 2 else gemv(wq, x1, s, fmt, impl, out=big[1, 256:768])
            assert got.shape == (512,) and _rel(got, want) < 1e-2, (impl, i)
            assert i % 2 or got.data_ptr() == big[1, 256:].data_ptr()
        assert checked_launches()
    from xelink.kernels import gemv_tc

    if fmt != "bf16" and gemv_tc.TC_AVAILABLE:  # the Gluon kernel (8 rows of quantized weights) too
        assert _took_fast_path(gemv_tc._gemv_tc_kernel)


@pytest.mark.gpu
def test_gpu_norms_fast_path(checked_launches):
    from xelink.kernels.norm import reference_rmsnorm, reference_rope, rmsnorm, rope

    g = torch.Generator(device="cuda").manual_seed(2)
    for rows, H in ((8, 4096), (8, 4096), (33, 1000), (4, 20000)):
        buf = torch.randn(rows * H + 8, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)
        for off in (0, 1, 8):  # the base's alignment changes
            x = buf[off:off + rows * H].view(rows, H)
            r = torch.randn(rows, H, device="cuda", generator=g).to(torch.bfloat16)
            assert _rel(rmsnorm(x, w), reference_rmsnorm(x, w)) < 1e-2
            out, h = rmsnorm(x, w, residual=r)
            want, want_h = reference_rmsnorm(x, w, residual=r)
            assert _rel(out, want) < 1e-2 and torch.equal(h, want_h)
    # Remembered paths (norm._PATHS): eps changes between equal calls, out= blocks, 3-D rows, a column view
    # of x (not rows: never remembered), each call twice or more.
    x3 = torch.randn(2, 5, 512, device="cuda", generator=g).to(torch.bfloat16)
    w3 = torch.randn(512, device="cuda", generator=g).to(torch.bfloat16)
    big = torch.zeros(2, 5, 1024, device="cuda", dtype=torch.bfloat16)
    for eps in (1e-6, 0.5, 1e-6, 2.0):
        assert _rel(rmsnorm(x3, w3, eps), reference_rmsnorm(x3, w3, eps)) < 1e-2, eps
        out = big[..., 256:768]
        got, h = rmsnorm(x3, w3, eps, residual=x3 * 2, out=out)
        want, want_h = reference_rmsnorm(x3, w3, eps, residual=x3 * 2)
        assert got is out and _rel(out, want) < 1e-2 and torch.equal(h, want_h), eps
        wide = torch.randn(512, 8, device="cuda", generator=g).to(torch.bfloat16)[:, 1:5]  # stride(-1)=1, rows 8 apart
        assert _rel(rmsnorm(wide, w3[:4]), reference_rmsnorm(wide, w3[:4])) < 1e-2
        col = torch.randn(4, 512, device="cuda", generator=g).to(torch.bfloat16).T  # stride(-1) != 1: a copy
        assert _rel(rmsnorm(col, w3[:4]), reference_rmsnorm(col, w3[:4])) < 1e-2
    for B, HQ, HK, S, D in ((1, 8, 2, 64, 128), (2, 4, 4, 7, 64), (1, 8, 2, 64, 128)):
        q = torch.randn(B, HQ, S, D, device="cuda", generator=g).to(torch.bfloat16)
        k = torch.randn(B, HK, S, D, device="cuda", generator=g).to(torch.bfloat16)
        cos, sin = torch.randn(S, D, device="cuda", generator=g), torch.randn(S, D, device="cuda", generator=g)
        for got, want in zip(rope(q, k, cos, sin), reference_rope(q, k, cos, sin)):
            assert _rel(got, want) < 1e-2
    assert checked_launches()


@pytest.mark.gpu
def test_gpu_attention_fast_path(checked_launches):
    from xelink.kernels import attention as A

    g = torch.Generator(device="cuda").manual_seed(3)
    impls = ("cuda", "triton") if torch.cuda.get_device_capability()[0] == 9 else ("triton",)
    for impl in impls:
        for B, HQ, HKV, SQ, SK, D, causal in ((1, 4, 2, 128, 256, 128, True), (1, 4, 2, 128, 256, 128, True),
                                              (2, 2, 2, 65, 65, 64, False), (1, 2, 1, 100, 300, 256, True)):
            q = torch.randn(B, HQ, SQ, D, device="cuda", generator=g).to(torch.bfloat16)
            k = torch.randn(B, HKV, SK, D, device="cuda", generator=g).to(torch.bfloat16)
            v = torch.randn(B, HKV, SK, D, device="cuda", generator=g).to(torch.bfloat16)
            out, lse = A.flash_attention(q, k, v, causal=causal, return_lse=True, impl=impl)
            ref, ref_lse = A.reference_flash_attention(q, k, v, causal=causal, return_lse=True)
            assert _rel(out, ref) < 2e-2 and _rel(lse, ref_lse) < 1e-3
            lens = torch.tensor([SK - 3] * B, device="cuda", dtype=torch.int32)
            qd = q[:, :, :1]
            out, lse = A.decode_attention(qd, k, v, lens, return_lse=True, impl="triton")  # its one kernel
            ref, ref_lse = A.reference_decode_attention(qd, k, v, lens, return_lse=True)
            assert _rel(out, ref) < 2e-2 and _rel(lse, ref_lse) < 1e-3
            halves = [A.flash_attention(q, k[:, :, s], v[:, :, s], return_lse=True, impl=impl)
                      for s in (slice(0, SK // 2), slice(SK // 2, SK))]
            out, lse = A.merge_attention([h[0] for h in halves], [h[1] for h in halves], impl="triton")
            ref, ref_lse = A.reference_flash_attention(q, k, v, return_lse=True)
            assert _rel(out, ref) < 2e-2 and _rel(lse, ref_lse) < 1e-3
    # Remembered checks (attention._PATHS): a flag of another class after an equal good call is still refused.
    A.flash_attention(q, k, v, causal=True, impl=impls[0])
    with pytest.raises(TypeError, match="causal=1 must be a bool"):
        A.flash_attention(q, k, v, causal=1, impl=impls[0])
    A.decode_attention(qd, k, v, lens, num_splits=2)
    with pytest.raises(TypeError, match="return_lse"):
        A.decode_attention(qd, k, v, lens, num_splits=2, return_lse=0)
    assert checked_launches()
    kernels = [A._flash_fwd_kernel, A._decode_split_kernel, A._merge_kernel]
    assert _took_fast_path(*kernels, *([A._flash_fwd_tma_kernel] if "cuda" in impls else []))


@pytest.mark.gpu
def test_gpu_fast_path_in_cuda_graphs_with_new_inputs(checked_launches):
    """Each kernel warmed up (fast path), then captured; replays after new inputs are copied in give the
    new results."""
    from xelink.kernels import attention as A
    from xelink.kernels.gemm import gemm, reference_gemm
    from xelink.kernels.gemv import gemv, pack_w4a16, reference_gemv
    from xelink.kernels.norm import reference_rmsnorm, rmsnorm

    g = torch.Generator(device="cuda").manual_seed(4)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    a, b = rnd(256, 128), rnd(128, 192)
    w4, s4 = pack_w4a16(rnd(512, 1024, scale=0.05))
    x = rnd(1, 1024)
    xn, wn = rnd(16, 2048), rnd(2048)
    q, k, v = rnd(1, 4, 1, 128), rnd(1, 2, 512, 128), rnd(1, 2, 512, 128)
    lens = torch.tensor([300], device="cuda", dtype=torch.int32)
    calls = {
        "gemm": (lambda: gemm(a, b), lambda: reference_gemm(a, b)),
        "gemv": (lambda: gemv(w4, x, s4, "w4a16", "cuda"), lambda: reference_gemv(w4, x, s4, "w4a16")),
        "rmsnorm": (lambda: rmsnorm(xn, wn), lambda: reference_rmsnorm(xn, wn)),
        "decode": (lambda: A.decode_attention(q, k, v, lens), lambda: A.reference_decode_attention(q, k, v, lens)),
    }
    for name, (call, _) in calls.items():
        call(), call()  # compile, then the fast path
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call, _ in calls.values():
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {name: call() for name, (call, _) in calls.items()}
    for _ in range(2):
        for t in (a, b, x, xn, wn, q, k, v):
            t.copy_(rnd(*t.shape))
        lens.fill_(int(torch.randint(1, 512, (1,))))
        graph.replay()
        torch.cuda.synchronize()
        for name, (_, ref) in calls.items():
            assert _rel(outs[name], ref()) < 2e-2, name
    assert checked_launches()
