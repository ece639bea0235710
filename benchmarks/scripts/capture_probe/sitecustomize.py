"""A debugging aid (not part of xelink): find the first call that invalidates a CUDA graph capture.
Put this folder first on PYTHONPATH; every torch.cuda.graph capture then runs under a profile hook that asks
the driver for the capture stream's status after every Python/C call and prints the first call after which it
is invalidated, with the recent calls and the stack. Also prints every Triton compile / module load in a capture."""
import collections
import ctypes
import os
import sys
import traceback



def _say(msg):
    print(msg, file=sys.stderr, flush=True)
    d = os.environ.get("XELINK_CAPTURE_PROBE")
    if d and os.path.isdir(d):
        with open(os.path.join(d, f"probe-{os.getpid()}.txt"), "a") as f:
            f.write(msg + "\n")


def _install():
    try:
        import torch
        import torch.cuda
    except Exception:
        return
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    fn = cuda.cuStreamIsCapturing
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    status = ctypes.c_int(0)
    state = {"stream": None, "done": False, "ring": collections.deque(maxlen=150), "n": 0}

    import time

    def threads():
        out = []
        for tid in sorted(os.listdir("/proc/self/task")):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    out.append(f"{tid}:{f.read().strip()}")
            except OSError:
                pass
        py = []
        for ident, fr in sys._current_frames().items():
            py.append(f"-- python thread {ident}:\n" + "".join(traceback.format_stack(fr)[-6:]))
        return "native threads: " + " ".join(out) + "\n" + "\n".join(py)

    def where(frame):
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"

    def hook(frame, event, arg):
        if state["done"]:
            return
        state["n"] += 1
        name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", None) if event.startswith("c_") else None
        if event == "call" and frame.f_code.co_name in ("compile", "_init_handles", "load_binary", "_do_compile"):
            _say(f"[probe] during capture: {event} {where(frame)}")
        now = time.perf_counter()
        state["ring"].append(f"{event} {where(frame)} {name or ''} +{(now - state.get('t', now)) * 1e6:.0f}us")
        state["t"] = now
        fn(ctypes.c_void_p(state["stream"]), ctypes.byref(status))
        if status.value == 2:
            state["done"] = True
            _say(f"[probe] capture INVALIDATED after event #{state['n']}: {event} {where(frame)} {name or ''}\n"
                  "[probe] recent events:\n  " + "\n  ".join(state["ring"]) + "\n[probe] stack:\n" +
                  "".join(traceback.format_stack(frame)[-14:]) + threads())

    cls = torch.cuda.graph
    enter, exit_, init = cls.__enter__, cls.__exit__, cls.__init__
    mode = os.environ.get("XELINK_CAPTURE_PROBE_MODE")

    def __init__(self, *a, **kw):
        if mode:
            kw["capture_error_mode"] = mode
        init(self, *a, **kw)

    def __enter__(self):
        r = enter(self)
        state["stream"] = torch.cuda.current_stream().cuda_stream
        state["done"], state["n"] = False, 0
        state["k"] = state.get("k", 0) + 1
        state["ring"].clear()
        _say(f"[probe] capture {state['k']} begins (pid {os.getpid()}, mode {mode or 'as called'}, "
             f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING')})")
        sys.setprofile(hook)
        return r

    def __exit__(self, *exc):
        sys.setprofile(None)
        _say(f"[probe] capture ends after {state['n']} events, invalidated={state['done']}")
        return exit_(self, *exc)

    cls.__enter__, cls.__exit__, cls.__init__ = __enter__, __exit__, __init__


if os.environ.get("XELINK_CAPTURE_PROBE"):
    _install()
