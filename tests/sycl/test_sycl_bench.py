"""``xelink bench sycl-collectives`` and ``xelink.sycl.topology``: rows for every op x algorithm, checked
outputs, the cost model's prediction; a wrong output is counted. Never skipped (no dpctl: a failure)."""
import json
import os
import subprocess
import sys

os.environ["OCL_ICD_FILENAMES"] = os.path.join(sys.prefix, "lib", "libintelocl.so")

import numpy as np  # noqa: E402

import xelink.sycl as xs  # noqa: E402
from xelink import cost  # noqa: E402
from xelink.bench.families import sycl_collectives as fam  # noqa: E402


def test_topology_has_the_communicators_packages_and_prices_every_algorithm():
    comms = xs.communicators(["opencl:cpu"] * 4, packages=[[0, 1], [2, 3]])
    topo, placement = xs.topology(comms)
    assert placement.packages() == [[0, 1], [2, 3]] and {d.kind for d in topo.devices} == {"cpu"}
    for op in fam.OPS:
        for algo in xs.ALGOS[op]:
            assert cost.predict(topo, placement, op, algo, 1 << 20).time_s > 0


def test_a_wrong_output_is_counted():
    comms = xs.communicators()
    for op in fam.OPS:
        mine, _, wrong, _, poison = fam._case(xs, comms, op, 37, xs.ALGOS[op][0])
        mine()
        assert wrong() == 0
        # Corrupt one element of rank 1's output (all_reduce: its buffer) and the check must see it.
        out = _last_output(mine)
        out.numpy()[5] += 1
        assert wrong() == 1, op
        # What runs before xelink's block leaves no output right (the numpy baseline writes the same outputs;
        # all_reduce: its buffers back to the inputs, which its call takes as they are, almost all elements wrong)
        mine()
        poison()
        if op == "all_reduce":
            assert wrong() > 37, op
        else:
            assert wrong() == len(comms) * (37 * len(comms) if op == "all_gather" else 37), op


def _last_output(call):
    """The array the case writes on rank 1 (from the closure: all_reduce's buffers, else the outputs)."""
    cells = dict(zip(call.__code__.co_freevars, (c.cell_contents for c in call.__closure__)))
    return (cells.get("outs") or cells["bufs"])[1]


def test_the_family_runs_every_op_and_algorithm_with_checked_outputs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "xelink.bench", "sycl-collectives", "--quick", "--counts", "37",
                           "--iters", "1", "--rounds", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "sycl-collectives.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "op" in r]
    got = {(r["op"], r["path"]) for r in rows}
    assert got == {(op, f"xelink:{a}") for op in fam.OPS for a in xs.ALGOS[op]}
    assert all(r["wrong"] == 0 and r["baseline"] == "numpy:host" and r["predicted_us"] > 0 for r in rows)
    assert np.isfinite([r["ratio"] for r in rows]).all()


def test_the_algorithms_are_registered_and_priced():
    import pytest

    from xelink.collectives import registry
    from xelink import topology as T

    assert registry.names("sycl") == xs.ALGOS and xs.ALGOS["all_reduce"] == ("direct", "two_shot", "ring",
                                                                               "hierarchical")
    t = T.load("cpu-2x2")
    for op in registry.OPS:
        for a in registry.algorithms(op, "sycl"):
            assert a.schedule == a.name and cost.predict(t, 4, op, a.schedule, 1 << 20).time_s > 0
    comms = xs.communicators()
    bufs = [xs.empty(c, 4, "float32") for c in comms]
    with pytest.raises(ValueError, match=r"all_reduce: algo='tree' is not one of auto, direct, two_shot, ring, "
                                         r"hierarchical for xelink.sycl arrays"):
        xs.all_reduce(bufs, algo="tree")


def test_topology_wants_the_whole_group_in_rank_order():
    comms = xs.communicators(["opencl:cpu"] * 3)
    for bad in (comms[:2], comms[::-1]):
        try:
            xs.topology(bad)
        except ValueError as exc:
            assert "the whole group, in rank order" in str(exc)
        else:
            raise AssertionError(f"no error for {bad}")


def test_the_family_is_skipped_with_the_reason_where_there_are_not_two_queues(monkeypatch, capsys):
    """A CPU device of one compute unit (e.g. under taskset -c 0) cannot be partitioned: the family is skipped
    with why (it ended in a traceback); a default of more than two queues (a many-core host) is cut to two."""
    from types import SimpleNamespace

    from xelink.bench import suite

    world = SimpleNamespace(rank=0, size=1, device="cpu", hosts=["here"], launch=None, topology=None)
    ctx = suite.Context(world, "sycl-collectives", suite.family_parser("sycl-collectives").parse_args(["--quick"]))

    def unpartitionable(devices=None, packages=None):
        raise ValueError("communicators: AMD EPYC cannot be partitioned: Sub-devices were not created.")

    monkeypatch.setattr(xs, "communicators", unpartitionable)
    status, rows = suite._run_family(ctx)
    assert status == ("skipped: --devices sub2 needs two SYCL queues: communicators: AMD EPYC cannot be "
                      "partitioned: Sub-devices were not created.") and rows == []
    assert "sycl-collectives: skipped: --devices sub2 needs two SYCL queues" in capsys.readouterr().err
    monkeypatch.undo()
    made = []
    real = xs.communicators

    def recorded(devices=None, packages=None):
        made.append(real(["opencl:cpu"] * 3 if devices is None else devices, packages))
        return made[-1]

    monkeypatch.setattr(xs, "communicators", recorded)
    ctx = suite.Context(world, "sycl-collectives", suite.family_parser("sycl-collectives").parse_args(
        ["--quick", "--counts", "5", "--ops", "all_reduce", "--iters", "1", "--rounds", "1"]))
    status, rows = suite._run_family(ctx)
    assert status == "ok" and [len(m) for m in made] == [3, 2] and rows
