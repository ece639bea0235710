"""Context-parallel attention: one sequence split by position over the ranks of a group, each rank's
queries attending to the keys of all of them.

Layouts (``layout=``, ``schedule.CP_LAYOUTS``; ``DESIGN.md``, "Context parallelism"): ``"contiguous"`` cuts
the sequence into n blocks, rank r holding block r; ``"zigzag"`` into 2n blocks, rank r holding blocks r and
2n-1-r concatenated in that order (every rank then has the same causal work). Block sizes are
``numpy.array_split``'s: the first ``S % blocks`` blocks are one position longer, so ranks' local lengths may
differ by one. ``cp_shard`` cuts a full tensor, ``cp_unshard`` gathers it back, ``cp_positions`` gives
a rank's global positions (for RoPE and masks).

The total length. Ranks may hold different local lengths, and one rank's length does not determine the
total (at 2 ranks, contiguous, rank 1 holds 5 positions of both 10 and 11). ``cp_attention`` therefore
exchanges every rank's call signature (local length, batch, heads, head dim, dtype, flags: a few ints, one
host ``allgather_object`` on the group) once per call and checks that the ranks agree and that the lengths
are the layout's for their sum; a caller that knows the total passes ``seq_len=`` (an extension of the
contract's signature) and no exchange happens (only this rank's length is checked against the layout).
The exchange is host-only, so it is allowed during CUDA-graph capture; a replay reuses the captured lengths.

Algorithms (``algo=``, ``CP_ALGOS``):

- ``"ring"``: the KV blocks (K and V of this rank packed into one ``(2, B, Hkv, S_local, D)`` buffer: GQA
  moves only the KV heads) travel around a ring whose order is ``schedule.topo_ring`` (the packages
  contiguous). At each of the n steps the flash attention of the block at hand runs while the next one
  moves; the partials are merged with their LSE (``merge_attention``) into a float32 accumulator.
  CPU ranks (``cp_host``): nonblocking ``isend``/``irecv`` on a private duplicate of the group (tag: the
  owner of the block). CUDA (``cp_device``): copy-engine pulls of the left neighbour's symmetric slot on a
  side stream, double-buffered, ordered by events and ``xelink.symm`` semaphores, no host sync.
- ``"all_gather"``: every rank's packed KV (padded to the longest local length) gathered with xelink's
  ``all_gather_into_tensor`` (asynchronously; its ``auto`` takes the topology-aware algorithm where the group
  has packages) while this rank's queries attend to its own KV; then the other ranks' blocks, put in global
  order and coalesced into runs of adjacent blocks (one copy), are attended run by run and merged.
- a sliding window (``window=``, shorter than the sequence): neither; the halo exchange of ``cp_window`` (each
  rank receives only the keys its queries' windows reach, one kernel call a piece, nothing to merge).
- ``"auto"``: ``ring`` when the gathered KV, counted twice (the gather buffer and its global-order copy),
  does not fit ``AUTO_GATHER_BYTES`` (256 MiB, a memory rule); otherwise the one the cost model
  (``xelink.cost.predict_cp_attention``) predicts faster on the group's placement in its topology, and
  ``all_gather`` where there is none (no topology, or packages assigned by hand); on CUDA tensors without
  peer memory between the ranks always ``all_gather``. No tuning-table entry exists for it yet.

Causal masks. The local kernels mask causally only with the queries aligned to the end of the keys, over
contiguous ranges; a rank's positions are not contiguous (zigzag) and the key blocks come from anywhere.
So every (query piece, key block) pair is decomposed by ``schedule.attend_parts`` into calls the kernel
computes exactly: skipped (the keys all lie after the queries), fully visible (all before: non-causal), or
diagonal (the same block: causal with aligned ends); adjacent query pieces that see one key block fully are
one call. For zigzag this is the standard halving: from a rank before this one only the first half of its
KV is needed (by all of this rank's queries), from a rank after it all of its KV but only by the second
half of this rank's queries.

Under ``torch.compile`` the call goes through the custom op ``xelink::cp_attention`` (a fake implementation
gives the shapes; the op's body is the eager call on the communicator named by ``group``), so a compiled
function traces through it, its backward through ``xelink::cp_attention_backward``; the group must then be
the world or a named communicator, as for the collectives' ops.

Autograd: where grad mode is on and q, k or v requires grad, the call is a node of the autograd graph whose
backward (``cp_backward``: the same algorithm's communication, ``flash_attention_backward`` of the forward's
(query pieces, key block) calls) gives dq, dk and dv on every rank, the LSE's gradient included
(``return_lse``). The backward is collective like the forward: every rank of the group must back-propagate
through its output (ranks that disagree about grad raise in the forward, with the other signature checks).
Every check runs before any byte moves. World size 1 is one ``flash_attention`` call. Local kernels:
``xelink.kernels.flash_attention`` and ``merge_attention`` with ``impl="auto"`` (the references on CPU ranks,
float32 math; Triton on GPUs), and ``flash_attention_backward`` likewise.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import config
from ..collectives import all_gather_into_tensor, reduce_scatter_tensor
from ..cost import CP_ATTENTION_ALGOS
from ..collectives.checks import check_rank_device, fingerprint_check, group_of
from ..collectives.compiled import comm_named, group_name
from ..kernels import flash_attention, flash_attention_backward
from ..kernels.common import host_values
from ..layout import varlen_pieces
from . import cp_backward, cp_window, schedule
from .cp_engine import all_gather_attention

__all__ = ["CP_ALGOS", "CP_LAYOUTS", "AUTO_GATHER_BYTES", "cp_attention", "cp_shard", "cp_unshard", "cp_positions",
           "auto_algo"]

CP_ALGOS = CP_ATTENTION_ALGOS  # ("ring", "all_gather"): the cost model prices the same names
CP_LAYOUTS = schedule.CP_LAYOUTS
AUTO_GATHER_BYTES = 256 << 20
AUTO_CACHE = 1024  # auto's choices a group remembers (then forgets all at once)
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# -- checks ---------------------------------------------------------------------------------------

def _layout(fn: str, layout) -> str:
    if not isinstance(layout, str) or layout not in CP_LAYOUTS:
        raise ValueError(f"{fn}: layout={layout!r} is not one of {', '.join(CP_LAYOUTS)}")
    return layout


def _algo(fn: str, algo) -> str:
    if not isinstance(algo, str) or algo not in ("auto",) + CP_ALGOS:
        raise ValueError(f"{fn}: algo={algo!r} is not one of auto, {', '.join(CP_ALGOS)}")
    return algo


def _tensor(fn: str, name: str, x, comm, axes: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != len(axes.split(", ")):
        raise ValueError(f"{fn}: {name} must be {len(axes.split(', '))}-D ({axes}), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {name}.dtype={x.dtype} is not supported; use float64, float32, float16 or bfloat16")
    check_rank_device(fn, name, x, comm)
    return x


def _check_qkv(fn: str, q, k, v, comm, packed: bool = False) -> None:
    """q, k, v of one call: (B, H, S_local, D) shards of a sequence, or ``packed`` (T_local, H, D) blocks of packed
    tokens (``cp_attention_varlen``)."""
    axes = "tokens_local, heads, head_dim" if packed else "batch, heads, seq_local, head_dim"
    for name, x in (("q", q), ("k", k), ("v", v)):
        _tensor(fn, name, x, comm, axes)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{fn}: dtypes differ: q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: devices differ: q on {q.device}, k on {k.device}, v on {v.device}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{fn}: k.shape={tuple(k.shape)} != v.shape={tuple(v.shape)}")
    seq, heads, dim = (0, 1, 2) if packed else (2, 1, 3)
    if not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"{fn}: batch differs: q.shape[0]={q.shape[0]} != k.shape[0]={k.shape[0]}")
    if k.shape[seq] != q.shape[seq]:
        raise ValueError(f"{fn}: local lengths differ: q.shape[{seq}]={q.shape[seq]} != k.shape[{seq}]={k.shape[seq]} "
                         f"(q, k and v are this rank's part of one sequence, at the same positions)")
    if k.shape[dim] != q.shape[dim] or q.shape[dim] == 0:
        raise ValueError(f"{fn}: head_dim: q.shape[{dim}]={q.shape[dim]}, k.shape[{dim}]={k.shape[dim]}; they must be "
                         f"equal and > 0")
    hq, hkv = q.shape[heads], k.shape[heads]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{fn}: q heads {hq} must be a multiple of k heads {hkv} (GQA)")


def _check_flags(fn: str, causal, scale, return_lse, window=None) -> float | None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{fn}: window={window!r} must be None or an int >= 1 (the positions a query sees, ending "
                         f"at its own)")
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: causal={causal!r} must be a bool")
    if not isinstance(return_lse, bool):
        raise TypeError(f"{fn}: return_lse={return_lse!r} must be a bool")
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}: scale={scale!r} must be a float or None")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{fn}: scale={scale!r} must be finite and > 0")
    return float(scale)


def _offsets(fn: str, cu_seqlens, max_seqlen) -> list:
    """``cu_seqlens`` read on the host (``host_values``: once a tensor and version) and checked: 0, then nondecreasing
    (zero-length sequences allowed)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D int32/int64 tensor of (sequences + 1) offsets, got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{fn}: cannot run during CUDA-graph capture (it reads cu_seqlens on the host)")
    cu = host_values(cu_seqlens)
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{fn}: cu_seqlens={cu} must start at 0 and never decrease")
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < longest:
            raise ValueError(f"{fn}: max_seqlen={max_seqlen!r} must be None or an int >= the longest sequence "
                             f"({longest})")
    return cu


