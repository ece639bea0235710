"""Tensor parallelism applied to the one-device Llama from outside (as gpt-fast does): which slice of
each weight a rank loads, and the collectives after the row-parallel projections and the head.

- Column-parallel: the fused QKV (this rank's query heads and their KV heads) and gate/up projections
  (this rank's block of the MLP's inner width); no communication.
- Row-parallel: the O and down projections read the matching columns; their partial outputs are summed
  with ``xelink.all_reduce`` over the TP group (the bias added once, after the sum).
- Vocabulary-parallel head: each rank computes its block of vocabulary rows; ``all_gather_into_tensor``
  assembles the logits. The embedding is replicated.
- KV heads: split over the ranks when there are at least as many KV heads as ranks; replicated otherwise
  (rank r keeps the one KV head its query heads read).

Context parallelism (``ContextParallel``): the ranks of a CP group hold the same weights (the same TP
slice) and split the sequence. The prompt's positions are cut with ``cp_shard``'s zigzag layout and their
attention runs through ``xelink.cp_attention``; each rank caches the KV of its positions; a decode token's KV
goes to rank ``position % cp_size`` and the ranks' partial attentions are merged by their LSE
(``llama.CPKVCache``). ``check_groups`` checks that the TP and CP groups tile the ranks as a grid.
"""
from __future__ import annotations

import dataclasses

import torch

from ..collectives import all_gather_into_tensor, all_reduce, broadcast
from ..comm import Communicator
from .. import cp_positions, cp_unshard
from ..kernels import W4_TILE_ROWS, merge_attention, pack_w4a16, pack_w8a16, tile_w4a16
from .checkpoint import Checkpoint, LlamaConfig, head_tensor

__all__ = ["ContextParallel", "TensorParallel", "WEIGHT_FORMATS", "check_groups", "check_xelink_collectives"]

WEIGHT_FORMATS = ("bf16", "w8a16", "w4a16")
_W4_GROUP = 128


def check_groups(tp_group, cp_group, fn: str):
    """(tp size, tp rank) after checking both groups, and that they tile the ranks consistently.

    Consistent: the ranks of one CP group hold the same TP slice (the same TP size and TP rank), the ranks
    of one TP group the same positions (the same CP size and CP rank), and the two groups share this rank
    only. E.g. at 4 ranks, TP 2 x CP 2: TP groups {0, 1}, {2, 3} (consecutive), CP groups {0, 2}, {1, 3}
    (strided), as ``xelink generate --tp 2 --cp 2`` builds them. Collective over each group of more than one
    rank (one host ``allgather_object`` each, made before any rank raises, so every rank raises together).
    """
    for name, g in (("tp_group", tp_group), ("cp_group", cp_group)):
        if g is not None and not isinstance(g, Communicator):
            raise TypeError(f"{fn}: {name}={g!r} must be an xelink Communicator or None")
    tp = (1, 0) if tp_group is None else (tp_group.size, tp_group.rank)
    cp = (1, 0) if cp_group is None else (cp_group.size, cp_group.rank)
    tp_seen = tp_group.allgather_object(cp) if tp[0] > 1 else [cp]
    cp_seen = cp_group.allgather_object(tp) if cp[0] > 1 else [tp]
    grid = "the TP and CP groups must tile the ranks as a grid: TP groups of consecutive ranks, CP groups strided " \
           "by the TP size (e.g. TP {0,1},{2,3} x CP {0,2},{1,3})"
    if any(s != cp for s in tp_seen):
        raise ValueError(f"{fn}: the ranks of tp_group hold different CP (size, rank) {tp_seen}; {grid}")
    if any(s != tp for s in cp_seen):
        raise ValueError(f"{fn}: the ranks of cp_group hold different TP (size, rank) {cp_seen}; {grid}")
    if tp[0] > 1 and cp[0] > 1 and len(set(tp_group.world_ranks) & set(cp_group.world_ranks)) != 1:
        raise ValueError(f"{fn}: tp_group (ranks {tp_group.world_ranks}) and cp_group (ranks "
                         f"{cp_group.world_ranks}) share more than this rank; {grid}")
    return tp


def check_xelink_collectives(groups, device, fn: str) -> None:
    """Under ``impl="xelink"`` on CUDA: xelink's GPU collectives (peer memory) can run over each group of more
    than one rank, else ValueError before any work (``auto`` would fall back to NCCL there)."""
    if device.type != "cuda":
        return
    from ..collectives import registry

    backend = registry.backend("cuda")
    for name, g in groups:
        if g is not None and g.size > 1:
            why = backend.unmet(g, registry.get(fn, "all_reduce", "direct", "cuda"))
            if why is not None:
                raise ValueError(f"{fn}: impl='xelink' runs xelink's GPU collectives over {name}, which cannot run "
                                 f"there: {why}; use impl='auto'")


