"""A real client of the composed ops' backward: a transformer block trained on a 2-D mesh of CPU ranks,
tensor parallel (attention heads and MLP columns split, Megatron-LM style: ``matmul_all_reduce`` after the
row-parallel weights) inside each context-parallel group (the sequence split zigzag over the ranks, attention
by ``cp_attention``), for a few SGD steps. The loss is the sum of every rank's (``gemm_grad``'s convention): a
rank's share is its sequence shard's, divided by the TP size (the TP ranks compute it alike). Each rank's weight
gradients, summed over its context-parallel group with ``all_reduce`` (the TP shard is replicated there), must
equal the slices of one process's gradients, and the weights after training one process's weights (within 1e-6:
cp_attention merges and differentiates with float32 LSEs, about float32 accuracy for these float64 tensors).
Meshes (CP x TP): 1x1; 2x1 and 1x2 at two ranks (CP only, TP only); 4x1 and 2x2 at four; both attention
algorithms."""
import torch

import xelink
from dist_cases import full_attention

WORLD_SIZES = (1, 2, 4)
LAUNCH_TIMEOUT = 300
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 16, 4, 2, 4, 24


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (HIDDEN, HEADS * HEAD_DIM), "k": (HIDDEN, KV_HEADS * HEAD_DIM), "v": (HIDDEN, KV_HEADS * HEAD_DIM),
              "o": (HEADS * HEAD_DIM, HIDDEN), "up": (HIDDEN, MLP), "down": (MLP, HIDDEN)}
    return {k: torch.randn(shape, generator=g, dtype=torch.float64) * shape[0] ** -0.5 for k, shape in shapes.items()}


def _shard(w, tp, t):
    """Rank t's slices (of tp): q/k/v/up by output columns (whole heads), o/down by input rows."""
    cols = lambda x, n: x.chunk(tp, dim=n)[t]  # noqa: E731
    return {"q": cols(w["q"], 1), "k": cols(w["k"], 1), "v": cols(w["v"], 1), "o": cols(w["o"], 0),
            "up": cols(w["up"], 1), "down": cols(w["down"], 0)}


def _block(x, w, heads, kv_heads, attend, row_parallel):
    """x (B, S, HIDDEN) -> the block's output; attention over ``heads`` q heads (``kv_heads`` KV heads)."""
    B, S, _ = x.shape
    h = torch.nn.functional.rms_norm(x, (HIDDEN,))
    q = (h @ w["q"]).view(B, S, heads, HEAD_DIM).transpose(1, 2)
    k = (h @ w["k"]).view(B, S, kv_heads, HEAD_DIM).transpose(1, 2)
    v = (h @ w["v"]).view(B, S, kv_heads, HEAD_DIM).transpose(1, 2)
    a = attend(q, k, v).transpose(1, 2).reshape(B, S, heads * HEAD_DIM)
    x = x + row_parallel(a, w["o"])
    return x + row_parallel(torch.relu(torch.nn.functional.rms_norm(x, (HIDDEN,)) @ w["up"]), w["down"])


def train(world, tp, algo, device="cpu", dtype=torch.float64, tol=1e-6, steps=3, lr=0.3):
    """The training (one process on the host in float64 beside it); ``tol``: relative, of gradients and loss."""
    t, c = world.rank % tp, world.rank // tp  # rank r = c * tp + t
    tp_group = world.split(c)  # ranks c * tp .. c * tp + tp - 1
    cp_group = world.split(t)  # ranks t, tp + t, ...
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 19, HIDDEN, generator=g, dtype=torch.float64), torch.randn(2, 19, HIDDEN, generator=g,
                                                                                      dtype=torch.float64)
    count = y.numel()
    full = {k: v.clone().requires_grad_() for k, v in _weights(6).items()}
    mine = {k: v.to(device, dtype).requires_grad_() for k, v in _shard(_weights(6), tp, t).items()}
    xs, ys = (xelink.cp_shard(z, group=cp_group, dim=1).to(device, dtype) for z in (x, y))
    for step in range(steps):
        loss = ((_block(x, full, HEADS, KV_HEADS, lambda q, k, v: full_attention(q, k, v, True)[0],
                        lambda a, w: a @ w) - y) ** 2).sum() / count
        loss.backward()
        out = _block(xs, mine, HEADS // tp, KV_HEADS // tp,
                     lambda q, k, v: xelink.cp_attention(q, k, v, causal=True, group=cp_group, algo=algo),
                     lambda a, w: xelink.matmul_all_reduce(a, w, group=tp_group))
        # Every rank of a TP group computes the same share: the sum of all ranks' losses is tp times it.
        part = ((out - ys) ** 2).sum() / count / tp
        part.backward()
        total = torch.tensor([part.item()], dtype=torch.float64)
        xelink.all_reduce(total)
        assert abs(total.item() - loss.item()) <= tol * loss.item(), (tp, algo, step, total.item(), loss.item())
        with torch.no_grad():
            want = _shard({k: v.grad for k, v in full.items()}, tp, t)
            for k, w in mine.items():  # a TP shard is replicated over the CP group: its gradient is the sum
                xelink.all_reduce(w.grad, group=cp_group)
                err = (w.grad.cpu().double() - want[k]).abs().max().item()
                assert err <= tol * max(1.0, want[k].abs().max().item()), (tp, algo, step, k, err)
            for w in list(full.values()) + list(mine.values()):
                w -= lr * w.grad
                w.grad = None
    want = _shard({k: v.detach() for k, v in full.items()}, tp, t)
    for k, w in mine.items():
        assert torch.allclose(w.cpu().double(), want[k], rtol=0, atol=tol), (tp, algo, k)
    for grp in (tp_group, cp_group):
        grp.free()


def check_a_block_trained_on_a_tp_cp_mesh_matches_one_process(world):
    for tp in sorted({1, min(2, world.size)}):  # 2 KV heads: TP of at most 2
        for algo in ("ring", "all_gather"):
            train(world, tp, algo)