def _seq_dim(fn: str, dim, x: torch.Tensor) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{fn}: dim={dim!r} must be an int")
    d = dim + x.dim() if dim < 0 else dim
    if not 0 <= d < x.dim():
        raise ValueError(f"{fn}: dim={dim} is not valid for a {x.dim()}-D tensor of shape {tuple(x.shape)}")
    return d


def _lengths(fn: str, comm, q, k, layout: str, algo: str, causal: bool, scale, return_lse: bool, seq_len,
             grad: bool, window):
    """Every rank's local length (the layout's for their sum), checked; exchanged unless ``seq_len`` is given.
    ``grad`` (a backward will follow, itself collective) is part of the call every rank must agree on."""
    n, r = comm.size, comm.rank
    mine = q.shape[2]
    if seq_len is not None:
        want = schedule.cp_lengths(seq_len, n, layout)
        if want[r] != mine:
            raise ValueError(f"{fn}: q.shape[2]={mine} on rank {r}, but seq_len={seq_len} with layout={layout!r} "
                             f"over {n} ranks gives rank {r} {want[r]} positions")
        fingerprint_check(comm, fn, (fn, seq_len, tuple(q.shape[:2]), tuple(k.shape[:2]), q.shape[3], str(q.dtype),
                                     layout, algo, causal, scale, return_lse, grad, window))
        return want
    sig = (tuple(q.shape[:2]), tuple(k.shape[:2]), q.shape[3], str(q.dtype), q.device.type, layout, algo, causal,
           scale, return_lse, grad, window)
    got = _exchange_lengths(fn, comm, mine, sig, "batch and heads, head_dim, dtype, device, layout, algo, causal, "
                                                "scale, return_lse, whether an input requires grad, window")
    want = schedule.cp_lengths(sum(got), n, layout)
    if got != want:
        raise ValueError(f"{fn}: the ranks' local lengths {got} are not those of layout={layout!r} for a sequence "
                         f"of {sum(got)} positions over {n} ranks ({want}); cut it with xelink.cp_shard")
    return got