def _algo(group, op: str, x: torch.Tensor, nbytes: int, force: bool) -> str:
    """``"auto"``, or where ``force`` (``impl="xelink"``) on a CUDA tensor the xelink algorithm that ``auto``'s
    size rule gives (never the NCCL baseline a tuning table or a missing peer memory could pick)."""
    if not force or not x.is_cuda:
        return "auto"
    from ..collectives import registry

    return registry.backend("cuda").size_rule(group, op, nbytes)


class ContextParallel:
    """A CP group's plan: the positions of the prompt this rank computes, the gather of the final hidden
    states, the owner of a decode token's KV and the merge of the partial decode attentions.

    Layout ``"zigzag"`` (``cp_shard``): rank r holds blocks r and 2n-1-r of 2n, so every rank has the same
    causal work in the prefill. Which positions a rank caches does not matter to decode (every cached key is
    in the past of the new token, and attention over a set of keys does not depend on their order), so the
    layout is chosen for the prefill alone.
    """

    LAYOUT = "zigzag"

    def __init__(self, group: Communicator, force_xelink: bool = False):
        self.group, self.size, self.rank = group, group.size, group.rank
        self.force_xelink = force_xelink  # impl="xelink": xelink's collective algorithms, never NCCL's
        # The call being computed (set by the model before its layers): seq_len, the prompt's tokens (a row's, or
        # all rows' real tokens packed), 0 for a decode token; packed, for a ragged prompt: (the rows of this rank's
        # tokens, their positions: CPU LongTensors; the rows' offsets in the packed tokens, a list), else None.
        self.seq_len, self.packed = 0, None

    def positions(self, seq_len: int, cu_seqlens=None) -> torch.Tensor:
        """This rank's positions of a prompt of ``seq_len`` tokens (a CPU LongTensor, local order); with
        ``cu_seqlens``, its indices of the packed tokens of sequences at those offsets."""
        return cp_positions(seq_len, group=self.group, layout=self.LAYOUT, cu_seqlens=cu_seqlens)

    def unshard(self, x: torch.Tensor, seq_len: int, cu_seqlens=None) -> torch.Tensor:
        """``(B, S_local, H)`` of every rank -> ``(B, seq_len, H)`` on every rank (``cu_seqlens``: packed
        sequences, as ``positions``)."""
        return cp_unshard(x.contiguous(), seq_len=seq_len, group=self.group, layout=self.LAYOUT, dim=1,
                          cu_seqlens=cu_seqlens)

    def owner(self, pos):
        """The rank caching the KV of decode position ``pos`` (round-robin): an int, or a tensor of them."""
        return pos % self.size

    def agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """CP rank 0's ``tokens`` on every rank of the group (after ``TensorParallel.agree``)."""
        broadcast(tokens, group=self.group, group_src=0)
        return tokens

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (the same shape everywhere) -> ``(size, *x.shape)`` on every rank."""
        x = x.contiguous()
        stage = x.new_empty((self.size,) + tuple(x.shape))
        all_gather_into_tensor(stage, x, group=self.group,
                               algo=_algo(self.group, "all_gather", x, stage.nbytes, self.force_xelink))
        return stage

    def merge(self, out: torch.Tensor, lse: torch.Tensor, impl: str) -> torch.Tensor:
        """Every rank's partial ``out (B, H, S, D)`` with its float32 ``lse (B, H, S)`` (or ``P`` partials of each
        rank: ``(P, B, H, S, D)`` and ``(P, B, H, S)``) -> the attention over all of their keys ``(B, H, S, D)`` (in
        ``out``'s dtype), on every rank: one gather of the partials packed with their LSE in float32, then
        ``merge_attention``. A partial without keys has LSE -inf."""
        D = out.shape[-1]
        stage = self.gather(torch.cat([out.float(), lse[..., None]], dim=-1)).reshape(-1, *out.shape[-4:-1], D + 1)
        merged, _ = merge_attention(stage[..., :D].contiguous(), stage[..., D].contiguous(), impl)
        return merged.to(out.dtype)


@dataclasses.dataclass(frozen=True)
class Linear:
    """``y = x @ W^T`` (then the TP sum where ``reduce``, then ``+ bias``), W in a GEMV format.

    ``weight`` is ``[N, K]`` dense, int8 ``[N, K]`` (w8a16) or packed uint8 ``[N, K/2]`` (w4a16; w4a16t in
    ``tile_w4a16``'s layout), with ``scales`` for the quantized formats (``xelink.kernels.pack_w8a16`` /
    ``pack_w4a16``).
    """

    weight: torch.Tensor
    scales: torch.Tensor | None
    fmt: str  # "dense", "w8a16", "w4a16", "w4a16t" (tiled: xelink.kernels.tile_w4a16)
    bias: torch.Tensor | None = None
    reduce: object = None  # callable summing the partial outputs over the TP group (row-parallel)


class TensorParallel:
    """A TP group's plan for one config: the slices each rank loads and the collectives.

    Args:
        cfg: the model's config.
        group: the TP communicator (None: one rank).
        fn: the caller's name for error messages.
        force_xelink: ``impl="xelink"``: the all-reduce and the head's all-gather on CUDA run xelink's
            algorithms (the size rule's), never the NCCL baseline.

    Raises:
        ValueError: heads, KV heads, MLP width not divisible by the group size.
    """

    def __init__(self, cfg: LlamaConfig, group: Communicator | None, fn: str, force_xelink: bool = False):
        self.cfg, self.group, self.force_xelink = cfg, group, force_xelink
        self.size, self.rank = (1, 0) if group is None else (group.size, group.rank)
        n, r = self.size, self.rank
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if heads % n:
            raise ValueError(f"{fn}: num_attention_heads={heads} is not divisible by the TP size {n}")
        if kv % n and n % kv:
            raise ValueError(f"{fn}: num_key_value_heads={kv} and the TP size {n} must divide one another "
                             f"(KV heads are split, or replicated when there are more ranks than KV heads)")
        if cfg.intermediate_size % n:
            raise ValueError(f"{fn}: intermediate_size={cfg.intermediate_size} is not divisible by the TP size {n}")
        self.heads = heads // n
        self.q0 = r * self.heads
        if kv >= n:
            self.kv_heads, self.kv0 = kv // n, r * (kv // n)
        else:  # replicated: the one KV head this rank's query heads read
            self.kv_heads, self.kv0 = 1, self.q0 // (heads // kv)
        self.ffn = cfg.intermediate_size // n
        self.f0 = r * self.ffn
        self.vocab = -(-cfg.vocab_size // n)  # rows per rank; the last rank's tail is zero padding
        self.v0 = r * self.vocab

    # -- collectives ---------------------------------------------------------------------------

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of the row-parallel partial outputs ``x`` over the group, in place."""
        if self.size > 1:
            all_reduce(x, group=self.group, algo=_algo(self.group, "all_reduce", x, x.nbytes, self.force_xelink))
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """``[M, vocab/n]`` blocks of every rank -> ``[M, vocab]`` on every rank."""
        if self.size == 1:
            return logits[:, :self.cfg.vocab_size]
        M, V = logits.shape
        out = logits.new_empty(self.size * M, V)
        all_gather_into_tensor(out, logits.contiguous(), group=self.group,
                               algo=_algo(self.group, "all_gather", logits, out.nbytes, self.force_xelink))
        return out.view(self.size, M, V).permute(1, 0, 2).reshape(M, self.size * V)[:, :self.cfg.vocab_size]

    def agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tokens`` (a CPU int64 tensor) on every rank: sampling stays identical even where the
        ranks' logits differ in the last bit."""
        if self.size > 1:
            broadcast(tokens, group=self.group, group_src=0)
        return tokens

    # -- loading -------------------------------------------------------------------------------

    def check_formats(self, weights: str, fn: str) -> None:
        """The quantized formats need every projection's K (this rank's slice) a multiple of 128."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"{fn}: weights={weights!r} must be one of {', '.join(map(repr, WEIGHT_FORMATS))}")
        if weights != "w4a16":
            return
        D, H = self.cfg.head_dim, self.cfg.hidden_size
        for name, k in (("hidden_size", H), ("o_proj input (heads per rank x head_dim)", self.heads * D),
                        ("down_proj input (intermediate_size / TP)", self.ffn)):
            if k % _W4_GROUP:
                raise ValueError(f"{fn}: weights='w4a16' needs the {name}={k} to be a multiple of {_W4_GROUP} "
                                 f"(one scale per {_W4_GROUP} columns); use weights='w8a16' or 'bf16'")

    def load(self, ckpt: Checkpoint, weights: str, dtype: torch.dtype, device, tiled: bool = False,
             quantize_head: bool = False) -> dict:
        """This rank's slices of every weight, quantized to ``weights``, on ``device``; ``tiled``: W4A16 weights
        in ``tile_w4a16``'s layout (format ``"w4a16t"``) where their rows are whole 16-row tiles;
        ``quantize_head``: the head in ``weights`` too (else dense).

        Returns:
            ``{"embed", "norm", "head": Linear, "layers": [dict of attn_norm, mlp_norm, qkv, o, gate_up, down]}``.
        """
        cfg, D = self.cfg, self.cfg.head_dim

        def get(name, dim=None, start=0, stop=None):
            return ckpt.read(name, dim, start, stop).to(dtype)

        def linear(w, bias=None, reduce=None, fmt=weights):
            if fmt == "w8a16":
                amax = None
                if reduce is not None and self.size > 1:  # a slice of columns: the whole rows' scale, as one process
                    amax = w.float().abs().amax(dim=1)
                    all_reduce(amax, op="max", group=self.group)
                q, s = pack_w8a16(w, dtype, amax)
                return Linear(q.to(device), s.to(device), "w8a16", _dev(bias, device), reduce)
            if fmt == "w4a16":
                q, s = pack_w4a16(w, dtype)
                if tiled and q.shape[0] % W4_TILE_ROWS == 0:
                    return Linear(tile_w4a16(q.to(device)), s.to(device), "w4a16t", _dev(bias, device), reduce)
                return Linear(q.to(device), s.to(device), "w4a16", _dev(bias, device), reduce)
            return Linear(w.to(device).contiguous(), None, "dense", _dev(bias, device), reduce)

        qs, qe = self.q0 * D, (self.q0 + self.heads) * D
        ks, ke = self.kv0 * D, (self.kv0 + self.kv_heads) * D
        fs, fe = self.f0, self.f0 + self.ffn
        Q, KV, I = cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.intermediate_size
        # Phi-3 stores q, k, v in one qkv_proj and gate, up in one gate_up_proj: the same rows, at offsets
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", Q), "v_proj": ("qkv_proj", Q + KV),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", I)} if cfg.fused_projections else {}

        def rows(prefix, proj, start, stop):  # rows [start, stop) of projection ``proj``'s weight
            name, offset = fused.get(proj, (proj, 0))
            return get(f"{prefix}{name}.weight", 0, offset + start, offset + stop)

        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv = torch.cat([rows(a, "q_proj", qs, qe), rows(a, "k_proj", ks, ke), rows(a, "v_proj", ks, ke)])
            qkv_b = o_b = gu_b = down_b = None
            if cfg.qkv_bias:
                qkv_b = torch.cat([get(a + "q_proj.bias", 0, qs, qe), get(a + "k_proj.bias", 0, ks, ke),
                                   get(a + "v_proj.bias", 0, ks, ke)])
            if cfg.o_bias:
                o_b = get(a + "o_proj.bias")
            if cfg.mlp_bias:
                gu_b = torch.cat([get(m + "gate_proj.bias", 0, fs, fe), get(m + "up_proj.bias", 0, fs, fe)])
                down_b = get(m + "down_proj.bias")
            gate_up = torch.cat([rows(m, "gate_proj", fs, fe), rows(m, "up_proj", fs, fe)])
            layers.append({
                "attn_norm": get(p + "input_layernorm.weight").to(device),
                "mlp_norm": get(p + "post_attention_layernorm.weight").to(device),
                "qkv": linear(qkv, qkv_b),
                "o": linear(get(a + "o_proj.weight", 1, qs, qe), o_b, self.reduce),
                "gate_up": linear(gate_up, gu_b),
                "down": linear(get(m + "down_proj.weight", 1, fs, fe), down_b, self.reduce),
            })
            if cfg.qk_norm:  # one weight over the head dim, for every head: whole on every rank
                layers[-1].update(q_norm=get(a + "q_norm.weight").to(device),
                                  k_norm=get(a + "k_norm.weight").to(device))
        head = get(head_tensor(cfg, ckpt), 0, self.v0, min(self.v0 + self.vocab, cfg.vocab_size))
        if head.shape[0] < self.vocab:  # the last rank's rows past the vocabulary
            head = torch.cat([head, head.new_zeros(self.vocab - head.shape[0], head.shape[1])])
        # The embedding stays dense, and the head unless asked: the head's logits decide the tokens.
        return {"embed": get("model.embed_tokens.weight").to(device), "norm": get("model.norm.weight").to(device),
                "head": linear(head, fmt=weights if quantize_head else "dense"), "layers": layers}


def _dev(t, device):
    return None if t is None else t.to(device)
