"""xelink.sycl on the CPU OpenCL device: every op x algorithm x dtype, checked exactly on the whole buffer.

The payload lives in device USM (filled and read by queue copies), so only the kernels and queue copies
can produce the results. These tests never skip: without dpctl or a device they fail.
"""
import os
import sys

# dpctl sees no device unless the ICD loader is pointed at the wheel's library before dpctl loads.
os.environ["OCL_ICD_FILENAMES"] = os.path.join(sys.prefix, "lib", "libintelocl.so")

import dpctl  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import xelink  # noqa: E402
import xelink.sycl as xs  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16", "int32", "int64"]
SIZES = [0, 1, 37, (1 << 15) + 3]
OPS = ["sum", "max", "min"]
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32, "int32": np.int32, "int64": np.int64}


def _subs():
    return [c.device for c in xs.communicators()]


# name -> (devices, packages); built once per session (contexts and kernel builds are cached by xelink).
CONFIGS = {
    "sub2": (lambda: None, None),                                    # the 2 sub-devices, one package
    "sub2_split": (lambda: None, [[0], [1]]),                        # the 2 sub-devices as 2 packages
    "tiles3": (lambda: ["opencl:cpu"] * 3, None),                   # 3 queues of one device, one package
    "tiles3_uneven": (lambda: ["opencl:cpu"] * 3, [[0, 1], [2]]),
    "tiles4": (lambda: ["opencl:cpu"] * 4, None),
    "sub4_2x2": (lambda: [s for s in _subs() for _ in range(2)], [[0, 1], [2, 3]]),  # 2 tiles on each sub-device
}
_made: dict = {}


def comms_of(name):
    if name not in _made:
        devices, packages = CONFIGS[name]
        _made[name] = xs.communicators(devices(), packages=packages)
    return _made[name]


def words(values, dtype):
    """Small integers as the storage words of ``dtype`` (bfloat16: the top half of float32, exact here)."""
    v = np.asarray(values)
    if dtype == "bfloat16":
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(_NP[dtype])


def values(stored, dtype):
    if dtype == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return stored.astype(np.float64)


def pattern(r, n, salt=0):
    i = np.arange(n, dtype=np.int64)
    return ((i * 7 + r * 13 + salt * 5) % 23) - 11


def fill(comm, n, dtype, data, usm="device"):
    return xs.empty(comm, n, dtype, usm=usm).from_host(words(data, dtype))


def reference(op, stacked):
    return {"sum": np.sum, "max": np.max, "min": np.min}[op](stacked, axis=0)


def check(got, expect, dtype, what):
    got = values(got, dtype)
    bad = np.flatnonzero(got != expect)
    assert bad.size == 0, f"{what}: {bad.size} wrong elements, first at {bad[0]}: {got[bad[0]]} != {expect[bad[0]]}"