def _exchange_lengths(fn: str, comm, local: int, signature: tuple, fields: str) -> list:
    """Every rank's ``local`` length, after one host exchange of (``local``, ``signature``): a rank whose signature
    differs makes every rank raise the same error (``fields`` names the signature's entries)."""
    seen = comm.allgather_object((local, signature))
    differ = [x for x, (_, s) in enumerate(seen) if s != signature]
    if differ:
        raise ValueError(f"{fn}: ranks disagree about the call: rank {comm.rank} has {signature}, rank {differ[0]} "
                         f"has {seen[differ[0]][1]} ({fields})")
    return [length for length, _ in seen]


def auto_algo(comm, nbytes_gathered: int, cuda: bool = False, problem: dict | None = None) -> str:
    """What ``algo="auto"`` runs: ``ring`` when twice the gathered KV (``nbytes_gathered``: the gather buffer
    plus its global-order copy) does not fit ``AUTO_GATHER_BYTES``; else the faster of the two by the cost
    model (``xelink.cost.predict_cp_attention`` of ``problem``, its keyword arguments) where the group has a
    placement in a topology, else ``all_gather``. On CUDA tensors without peer memory between the ranks
    (which the CUDA ring needs) ``all_gather`` whatever the size."""
    if cuda:
        from .. import symm

        if not symm.available(comm):
            return "all_gather"
    if 2 * nbytes_gathered > AUTO_GATHER_BYTES:
        return "ring"
    placement = None if problem is None else comm.placement
    if placement is None or nbytes_gathered == 0:  # (an empty sequence or batch: nothing to move or price)
        return "all_gather"
    from ..cost import predict_cp_attention

    times = {a: predict_cp_attention(comm.topology, placement, a, **problem).time_s for a in CP_ALGOS}
    return min(CP_ALGOS, key=lambda a: (times[a], a != "all_gather"))  # a tie: all_gather


