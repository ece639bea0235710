"""The uneven-package schedules of the CUDA topology-aware all-gather and hierarchical all-reduce
(``xelink.collectives.gpu.compose``), run without a GPU: CPU tensors, simulated ranks as threads and a
stand-in for ``xelink.symm`` (``empty``, ``get``, ``barrier``, ``team_of``).

The stand-in turns every device barrier into a phase in which the ranks run one at a time, in an order
drawn per phase; a schedule that reads in one phase what a peer writes in the same phase (or overwrites
what a peer still reads) gives a wrong result under one of the orders. Every read of a peer's copy is
logged, so the tests also count the bytes that cross between packages: each shard (all-gather) and each
package partial (all-reduce) enters every other package exactly once.
"""
import random
import threading
import types

import pytest
import torch

from collective_cases import assert_same, data, expected_reduce
from xelink.collectives.gpu import compose

LAYOUTS = ([[0, 1], [2]], [[0, 1, 2], [3]], [[0], [1, 2]], [[0, 1, 2], [3, 4]], [[0, 2], [1]],
           [[0], [1, 2, 3], [4, 5]])


class _Lockstep:
    """Phases separated by barriers; inside a phase the ranks take turns in ``order(phase)``."""

    def __init__(self, n, seed):
        self.n, self.seed = n, seed
        self.cv = threading.Condition()
        self.phase = self.pos = 0
        self.broken = None

    def order(self, phase):
        return random.Random(self.seed * 100003 + phase).sample(range(self.n), self.n)

    def _wait_turn(self, rank, after):
        ok = self.cv.wait_for(lambda: self.broken is not None or
                              (self.phase > after and self.order(self.phase)[self.pos] == rank), timeout=30)
        if self.broken is not None:
            raise RuntimeError(f"rank {rank}: another rank failed")
        if not ok:
            self.broken = "timeout"
            self.cv.notify_all()
            raise RuntimeError(f"rank {rank}: a barrier never completed (ranks disagree on the schedule)")

    def start(self, rank):
        with self.cv:
            self._wait_turn(rank, -1)

    def _advance(self):
        self.pos += 1
        if self.pos == self.n:
            self.pos, self.phase = 0, self.phase + 1
        self.cv.notify_all()

    def barrier(self, rank):
        with self.cv:
            mine = self.phase
            self._advance()
            self._wait_turn(rank, mine)

    def finish(self, rank):
        with self.cv:
            self._advance()

    def fail(self, why):
        with self.cv:
            self.broken = why
            self.cv.notify_all()


class _Sim:
    """The simulated job: every rank's staging buffers (by generation), the read log, the lockstep."""

    def __init__(self, packages, cap, seed):
        self.packages = packages
        self.n = sum(len(p) for p in packages)
        self.cap = cap
        self.bufs = {r: [] for r in range(self.n)}
        self.reads = []  # (reader, owner, nbytes)
        self.step = _Lockstep(self.n, seed)

    def symm(self):
        sim = self

        def empty(size, dtype, group):
            t = torch.randint(0, 256, (size,), dtype=torch.uint8)  # garbage, as fresh device memory
            sim.bufs[group.rank].append(t)
            return t

        def get(dst, src, rank, *, group, engine="copy", stream=None):
            assert engine == "copy" and rank != group.rank, (engine, rank)
            mine = sim.bufs[group.rank]
            nbytes = src.numel() * src.element_size()
            gen = next(g for g, b in enumerate(mine)
                       if b.data_ptr() <= src.data_ptr() and src.data_ptr() + nbytes <= b.data_ptr() + b.numel())
            theirs = sim.bufs[rank][gen]
            assert theirs.numel() == mine[gen].numel(), "ranks grew their staging buffers differently"
            off = src.data_ptr() - mine[gen].data_ptr()
            assert dst.numel() * dst.element_size() == nbytes
            dst.view(torch.uint8).copy_(theirs[off:off + nbytes])
            sim.reads.append((group.rank, rank, nbytes))

        def barrier(group, *, stream=None, timeout=None):
            sim.step.barrier(group.rank)

        return types.SimpleNamespace(empty=empty, get=get, barrier=barrier,
                                     team_of=lambda comm, fn="": types.SimpleNamespace(slot_max=sim.cap))

    def run(self, per_rank):
        """``per_rank(comm)`` on every simulated rank at once; re-raises the first failure."""
        errors = {}

        def body(rank):
            comm = _Comm(rank, self.n, self.packages)
            try:
                self.step.start(rank)
                per_rank(comm)
                self.step.finish(rank)
            except BaseException as e:  # noqa: BLE001 - handed to the test below
                errors[rank] = e
                self.step.fail(repr(e))

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a simulated rank hung"
        if errors:
            first = min(errors, key=lambda r: isinstance(errors[r], RuntimeError))
            raise errors[first]

    def crossing(self):
        """Bytes read across packages, by the reader's package."""
        where = {r: p for p, members in enumerate(self.packages) for r in members}
        out = {p: 0 for p in range(len(self.packages))}
        for reader, owner, nbytes in self.reads:
            if where[reader] != where[owner]:
                out[where[reader]] += nbytes
        return out


class _Comm:
    def __init__(self, rank, size, packages):
        self.rank, self.size, self.packages, self.name = rank, size, [list(p) for p in packages], "sim"
        self._resources = {}

    def package_index(self, rank):
        for p, members in enumerate(self.packages):
            if rank in members:
                return p, members.index(rank)
        raise ValueError(rank)

    def resource(self, key, make=None):
        if key not in self._resources and make is not None:
            self._resources[key] = make()
        return self._resources.get(key)


