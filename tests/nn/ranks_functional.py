"""xelink.nn.functional on CPU ranks: each op's input gradients equal one process's autograd of the same
computation on the stacked tensors, and tensor-parallel training through them (column- then row-parallel MLP;
with sequence parallelism: rows all-gathered before it, the output reduce-scattered after) ends with one
process's weights."""
import pytest
import torch

import xelink.nn.functional as XF


def _global(shape, seed, device="cpu", dtype=torch.float64):
    """The same tensor on every rank (the one-process side)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device, dtype)


def match_one_process(cases, X, W, r):
    """Each case (name: (op on this rank's row of X, the same on all of X at once)): the input gradient of this rank's
    loss (its output weighted by W[r]) equals one process's autograd of every rank's loss."""
    for name, (op, whole) in cases.items():
        x = X[r].clone().requires_grad_()
        (op(x) * W[r]).sum().backward()
        G = X.clone().requires_grad_()
        (whole(G) * W).sum().backward()
        torch.testing.assert_close(x.grad, G.grad[r], msg=name)


def check_each_op_has_one_process_gradients(world):
    n, r = world.size, world.rank
    X = _global((n, 6), 1)  # row q: rank q's input
    W = _global((n, 6), 2)  # row q: rank q's loss weights
    cases = {
        "all_reduce sum": (lambda x: XF.all_reduce(x), lambda X: X.sum(0).expand(n, -1)),
        "all_reduce avg": (lambda x: XF.all_reduce(x, op="avg"), lambda X: X.mean(0).expand(n, -1)),
        "all_reduce torch AVG": (lambda x: XF.all_reduce(x, op=torch.distributed.ReduceOp.AVG),
                                 lambda X: X.mean(0).expand(n, -1)),
        "broadcast": (lambda x: XF.broadcast(x, src=n - 1), lambda X: X[n - 1].expand(n, -1)),
        "broadcast group_src": (lambda x: XF.broadcast(x, group_src=0), lambda X: X[0].expand(n, -1)),
        # reduce: the sum (mean) on the root, each other rank's own input elsewhere, every output in the loss
        "reduce sum": (lambda x: XF.reduce(x, dst=n - 1),
                       lambda X: torch.stack([X.sum(0) if q == n - 1 else X[q] for q in range(n)])),
        "reduce avg group_dst": (lambda x: XF.reduce(x, op="avg", group_dst=0),
                                 lambda X: torch.stack([X.mean(0) if q == 0 else X[q] for q in range(n)])),
    }
    match_one_process(cases, X, W, r)
    # all_gather: rank r's slot q is rank q's tensor; loss weights per (rank, slot)
    V = _global((n, n, 3), 3)
    x = X[r, :3].clone().requires_grad_()
    got = XF.all_gather(x)
    assert len(got) == n and all(torch.equal(g, X[q, :3]) for q, g in enumerate(got))
    sum((g * V[r, q]).sum() for q, g in enumerate(got)).backward()
    torch.testing.assert_close(x.grad, V[:, r].sum(0))  # every rank's weight of slot r
    # each slot a tensor of its own, as torch's: modified in place before backward (views of one buffer refused it)
    x.grad = None
    got = XF.all_gather(x)
    got[0].mul_(2)
    sum((g * V[r, q]).sum() for q, g in enumerate(got)).backward()
    torch.testing.assert_close(x.grad, V[:, r].sum(0) * (2 if r == 0 else 1))  # (every rank doubled slot 0)
    # reduce_scatter (sum, avg): rank r receives the reduction of every rank's block r
    for op, scale in (("sum", 1.0), ("avg", 1.0 / n)):
        blocks = [_global((2, 3), 10 + 7 * r + j).requires_grad_() for j in range(n)]
        output = torch.full((2, 3), float("nan"), dtype=torch.float64)
        out = XF.reduce_scatter(output, blocks, op=op)
        want = sum(_global((2, 3), 10 + 7 * q + r) for q in range(n)) * scale
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(output, want)  # written too, as torch's
        wr = [_global((2, 3), 50 + j) for j in range(n)]  # rank j's loss weights
        (out * wr[r]).sum().backward()
        for j, b in enumerate(blocks):
            torch.testing.assert_close(b.grad, wr[j] * scale, msg=f"reduce_scatter {op} block {j}")
    # all_to_all_single with uneven rows: rank q sends q + j + 1 rows to rank j
    rows = [[q + j + 1 for j in range(n)] for q in range(n)]
    inp = _global((sum(rows[r]), 2), 60 + r).requires_grad_()
    output = torch.empty(sum(rows[q][r] for q in range(n)), 2, dtype=torch.float64)
    out = XF.all_to_all_single(output, inp, [rows[q][r] for q in range(n)], rows[r])
    assert torch.equal(out, output)
    w = _global(tuple(out.shape), 70 + r)
    (out * w).sum().backward()
    # the gradient of the rows rank r sent to rank j: rank j's weights of the rows it got from r
    start = [sum(rows[q][j] for q in range(r)) for j in range(n)]
    want = torch.cat([_global((sum(rows[q][j] for q in range(n)), 2), 70 + j)[start[j]:start[j] + rows[r][j]]
                      for j in range(n)])
    torch.testing.assert_close(inp.grad, want)
    # gather to the last rank: slot q there is rank q's tensor; the others' outputs are zeros (no gradient)
    x = X[r, :4].clone().requires_grad_()
    got = XF.gather(x, dst=n - 1)
    assert all(torch.equal(g, X[q, :4] if r == n - 1 else torch.zeros(4, dtype=torch.float64))
               for q, g in enumerate(got))
    sum((g * V[r, q, :1]).sum() for q, g in enumerate(got)).backward()
    torch.testing.assert_close(x.grad, V[n - 1, r, :1].expand(4))  # the root's weight of slot r
    # scatter from rank 0 (group_src): rank r gets the root's entry r; the root's entries' gradients come back
    ins = [(X[r, :3] * (j + 1)).clone().requires_grad_() for j in range(n)]
    out = XF.scatter(ins, group_src=0)
    assert torch.equal(out, X[0, :3] * (r + 1))
    (out * W[r, :3]).sum().backward()
    for j, t in enumerate(ins):
        want = W[j, :3] if r == 0 else None
        assert (t.grad is None) if want is None else torch.allclose(t.grad, want), (j, t.grad)
    # all_to_all (list form), tensors of other sizes per pair: rank q sends rank j q + j + 1 elements
    ins = [_global((r + j + 1,), 200 + 10 * r + j).requires_grad_() for j in range(n)]
    outputs = [torch.empty(q + r + 1, dtype=torch.float64) for q in range(n)]
    got = XF.all_to_all(outputs, ins)
    assert all(torch.equal(g, _global((q + r + 1,), 200 + 10 * q + r)) and torch.equal(g, o)
               for q, (g, o) in enumerate(zip(got, outputs)))
    sum((g * _global(tuple(g.shape), 300 + 10 * r + q)).sum() for q, g in enumerate(got)).backward()
    for j, t in enumerate(ins):  # rank j's weights of what it got from this rank
        torch.testing.assert_close(t.grad, _global((r + j + 1,), 300 + 10 * j + r))
    with pytest.raises(ValueError, match=r"xelink.nn.functional.all_reduce: op='max' has no gradient here"):
        XF.all_reduce(torch.ones(2), op="max")
    with pytest.raises(ValueError, match=r"reduce_scatter: input_list must be"):
        XF.reduce_scatter(torch.empty(2), [torch.ones(3)] * n)
    with pytest.raises(TypeError, match=r"xelink.nn.functional.all_gather: group='w' is not an xelink Communicator"):
        XF.all_gather(torch.ones(2), group="w")
    with pytest.raises(ValueError, match=r"xelink.nn.functional.broadcast: pass src= .* or group_src="):
        XF.broadcast(torch.ones(2))
    with pytest.raises(ValueError, match=rf"^xelink.nn.functional.broadcast: src={n} is not a world rank of the group"):
        XF.broadcast(torch.ones(2), src=n)
    with pytest.raises(ValueError, match=rf"^xelink.nn.functional.gather: group_dst={n} is out of range for a group "):
        XF.gather(torch.ones(2), group_dst=n)
    # an output of another dtype is refused, not written truncated (a float into an int) or cast
    with pytest.raises(TypeError, match=r"^xelink.nn.functional.all_to_all_single: output\[0\] is torch.int32 "):
        XF.all_to_all_single(torch.empty(n, dtype=torch.int32), torch.full((n,), 1.5))
    with pytest.raises(TypeError, match=rf"^xelink.nn.functional.all_to_all: output_tensor_list\[{n - 1}\] is "):
        XF.all_to_all([torch.empty(1)] * (n - 1) + [torch.empty(1, dtype=torch.int64)], [torch.ones(1)] * n)
    with pytest.raises(TypeError, match=rf"^xelink.nn.functional.reduce_scatter: input_list\[{n - 1}\] is "):
        XF.reduce_scatter(torch.empty(2), [torch.ones(2)] * (n - 1) + [torch.ones(2, dtype=torch.bfloat16)])
    world.barrier()  # nothing was sent by the refused calls


def check_tensor_parallel_mlp_training_matches_one_process(world):
    tp_training(world, "cpu", torch.float64)


def tp_training(world, device, dtype, tol=None):
    """Megatron-style: W1 split by output features (column-parallel), W2 by input features (row-parallel), the
    partial outputs summed by all_reduce; with sequence parallelism the batch rows are sharded, all-gathered
    (with their gradient) before W1 and the output reduce-scattered after W2. SGD on every shard, 6 steps:
    the weights equal one process's training of the whole MLP (on ``device`` in ``dtype``; ``tol``: rtol and
    atol of the comparison, default assert_close's for the dtype)."""
    n, r = world.size, world.rank
    B, H, F = 4 * n, 8, 4 * n
    W1, W2 = _global((F, H), 80, device, dtype), _global((H, F), 81, device, dtype)
    close = {} if tol is None else dict(rtol=tol, atol=tol)
    for sequence_parallel in (False, True):
        w1 = W1[r * F // n:(r + 1) * F // n].clone().requires_grad_()
        w2 = W2[:, r * F // n:(r + 1) * F // n].clone().requires_grad_()
        ref1, ref2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
        for step in range(6):
            x, target = _global((B, H), 90 + step, device, dtype), _global((B, H), 100 + step, device, dtype)
            for params, full in (((w1, w2), False), ((ref1, ref2), True)):
                a, b = params
                if full:
                    y = torch.relu(x @ a.T) @ b.T
                    loss = ((y - target) ** 2).sum()
                elif sequence_parallel:
                    mine = x[r * B // n:(r + 1) * B // n]
                    whole = torch.cat(XF.all_gather(mine))  # the rows of every rank, with their gradient
                    partial = torch.relu(whole @ a.T) @ b.T
                    out = torch.empty(B // n, H, dtype=dtype, device=device)
                    y = XF.reduce_scatter(out, list(partial.chunk(n)))  # this rank's rows of the sum
                    loss = ((y - target[r * B // n:(r + 1) * B // n]) ** 2).sum()
                else:
                    y = XF.all_reduce(torch.relu(x @ a.T) @ b.T)
                    loss = ((y - target) ** 2).sum() / n  # every rank holds the whole loss: count it once
                loss.backward()
                with torch.no_grad():
                    for p in params:
                        p -= 1e-3 * p.grad
                        p.grad = None
        torch.testing.assert_close(w1.detach(), ref1.detach()[r * F // n:(r + 1) * F // n], **close)
        torch.testing.assert_close(w2.detach(), ref2.detach()[:, r * F // n:(r + 1) * F // n], **close)
        assert not torch.equal(w1.detach(), W1[r * F // n:(r + 1) * F // n]), "the weights did not move"