# -- the ops --------------------------------------------------------------------------------------

def _backend(q: torch.Tensor):
    if q.is_cuda:
        from . import cp_device

        return cp_device
    from . import cp_host

    return cp_host


def cp_attention(q, k, v, *, causal: bool = False, scale=None, group=None, layout: str = "zigzag",
                 algo: str = "auto", return_lse: bool = False, seq_len=None, window=None):
    """Attention of this rank's queries over the whole sequence, which the ranks of ``group`` hold in shards.

    Args:
        q: (B, Hq, S_local, D) this rank's queries, at the positions the layout gives it (``cp_positions``);
            float64, float32, float16 or bfloat16 (float64 is merged across key blocks with float32 weights, the
            LSE's contract: about float32 accuracy above one rank); a CPU tensor or a CUDA tensor on this rank's
            device; any strides.
        k, v: (B, Hkv, S_local, D) this rank's keys and values at the same positions; Hq divisible by Hkv
            (GQA: only the Hkv heads move); q's dtype and device.
        causal: position p sees keys at positions <= p (global positions; SDPA's ``is_causal`` over the whole
            sequence).
        scale: softmax scale, > 0; default 1/sqrt(D).
        group: xelink communicator (None: the world).
        layout: "zigzag" (2n blocks, rank r holds blocks r and 2n-1-r) or "contiguous" (n blocks).
        algo: "auto", "ring" or "all_gather" (module docstring).
        return_lse: also return the float32 natural-log LSE of this rank's rows.
        seq_len: the total length, if the caller knows it (an extension of the contract): skips the one host
            exchange of the local lengths that the call otherwise makes.
        window: None, or an int >= 1: a sliding window (``flash_attention``'s): with causal, position p sees the
            keys at positions p - window + 1 .. p (Mistral's ``sliding_window``); without, every query sees the
            last ``window`` positions. A window shorter than the sequence runs the halo exchange
            (``cp_window``: each rank receives only the keys its queries' windows reach; ``algo`` must then be
            "auto"); one at least as long is no window.

    Returns:
        out (B, Hq, S_local, D) in q's dtype (a new tensor), equal to full attention over the whole sequence
        restricted to this rank's queries; or (out, lse (B, Hq, S_local) float32) with ``return_lse``.

    Raises:
        TypeError / ValueError: non-tensors, unsupported or mixed dtypes, mixed devices, shapes that do not
            match (batch, local lengths, head dims, GQA heads), a bad layout, algo,
            scale or flag, before anything is sent; after the exchange of the call signatures (every rank
            raises the same): ranks that disagree, or local lengths that are not the layout's.

    Collective: every rank of ``group`` must call this with the same batch, heads, head dim, dtype, flags,
    layout and algo, whether an input requires grad, and the local lengths of one sequence cut by the layout;
    with grad, every rank must then run the backward too (module docstring).
    """
    fn = "cp_attention"
    if torch.compiler.is_compiling():  # traced: the custom op (its eager body is this function, checks and all)
        out, lse = torch.ops.xelink.cp_attention(q, k, v, causal, None if scale is None else float(scale),
                                                 group_name(group), layout, algo, -1 if seq_len is None else seq_len,
                                                 0 if window is None else window)
        return (out, lse) if return_lse else out
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    call = _plan(fn, q, k, v, causal, scale, group, layout, algo, return_lse, seq_len, grad, window)
    out, lse = _Differentiable.apply(q, k, v, call) if grad else call.forward(q, k, v)
    return (out, lse) if return_lse else out