def test_device_visible():
    assert dpctl.get_devices(), "dpctl sees no device (OCL_ICD_FILENAMES)"
    comms = xs.communicators()
    assert len(comms) == 2 and [c.rank for c in comms] == [0, 1]
    assert comms[0].packages == [[0, 1]] and comms[1].package == 0
    assert all(c.device.parent_device is not None for c in comms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ["auto", *xs.ALGOS["all_reduce"]])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_all_reduce(config, algo, dtype):
    comms = comms_of(config)
    p = len(comms)
    for n in SIZES:
        for op in OPS:
            data = [pattern(r, n) for r in range(p)]
            arrs = [fill(c, n, dtype, data[c.rank]) for c in comms]
            xs.all_reduce(arrs, op=op, algo=algo)
            expect = reference(op, np.stack(data)) if n else np.zeros(0)
            for r, a in enumerate(arrs):
                check(a.to_host(), expect, dtype, f"{config} {algo} {op} n={n} rank {r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ["auto", *xs.ALGOS["all_gather"]])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_all_gather(config, algo, dtype):
    comms = comms_of(config)
    p = len(comms)
    for n in SIZES:
        data = [pattern(r, n) for r in range(p)]
        ins = [fill(c, n, dtype, data[c.rank]) for c in comms]
        outs = [fill(c, p * n, dtype, np.full(p * n, 99)) for c in comms]
        xs.all_gather_into_tensor(outs, ins, algo=algo)
        expect = np.concatenate(data).astype(np.float64)
        for r, o in enumerate(outs):
            check(o.to_host(), expect, dtype, f"{config} {algo} n={n} rank {r}")


@pytest.mark.parametrize("algo", ["direct", "ring", "topo"])
def test_all_gather_in_place(algo):
    comms = comms_of("sub4_2x2")
    p, n = len(comms), 5
    outs = [fill(c, p * n, "int32", np.concatenate([pattern(c.rank, n) if j == c.rank else np.full(n, 99)
                                                    for j in range(p)])) for c in comms]
    ins = [SyclView(o, c.rank * n, n) for o, c in zip(outs, comms)]
    xs.all_gather_into_tensor(outs, ins, algo=algo)
    for r, o in enumerate(outs):
        check(o.to_host(), np.concatenate([pattern(j, n) for j in range(p)]), "int32", f"in place rank {r}")


def SyclView(array, start, count):
    """Rank r's own block of an output (the in-place gather's input)."""
    return xs.SyclArray(array.comm, array.elements(start, count), count, array.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ["auto", *xs.ALGOS["reduce_scatter"]])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_reduce_scatter(config, algo, dtype):
    comms = comms_of(config)
    p = len(comms)
    for n in SIZES:
        for op in OPS:
            data = [pattern(r, p * n, salt=1) for r in range(p)]
            ins = [fill(c, p * n, dtype, data[c.rank]) for c in comms]
            outs = [fill(c, n, dtype, np.full(n, 99)) for c in comms]
            xs.reduce_scatter_tensor(outs, ins, op=op, algo=algo)
            full = reference(op, np.stack(data)) if n else np.zeros(0)
            for r, o in enumerate(outs):
                check(o.to_host(), full[r * n:(r + 1) * n], dtype, f"{config} {algo} {op} n={n} rank {r}")
            for r, a in enumerate(ins):  # the inputs are left as they were
                check(a.to_host(), data[r].astype(np.float64), dtype, f"{config} {algo} input {r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_all_to_all(config, dtype):
    comms = comms_of(config)
    p = len(comms)
    for m in [0, 1, 9, 4099]:
        data = [pattern(r, p * m, salt=2) for r in range(p)]
        ins = [fill(c, p * m, dtype, data[c.rank]) for c in comms]
        outs = [fill(c, p * m, dtype, np.full(p * m, 99)) for c in comms]
        xs.all_to_all_single(outs, ins)
        for r, o in enumerate(outs):
            expect = np.concatenate([data[j][r * m:(r + 1) * m] for j in range(p)]).astype(np.float64)
            check(o.to_host(), expect, dtype, f"{config} m={m} rank {r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_broadcast(config, dtype):
    comms = comms_of(config)
    p = len(comms)
    for n in SIZES:
        for src in range(p):
            data = [pattern(r, n, salt=3) for r in range(p)]
            arrs = [fill(c, n, dtype, data[c.rank]) for c in comms]
            xs.broadcast(arrs, src=src)
            for r, a in enumerate(arrs):
                check(a.to_host(), data[src].astype(np.float64), dtype, f"{config} src={src} n={n} rank {r}")


def test_async_chain():
    """Handles: an all-gather enqueued behind an all-reduce (no wait between) reads the reduced data."""
    comms = comms_of("tiles4")
    p, n = len(comms), 1001
    data = [pattern(r, n) for r in range(p)]
    arrs = [fill(c, n, "int64", data[c.rank]) for c in comms]
    outs = [fill(c, p * n, "int64", np.full(p * n, 99)) for c in comms]
    h1 = xs.all_reduce(arrs, algo="ring", async_op=True)
    h2 = xs.all_gather_into_tensor(outs, arrs, algo="topo", async_op=True)
    assert h2.wait(timeout=30) is True and h1.wait(timeout=30) is True
    assert h1.is_completed() and h2.is_completed()
    # torch.distributed's Work protocol: the arrays written, as result() and as the future's value
    assert isinstance(h1, xelink.Work) and h1.exception() is None
    assert all(a is b for a, b in zip(h1.result(), arrs)) and len(h1.result()) == p
    assert all(a is b for a, b in zip(h2.get_future().wait(), outs)) and len(h2.get_future().wait()) == p
    total = np.sum(np.stack(data), axis=0).astype(np.float64)
    for r, o in enumerate(outs):
        check(o.to_host(), np.tile(total, p), "int64", f"rank {r}")


def test_shared_usm_numpy_view():
    comms = comms_of("sub2")
    arrs = [xs.empty(c, 6, "float32") for c in comms]
    for c, a in zip(comms, arrs):
        a.numpy()[:] = np.arange(6) + c.rank
    xs.all_reduce(arrs, algo="two_shot")
    for a in arrs:
        np.testing.assert_array_equal(a.numpy(), 2 * np.arange(6) + 1)
    dev = xs.empty(comms[0], 3, "float32", usm="device")
    with pytest.raises(ValueError, match="SyclArray.numpy: usm='device'"):
        dev.numpy()


def test_barrier():
    comms = comms_of("sub2")
    xs.barrier(comms, timeout=10)
    xs.barrier(comms, timeout=10)
    tiles = comms_of("tiles4")
    xs.barrier(tiles, timeout=10)


def test_barrier_timeout_names_the_missing_device():
    comms = comms_of("sub2")
    with pytest.raises(xelink.TimeoutError) as info:
        xs.barrier([comms[0]], timeout=0.5)
    err = info.value
    assert err.what == "barrier" and err.missing == [1] and err.timeout == 0.5
    assert "rank(s) 1" in str(err) and "did not arrive: rank 1" in str(err) and "sub-device" in str(err)
    xs.barrier(comms, timeout=10)  # the group's barrier works again afterwards


def test_rejects_bad_input_before_any_kernel():
    comms = comms_of("sub2")
    other = comms_of("sub2_split")
    a = [fill(c, 4, "int32", np.arange(4)) for c in comms]
    last = comms[0].team.last
    cases = [
        (lambda: xs.all_reduce(a[::-1]), ValueError, r"all_reduce: arrays\[0\] lives on rank 1's device"),
        (lambda: xs.all_reduce([a[0], fill(other[1], 4, "int32", np.arange(4))]), ValueError,
         r"all_reduce: arrays\[1\] belongs to another group"),
        (lambda: xs.all_reduce([a[0], xs.empty(comms[1], 5, "int32")]), ValueError,
         r"all_reduce: len\(arrays\[1\]\)=5 != len\(arrays\[0\]\)=4"),
        (lambda: xs.all_reduce([a[0], xs.empty(comms[1], 4, "int64")]), TypeError,
         r"all_reduce: arrays\[1\].dtype=int64 != arrays\[0\].dtype=int32"),
        (lambda: xs.all_reduce(a, algo="bogus"), ValueError, r"all_reduce: algo='bogus' is not one of"),
        (lambda: xs.all_reduce(a, op="prod"), ValueError, r"all_reduce: op='prod' is not one of"),
        (lambda: xs.all_reduce(a[:1]), ValueError, r"all_reduce: len\(arrays\)=1 != the group's size 2"),
        (lambda: xs.all_reduce([a[0], np.zeros(4)]), TypeError, r"all_reduce: arrays\[1\]=.* is not a SyclArray"),
        (lambda: xs.all_gather_into_tensor(a, a), ValueError,
         r"all_gather_into_tensor: len\(outs\[0\]\)=4 != 2\*len\(ins\[0\]\)=8"),
        (lambda: xs.all_gather_into_tensor([xs.empty(c, 8, "int32") for c in comms], a, algo="tree"), ValueError,
         r"all_gather_into_tensor: algo='tree'"),
        (lambda: xs.reduce_scatter_tensor(a, a), ValueError,
         r"reduce_scatter_tensor: 2\*len\(outs\[0\]\)=8 != len\(ins\[0\]\)=4"),
        (lambda: xs.reduce_scatter_tensor([SyclView(x, 0, 2) for x in a], a), ValueError,
         r"reduce_scatter_tensor: outs\[0\] overlaps ins\[0\]"),
        (lambda: xs.all_to_all_single([xs.empty(c, 3, "int32") for c in comms],
                                      [xs.empty(c, 3, "int32") for c in comms]), ValueError,
         r"all_to_all_single: len\(ins\[0\]\)=3 is not divisible by the group's size 2"),
        (lambda: xs.broadcast(a, src=2), ValueError, r"broadcast: src=2 is not a rank"),
        (lambda: xs.barrier([comms[0], other[1]]), ValueError, r"barrier: comms belong to different groups"),
        (lambda: xs.empty(comms[0], 4, "float64"), ValueError, r"empty: dtype='float64'"),
        (lambda: xs.empty(comms[0], -1), ValueError, r"empty: n=-1"),
        (lambda: xs.empty(comms[0], 4, usm="host"), ValueError, r"empty: usm='host'"),
        (lambda: xs.communicators(["opencl:gpu:7"]), ValueError, r"communicators: devices\[0\]='opencl:gpu:7'"),
        (lambda: xs.communicators([3]), TypeError, r"communicators: devices\[0\]=3 is not a dpctl.SyclDevice"),
        (lambda: xs.communicators(["opencl:cpu"] * 2, packages=[[0]]), ValueError,
         r"communicators: packages=\[\[0\]\] is not a partition"),
        (lambda: xs.communicators(["opencl:cpu"] * 2, packages=[[0.0], [1]]), ValueError,
         r"communicators: packages=\[\[0.0\], \[1\]\] is not a partition"),  # (a float rank failed later)
        (lambda: xs.all_reduce(a, algo=["ring"]), TypeError, r"all_reduce: algo=\['ring'\] must be a str"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
    # a bad XELINK_TIMEOUT fails before any kernel too (the arrays were reduced, then the wait raised)
    os.environ["XELINK_TIMEOUT"] = "abc"
    try:
        with pytest.raises(xelink.ConfigError, match=r"XELINK_TIMEOUT='abc' is not a number of seconds"):
            xs.all_reduce(a)
    finally:
        del os.environ["XELINK_TIMEOUT"]
    assert comms[0].team.last is last, "a rejected call enqueued work"
    for x in a:
        np.testing.assert_array_equal(x.to_host(), np.arange(4))


def test_handle_wait_has_a_deadline():
    """A handle whose work never completes raises xelink.TimeoutError naming the rank (and device)."""
    from xelink.symm import sycl as symm_sycl

    class Stuck:
        execution_status = dpctl.event_status_type.running

    comms = comms_of("sub2")
    work = symm_sycl.Work(comms[0].team, "all_reduce", [None, Stuck()])
    with pytest.raises(xelink.TimeoutError, match=r"all_reduce: timed out after 0.2 s waiting for rank\(s\) 1 "
                                                  r"\(rank 1: .*sub-device"):
        work.wait(timeout=0.2)
    assert not work.is_completed()


def test_more_ranks_than_one_kernel_reads():
    """9 queues: a reduce over more than 8 sources chains kernel launches (csrc reads at most 8 per launch)."""
    comms = xs.communicators(["opencl:cpu"] * 9, packages=[[0, 1, 2, 3, 4], [5, 6, 7, 8]])
    p, n = len(comms), 41
    for algo in xs.ALGOS["all_reduce"]:
        data = [pattern(r, n) for r in range(p)]
        arrs = [fill(c, n, "int32", data[c.rank]) for c in comms]
        xs.all_reduce(arrs, algo=algo)
        for r, a in enumerate(arrs):
            check(a.to_host(), np.sum(np.stack(data), axis=0), "int32", f"{algo} rank {r}")
    for algo in xs.ALGOS["reduce_scatter"]:
        data = [pattern(r, p * n, salt=1) for r in range(p)]
        ins = [fill(c, p * n, "float32", data[c.rank]) for c in comms]
        outs = [fill(c, n, "float32", np.full(n, 99)) for c in comms]
        xs.reduce_scatter_tensor(outs, ins, op="max", algo=algo)
        full = np.max(np.stack(data), axis=0)
        for r, o in enumerate(outs):
            check(o.to_host(), full[r * n:(r + 1) * n], "float32", f"{algo} rank {r}")


def _bf16_rne(x32):
    """float32 -> bfloat16 words, rounded to nearest even (finite inputs)."""
    u = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("algo", xs.ALGOS["all_reduce"])
@pytest.mark.parametrize("config", ["sub2", "sub2_split"])
def test_16_bit_sums_round_once_to_nearest_even(config, algo, dtype):
    """Two ranks: a + b in float32, rounded once (a sum of two is the same in every order)."""
    comms = comms_of(config)
    rng = np.random.default_rng(7)
    n = 4097
    x32 = [rng.standard_normal(n).astype(np.float32) * 3 for _ in comms]
    if dtype == "bfloat16":
        stored = [_bf16_rne(x) for x in x32]
        as32 = [(s.astype(np.uint32) << 16).view(np.float32) for s in stored]
        expect = _bf16_rne(as32[0] + as32[1])
    else:
        stored = [x.astype(np.float16) for x in x32]
        expect = (stored[0].astype(np.float32) + stored[1].astype(np.float32)).astype(np.float16)
    arrs = [xs.empty(c, n, dtype, usm="device").from_host(s) for c, s in zip(comms, stored)]
    xs.all_reduce(arrs, algo=algo)
    for r, a in enumerate(arrs):
        got = a.to_host()
        bad = np.flatnonzero(got.view(np.uint16) != expect.view(np.uint16))
        assert bad.size == 0, f"rank {r}: {bad.size} elements differ, first at {bad[0]}"


def test_icd_path_set_by_xelink_when_unset():
    """Without OCL_ICD_FILENAMES, xelink.sycl points the loader at the environment's libintelocl.so itself."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OCL_ICD_FILENAMES"}
    out = subprocess.run([sys.executable, "-c", "import xelink.sycl as xs; print(len(xs.communicators()))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


@pytest.mark.parametrize("op", ["max", "min"])
def test_nan_wins_max_and_min_wherever_it_sits(op):
    """As numpy and torch: a NaN on any rank makes the element NaN, for every algorithm (the kernels' source order
    used to decide)."""
    comms = comms_of("sub2")
    for algo in xs.ALGOS["all_reduce"]:
        for first in (0, 1):
            arrays = [fill(c, 2, "float32", np.array([np.nan, 1.0] if r == first else [1.0, 2.0]), usm="shared")
                      for r, c in enumerate(comms)]
            xs.all_reduce(arrays, op=op, algo=algo)
            got = [a.numpy().copy() for a in arrays]
            assert all(np.isnan(g[0]) and g[1] == (2.0 if op == "max" else 1.0) for g in got), (algo, first, got)


def test_bfloat16_from_host_takes_words_not_floats():
    comms = comms_of("sub2")
    with pytest.raises(TypeError, match="SyclArray.from_host: a bfloat16 array takes its 16-bit words"):
        xs.empty(comms[0], 3, "bfloat16").from_host(np.array([1.0, 2.5, -3.0]))


def test_communicators_again_reuse_the_context_sub_devices_and_programs():
    """Every call used to partition, build and keep a new context (the caches were keyed by the Python wrappers'
    addresses, new on every lookup): memory and seconds grew per call."""
    from xelink.sycl import api
    from xelink.symm import sycl as symm

    for devices in (None, ["opencl:cpu"] * 2):
        xs.all_reduce([xs.empty(c, 4, "int32").from_host(np.arange(4)) for c in xs.communicators(devices)])
        sizes = (len(api._contexts), len(api._sub_devices), len(symm._programs))
        for _ in range(3):
            comms = xs.communicators(devices)
            xs.all_reduce([xs.empty(c, 4, "int32").from_host(np.arange(4)) for c in comms])
        assert (len(api._contexts), len(api._sub_devices), len(symm._programs)) == sizes, devices


def test_arrays_sharing_memory_and_bad_views_are_refused():
    """Queues of one device may be handed views of one allocation: two ranks' outputs (or in-place arrays) in one
    memory would overwrite each other (a reduce-scatter returned one rank's block for both); a view past its
    buffer would copy out of bounds; a buffer of another device is refused."""
    sub = comms_of("sub2")  # two sub-devices
    with pytest.raises(ValueError, match="SyclArray: the buffer is on"):
        xs.SyclArray(sub[1], xs.empty(sub[0], 4, "int32").buffer, 4, "int32")
    comms = xs.communicators(["opencl:cpu"] * 2)  # one device, two queues
    one = fill(comms[0], 8, "int32", np.arange(8))
    with pytest.raises(ValueError, match=r"SyclArray: n=100 elements of int32 do not fit the buffer's 32 bytes"):
        xs.SyclArray(comms[0], one.buffer, 100, "int32")
    with pytest.raises(TypeError, match=r"SyclArray: dtype='int8' is not one of"):
        xs.SyclArray(comms[0], one.buffer, 2, "int8")
    with pytest.raises(ValueError, match=r"all_reduce: arrays\[1\] and arrays\[0\] share memory"):
        xs.all_reduce([one, xs.SyclArray(comms[1], one.buffer, 8, "int32")])
    halves = [xs.SyclArray(c, one.buffer.sub(16 * c.rank, 16), 4, "int32") for c in comms]
    out0 = xs.empty(comms[0], 2, "int32")
    outs = [out0, xs.SyclArray(comms[1], out0.buffer, 2, "int32")]
    with pytest.raises(ValueError, match=r"reduce_scatter_tensor: outs\[1\] and outs\[0\] share memory"):
        xs.reduce_scatter_tensor(outs, halves)
    xs.all_reduce(halves)  # disjoint halves of one allocation are two arrays
    check(one.to_host(), np.concatenate([np.arange(4) + np.arange(4, 8)] * 2), "int32", "disjoint halves")
    # an array is its n elements, not its whole buffer: numpy() and the overlap checks (two arrays at the start of
    # one allocation, each the first 4 elements of its own buffer view)
    shared = xs.empty(comms[0], 8, "int32", usm="shared").from_host(np.arange(8))
    head = xs.SyclArray(comms[0], shared.buffer, 4, "int32")
    assert len(head) == 4 and head.numpy().tolist() == [0, 1, 2, 3] == head.to_host().tolist()
    assert xs.SyclArray(comms[0], shared.buffer, np.int64(2), "int32").numpy().tolist() == [0, 1]
    twice = [xs.SyclArray(c, shared.buffer, 4, "int32") for c in comms]  # the same 4 elements: refused
    with pytest.raises(ValueError, match=r"all_reduce: arrays\[1\] and arrays\[0\] share memory"):
        xs.all_reduce(twice)
    xs.all_reduce([head, xs.SyclArray(comms[1], shared.buffer.sub(16, 16), 4, "int32")])  # (head: the whole buffer's
    assert shared.numpy().tolist() == [4, 6, 8, 10] * 2                                  # first half only)