def _simulate(monkeypatch, packages, cap, seed):
    sim = _Sim(packages, cap, seed)
    monkeypatch.setattr(compose, "symm", sim.symm())
    return sim


def test_gather_sources_cover_every_shard_once():
    for packages in LAYOUTS:
        n = sum(map(len, packages))
        takers = {}
        for r in range(n):
            across, inside = compose.gather_sources(packages, r)
            assert sorted(inside) == list(range(n))
            p = next(i for i, m in enumerate(packages) if r in m)
            assert all(inside[s] in packages[p] for s in range(n))
            assert all(inside[s] == r for s in across) and r not in across
            for s in across:
                takers.setdefault((s, p), []).append(r)
        # every shard enters every other package exactly once, at the member with its local index (wrapping)
        for ps, members in enumerate(packages):
            for i, s in enumerate(members):
                for p, others in enumerate(packages):
                    assert takers.get((s, p)) == (None if p == ps else [others[i % len(others)]]), (packages, s, p)


@pytest.mark.parametrize("packages", LAYOUTS, ids=str)
@pytest.mark.parametrize("cap", [1 << 20, 1000], ids=["one piece", "pieces"])
def test_topo_all_gather_on_uneven_packages(monkeypatch, packages, cap):
    for seed in range(3):
        sim = _simulate(monkeypatch, packages, cap, seed)
        n = sim.n
        plan = [(1, torch.float32), (1023, torch.bfloat16), (7, torch.int64), (1023, torch.float32), (2, torch.float16)]
        results = {}

        def rank_calls(comm):
            for case, (count, dtype) in enumerate(plan):
                out = torch.full((n * count,), 99, dtype=dtype)
                assert compose.topo_all_gather(comm, out, data(comm.rank, case, count, dtype), False, None) is None
                results[(comm.rank, case)] = out

        sim.run(rank_calls)
        for case, (count, dtype) in enumerate(plan):
            want = torch.cat([data(p, case, count, dtype) for p in range(n)])
            for r in range(n):
                assert_same(results[(r, case)], want, f"{packages} seed {seed} rank {r} case {case}")
        crossed = sim.crossing()
        for p, members in enumerate(packages):
            remote = n - len(members)
            assert crossed[p] == sum(remote * count * dtype.itemsize for count, dtype in plan), (packages, p)


@pytest.mark.parametrize("packages", LAYOUTS, ids=str)
@pytest.mark.parametrize("cap", [1 << 20, 600], ids=["one piece", "pieces"])
def test_hierarchical_all_reduce_on_uneven_packages(monkeypatch, packages, cap):
    plan = [(1, torch.float32, "sum"), (1023, torch.bfloat16, "sum"), (17, torch.bfloat16, "avg"),
            (31, torch.float32, "max"), (9, torch.int64, "min"), (13, torch.float64, "prod"), (2, torch.int32, "sum"),
            (1023, torch.float32, "avg")]
    for seed in range(3):
        sim = _simulate(monkeypatch, packages, cap, seed)
        n = sim.n
        results = {}

        def rank_calls(comm):
            for case, (count, dtype, op) in enumerate(plan):
                x = data(comm.rank, case, count, dtype, op)
                assert compose.hierarchical_all_reduce(comm, x, op, False, None) is None
                results[(comm.rank, case)] = x

        sim.run(rank_calls)
        for case, (count, dtype, op) in enumerate(plan):
            want = expected_reduce(n, case, count, dtype, op)
            for r in range(n):
                assert_same(results[(r, case)], want, f"{packages} seed {seed} rank {r} case {case} {op} {dtype}")
        # each chunk's package partial enters every other package once (in the working type)
        crossed = sim.crossing()
        for p in range(len(packages)):
            wd = {torch.bfloat16: 4, torch.float16: 4}
            assert crossed[p] == sum((len(packages) - 1) * count * wd.get(dtype, dtype.itemsize)
                                     for count, dtype, _ in plan), (packages, p)


def test_the_staging_buffer_grows_together_and_keeps_what_it_outgrew(monkeypatch):
    packages = [[0, 1], [2]]
    sim = _simulate(monkeypatch, packages, 1 << 30, 0)

    def calls(comm):
        for count in (10, 1 << 19, 3):  # 1 MiB staging, then 6 MiB, then no growth
            out = torch.zeros(3 * count)
            compose.topo_all_gather(comm, out, data(comm.rank, count, count, torch.float32), False, None)
            assert_same(out, torch.cat([data(p, count, count, torch.float32) for p in range(3)]), f"count {count}")
        stage = comm.resource("cuda.compose")
        assert len(stage.retired) == 1 and stage.buf.numel() == 8 << 20, (len(stage.retired), stage.buf.numel())

    sim.run(calls)
    assert [len(b) for b in sim.bufs.values()] == [2, 2, 2]


def test_uneven_packages_are_accepted_on_cuda_tensors():
    from xelink.collectives import dispatch, gpu, registry

    class Comm:
        size, rank, device, name, hosts = 3, 0, "cuda:0", "stub", ["h"] * 3
        packages = [[0, 1], [2]]
        _resources = {"cuda.team": object()}  # peer memory set up: only the layout could refuse

    for op, name in (("all_reduce", "hierarchical"), ("all_gather", "topo")):
        entry = registry.get("test", op, name, "cuda")
        assert entry.needs == frozenset({"peer_memory"}), entry.needs
        assert gpu.unmet(Comm(), entry) is None
        assert dispatch.resolve(op, op, name, Comm(), "cuda", 1024, torch.float32) is entry