def _plan(fn: str, q, k, v, causal, scale, group, layout, algo, return_lse, seq_len, grad: bool,
          window=None) -> "_Call":
    """Every check of a call, the lengths (exchanged unless ``seq_len`` is given) and the algorithm."""
    comm = group_of(group, fn)
    _check_qkv(fn, q, k, v, comm)
    scale_f = _check_flags(fn, causal, scale, return_lse, window)
    layout = _layout(fn, layout)
    algo = _algo(fn, algo)
    if seq_len is not None:
        config.integer(fn, "seq_len", seq_len, 0)
    picked = algo
    if comm.size == 1:
        if seq_len is not None and seq_len != q.shape[2]:
            raise ValueError(f"{fn}: q.shape[2]={q.shape[2]} but seq_len={seq_len} on a group of one rank")
        lengths = [q.shape[2]]
    else:
        lengths = _lengths(fn, comm, q, k, layout, algo, causal, scale_f, return_lse, seq_len, grad, window)
        if window is not None and window >= sum(lengths):
            window = None  # every query sees every key it would without one
        if window is not None:
            if algo != "auto":
                raise ValueError(f"{fn}: window={window} shorter than the sequence ({sum(lengths)}) runs the halo "
                                 f"exchange (each rank receives only the keys its windows reach); algo must be "
                                 f"'auto', got {algo!r}")
            picked = "window"
        else:
            picked = _picked(comm, q, k, lengths, layout, algo, causal)
        why = _backend(q).unmet(comm, picked)
        if why is not None:
            raise ValueError(f"{fn}: {why}")
    return _Call(comm, tuple(lengths), layout, picked, causal, scale_f, window)


def _picked(comm, q, k, lengths, layout: str, algo: str, causal: bool) -> str:
    """The algorithm that runs: ``algo``, or auto's choice for this problem (remembered by the group: the cost
    model prices it once)."""
    if algo != "auto":
        return algo
    n = comm.size
    B, Hkv, _, D = k.shape
    gathered_bytes = n * max(lengths) * 2 * B * Hkv * D * k.element_size()
    problem = dict(seq_len=sum(lengths), batch=B, heads=q.shape[1], kv_heads=Hkv, head_dim=D, causal=causal,
                   layout=layout, dtype_bytes=k.element_size())
    chosen = comm.resource(("xelink.dist", "cp-auto"), dict)
    key = (gathered_bytes, q.is_cuda, tuple(problem.values()))
    picked = chosen.get(key)
    if picked is None:
        if len(chosen) >= AUTO_CACHE:
            chosen.clear()
        picked = chosen[key] = auto_algo(comm, gathered_bytes, q.is_cuda, problem)
    return picked


@dataclasses.dataclass(frozen=True)
class _Call:
    """One checked call: what its forward and backward run."""
    comm: object
    lengths: tuple
    layout: str
    algo: str
    causal: bool
    scale: float | None
    window: int | None = None  # (only with algo "window")

    def forward(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        comm, lengths = self.comm, list(self.lengths)
        if comm.size == 1:
            return flash_attention(q, k, v, causal=self.causal, scale=self.scale, return_lse=True,
                                   window=self.window)
        kv = torch.stack((k, v))  # (2, B, Hkv, S_local, D), contiguous: one message per block
        if self.algo == "window":
            return cp_window.window_attention(comm, q, kv, lengths, self.layout, self.causal, self.scale,
                                              self.window)
        backend = _backend(q)
        if self.algo == "all_gather":
            acc = all_gather_attention(comm, q, kv, lengths, self.layout, self.causal, self.scale,
                                       backend.start_gather)
        else:
            acc = backend.ring_attention(comm, q, kv, lengths, self.layout, self.causal, self.scale)
        return acc.result(q.dtype)

    def backward(self, dout, dlse, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        comm, lengths = self.comm, list(self.lengths)
        if comm.size == 1:
            dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=self.causal, scale=self.scale,
                                                  dlse=dlse, dtype=q.dtype, window=self.window)
        else:
            g = (q, dout, out, lse, dlse)
            kv = torch.stack((k, v))
            if self.algo == "window":
                dq, dkv = cp_window.window_backward(comm, g, kv, lengths, self.layout, self.causal, self.scale,
                                                    self.window)
            elif self.algo == "all_gather":
                dq, dkv = cp_backward.all_gather_backward(comm, g, kv, lengths, self.layout, self.causal, self.scale,
                                                          _backend(q).start_gather)
            else:
                dq, dkv = cp_backward.ring_backward(comm, g, kv, lengths, self.layout, self.causal, self.scale)
            dk, dv = dkv[0], dkv[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Differentiable(torch.autograd.Function):
    """cp_attention in autograd: the forward as without grad, the backward ``_Call.backward`` (collective)."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        out, lse = call.forward(q, k, v)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.call.backward(dout, dlse, q, k, v, out, lse)
        return dq, dk, dv, None


@torch.library.custom_op("xelink::cp_attention", mutates_args=())
def _cp_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None, group: str,
                     layout: str, algo: str, seq_len: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cp_attention(q, k, v, causal=causal, scale=scale, group=comm_named(group), layout=layout, algo=algo,
                        return_lse=True, seq_len=None if seq_len < 0 else seq_len, window=window or None)


@_cp_attention_op.register_fake
def _(q, k, v, causal, scale, group, layout, algo, seq_len, window):
    B, H, S, D = q.shape
    return q.new_empty((B, H, S, D)), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.custom_op("xelink::cp_attention_backward", mutates_args=())
def _cp_attention_backward_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float | None,
                              group: str, layout: str, algo: str, seq_len: int,
                              window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The traced backward: the call planned again (its checks, lengths and algorithm, as the forward op's
    body planned it: no input of a traced op requires grad), then ``_Call.backward``."""
    call = _plan("cp_attention", q, k, v, causal, scale, comm_named(group), layout, algo, True,
                 None if seq_len < 0 else seq_len, False, window or None)
    dq, dk, dv = call.backward(dout, dlse, q, k, v, out, lse)
    return dq, dk.clone(), dv.clone()  # an op's outputs may not alias each other (dk, dv: views of one buffer)


@_cp_attention_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, causal, scale, group, layout, algo, seq_len, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *ctx.flags = inputs
    ctx.save_for_backward(q, k, v, *output)


def _traced_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    grads = torch.ops.xelink.cp_attention_backward(dout, dlse, q, k, v, out, lse, *ctx.flags)
    return (*grads, None, None, None, None, None, None, None)


_cp_attention_op.register_autograd(_traced_backward, setup_context=_setup_context)


def _pieces_of(fn: str, seq_len: int, n: int, layout: str, cu_seqlens):
    """A function of a rank giving its global ranges ``(start, length)`` in its local order: the layout's pieces of
    one sequence of ``seq_len``, or with ``cu_seqlens`` (read and checked here once) of the packed sequences at those
    offsets (``varlen_pieces``; their total must be ``seq_len``)."""
    if cu_seqlens is None:
        return lambda rank: schedule.cp_pieces(seq_len, n, layout, rank)
    cu = _offsets(fn, cu_seqlens, None)
    if cu[-1] != seq_len:
        raise ValueError(f"{fn}: cu_seqlens[-1]={cu[-1]} != {seq_len}, the packed length")
    return lambda rank: varlen_pieces(cu, n, layout, rank)


def cp_shard(x, *, group=None, layout: str = "zigzag", dim: int = 2, cu_seqlens=None):
    """This rank's shard of a full-sequence tensor: its layout blocks of ``x`` along ``dim``, concatenated.

    Args:
        x: any tensor holding the whole sequence along ``dim`` (e.g. (B, H, S, D) with dim=2, or token ids
            (B, S) with dim=1).
        group: xelink communicator (None: the world): its size and this rank.
        layout: "zigzag" or "contiguous".
        dim: the sequence dimension (negative counts from the end).
        cu_seqlens: None, or the offsets of packed sequences along ``dim`` (``cp_attention_varlen``'s): each
            sequence is laid out on its own (zigzag: its 2n blocks; contiguous: the packed tokens' n blocks, the
            same as without), sequence after sequence.

    Returns:
        A new contiguous tensor, ``x``'s shape with ``S_local`` along ``dim``.

    Raises:
        TypeError / ValueError: a non-tensor, a bad dim, layout or offsets.

    Local: no communication (each rank cuts its own shard of the same ``x``).
    """
    fn = "cp_shard"
    comm = group_of(group, fn)
    layout = _layout(fn, layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    d = _seq_dim(fn, dim, x)
    pieces = _pieces_of(fn, x.shape[d], comm.size, layout, cu_seqlens)(comm.rank)
    if not pieces:
        return x.narrow(d, 0, 0).contiguous()
    return torch.cat([x.narrow(d, start, length) for start, length in pieces], dim=d)


def cp_unshard(x_local, *, seq_len, group=None, layout: str = "zigzag", dim: int = 2, cu_seqlens=None):
    """The full-sequence tensor from every rank's shard (the inverse of ``cp_shard``), on every rank.

    Args:
        x_local: this rank's shard, ``S_local`` (the layout's length for this rank) along ``dim``; the same
            other dims and dtype on every rank; a CPU tensor or a CUDA tensor on this rank's device.
        seq_len: the total length S.
        group: xelink communicator (None: the world).
        layout: "zigzag" or "contiguous".
        dim: the sequence dimension.
        cu_seqlens: None, or the packed sequences' offsets ``cp_shard`` was given.

    Returns:
        A new tensor, ``x_local``'s shape with S along ``dim``. Differentiable, as torch's autograd all-gather:
        the gradient of a shard is the full gradient summed over the ranks at the shard's positions (every rank's
        loss a term of one sum).

    Raises:
        TypeError / ValueError: a non-tensor, a bad seq_len, dim or layout, or a local length that is not
            the layout's for ``seq_len``, before anything is sent.

    Collective: every rank of ``group`` must call this (one ``all_gather_into_tensor`` of the shards, padded
    to the longest local length; the backward one ``reduce_scatter_tensor``).
    """
    fn = "cp_unshard"
    comm = group_of(group, fn)
    layout = _layout(fn, layout)
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"{fn}: x_local must be a torch.Tensor, got {type(x_local).__name__}")
    seq_len = config.integer(fn, "seq_len", seq_len, 0)
    d = _seq_dim(fn, dim, x_local)
    n, r = comm.size, comm.rank
    of = _pieces_of(fn, seq_len, n, layout, cu_seqlens)
    pieces = [schedule.local_pieces(of(x)) for x in range(n)]
    lengths = [sum(length for _, length, _ in p) for p in pieces]
    if x_local.shape[d] != lengths[r]:
        raise ValueError(f"{fn}: x_local.shape[{d}]={x_local.shape[d]} on rank {r}, but seq_len={seq_len} with "
                         f"layout={layout!r} over {n} ranks gives rank {r} {lengths[r]} positions")
    fingerprint_check(comm, fn, (fn, seq_len, tuple(s for i, s in enumerate(x_local.shape) if i != d), d,
                                 str(x_local.dtype), layout, tuple(lengths)))
    if n == 1:
        return x_local.clone(memory_format=torch.contiguous_format)
    return _Unshard.apply(x_local, comm, d, seq_len, pieces, lengths)


class _Unshard(torch.autograd.Function):
    """``cp_unshard``'s gather of the shards; its backward, as torch's autograd all-gather's: the full gradient
    summed over the ranks, each keeping its shard's positions (one ``reduce_scatter_tensor``)."""

    @staticmethod
    def forward(ctx, x_local, comm, d, seq_len, pieces, lengths):
        ctx.args = (comm, d, pieces, lengths)
        moved = x_local.movedim(d, 0)
        send = moved.new_zeros((max(lengths),) + tuple(moved.shape[1:]))
        send[:lengths[comm.rank]].copy_(moved)
        stage = moved.new_empty((comm.size,) + tuple(send.shape))
        all_gather_into_tensor(stage, send, group=comm)
        full = moved.new_empty((seq_len,) + tuple(moved.shape[1:]))
        for x, stage_x in enumerate(stage):
            for start, length, off in pieces[x]:
                full[start:start + length].copy_(stage_x[off:off + length])
        return full.movedim(0, d).contiguous()

    @staticmethod
    def backward(ctx, grad):
        comm, d, pieces, lengths = ctx.args
        moved = grad.movedim(d, 0)
        stage = moved.new_zeros((comm.size, max(lengths)) + tuple(moved.shape[1:]))
        for x, stage_x in enumerate(stage):
            for start, length, off in pieces[x]:
                stage_x[off:off + length].copy_(moved[start:start + length])
        mine = moved.new_empty(tuple(stage.shape[1:]))
        reduce_scatter_tensor(mine, stage, group=comm)
        return mine[:lengths[comm.rank]].movedim(0, d), None, None, None, None, None


def cp_positions(seq_len, *, group=None, layout: str = "zigzag", cu_seqlens=None) -> torch.Tensor:
    """This rank's global positions, in its local order (for RoPE and masks).

    Args:
        seq_len: the total length S.
        group: xelink communicator (None: the world).
        layout: "zigzag" or "contiguous".
        cu_seqlens: None, or the packed sequences' offsets ``cp_shard`` was given: the positions are then the
            local tokens' indices in the packed batch (a token's position in its sequence: minus the sequence's
            offset).

    Returns:
        A CPU LongTensor of S_local positions (``.to(device)`` it for GPU work).

    Local: no communication.
    """
    fn = "cp_positions"
    comm = group_of(group, fn)
    layout = _layout(fn, layout)
    seq_len = config.integer(fn, "seq_len", seq_len, 0)
    pieces = _pieces_of(fn, seq_len, comm.size, layout, cu_seqlens)(comm.rank)
    return torch.cat([torch.arange(start, start + length, dtype=torch.long) for start, length in pieces] +
                     [torch.zeros(0, dtype=torch.long)])
