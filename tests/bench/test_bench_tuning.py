"""The tuning table: built from rows, looked up at range edges, saved, loaded, matched, validated."""
import dataclasses
import json

import pytest
import torch

from xelink.bench import Row, TuningTable, build_table, find_table, fingerprint, load

FP = fingerprint("2x2", ["a", "a", "b", "b"])


def _row(path, size, us, *, op="all_reduce", dtype="float32", baseline=None, baseline_us=None, wrong=0, nranks=4):
    return Row(op=op, path=path, size_bytes=size, count=size // 4, dtype=dtype, nranks=nranks, time_us=us,
               min_us=us, wrong=wrong, baseline=baseline, baseline_us=baseline_us)


def _sweep():
    """Known winners: one_shot at 1 KiB and 4 KiB, MPI at 16 KiB, ring at 64 KiB and 256 KiB."""
    rows = []
    times = {  # size -> (one_shot, ring, mpi) in us
        1024: (5, 20, 9),
        4096: (8, 25, 12),
        16384: (30, 32, 28),
        65536: (90, 60, 70),
        262144: (300, 150, 200),
    }
    for size, (one_shot, ring, mpi) in times.items():
        rows.append(_row("xelink:one_shot", size, one_shot, baseline="mpi:Allreduce", baseline_us=mpi))
        rows.append(_row("xelink:ring", size, ring, baseline="mpi:Allreduce", baseline_us=mpi))
        rows.append(_row("mpi:Allreduce", size, mpi))
    # all_gather in bfloat16: ring is best everywhere, except a faster path that gave wrong results.
    rows.append(_row("xelink:ring", 1024, 10, op="all_gather", dtype="bfloat16"))
    rows.append(_row("xelink:direct", 1024, 1, op="all_gather", dtype="bfloat16", wrong=5))
    rows.append(_row("xelink:ring", 2048, 12, op="all_gather", dtype="bfloat16"))
    return rows


def test_fingerprint_counts_ranks_per_host_without_names():
    assert FP == {"topology": "2x2", "nranks": 4, "ranks_per_host": [2, 2]}
    assert fingerprint(None, ["x"] * 3) == {"topology": None, "nranks": 3, "ranks_per_host": [3]}
    with pytest.raises(ValueError, match=r"fingerprint: hosts='ab' must be a non-empty list"):
        fingerprint("t", "ab")


def test_fingerprint_with_a_placement_tells_machines_of_one_topology_name_apart():
    from xelink import topology as T

    h200 = T.load("nvidia-h200x8")
    one = T.validate(dataclasses.replace(h200, devices=tuple(dataclasses.replace(d, name="NVIDIA H100 80GB HBM3")
                                                             for d in h200.devices)))
    got = fingerprint(h200.name, ["n"] * 8, T.place(h200, 8))
    assert got == {"topology": "nvidia-h200x8", "nranks": 8, "ranks_per_host": [8],
                   "devices": {"cuda NVIDIA H200": 8}, "ranks_per_device": [1] * 8, "links": ["nvswitch 450"]}
    # Another GPU model, or two ranks a GPU on four GPUs: the same name, rank count and hosts, not the same machine.
    assert fingerprint(one.name, ["n"] * 8, T.place(one, 8))["devices"] == {"cuda NVIDIA H100 80GB HBM3": 8}
    shared = fingerprint(h200.name, ["n"] * 8, T.place(h200, 8, 2))
    assert shared["devices"] == {"cuda NVIDIA H200": 4} and shared["ranks_per_device"] == [2] * 4
    other = fingerprint(one.name, ["n"] * 8, T.place(one, 8))
    assert len({json.dumps(f, sort_keys=True) for f in (got, shared, other)}) == 3
    # Links: the kinds and bandwidths between the devices used (one package of a 2x2 CPU topology: shm only).
    cpu = T.load("cpu-2x2")
    assert fingerprint(cpu.name, ["h"] * 2, T.place(cpu, 2))["links"] == ["shm 8"]
    with pytest.raises(ValueError, match=r"fingerprint: a placement of 8 rank\(s\) for 4 host name\(s\)"):
        fingerprint(h200.name, ["n"] * 4, T.place(h200, 8))


def test_build_table_merges_sizes_into_ranges_of_the_fastest_path():
    table = build_table(_sweep(), FP)
    assert table.entries == {
        ("all_reduce", "float32"): [(0, 16384, "xelink:one_shot"), (16384, 65536, "baseline:mpi"),
                                    (65536, None, "xelink:ring")],
        # where a baseline wins, xelink's own fastest too (what auto runs where it cannot hand work to MPI)
        ("all_reduce/xelink", "float32"): [(0, 65536, "xelink:one_shot"), (65536, None, "xelink:ring")],
        ("all_gather", "bfloat16"): [(0, None, "xelink:ring")],
    }


def test_build_table_prefers_xelink_on_a_tie_and_rejects_mixed_rank_counts():
    tie = [_row("xelink:ring", 64, 10, baseline="nccl:all_reduce", baseline_us=10)]
    assert build_table(tie, "fp").entries == {("all_reduce", "float32"): [(0, None, "xelink:ring")]}
    nccl = [_row("xelink:ring", 64, 10, baseline="nccl:all_reduce", baseline_us=9)]
    assert build_table(nccl, "fp").lookup("all_reduce", "float32", 64) == "baseline:nccl"
    with pytest.raises(ValueError, match=r"build_table: rows measured at nranks \[2, 4\]"):
        build_table([_row("xelink:ring", 64, 1), _row("xelink:ring", 64, 1, nranks=2)], "fp")
    with pytest.raises(TypeError, match=r"build_table: fingerprint=3 must be a str or a dict"):
        build_table([], 3)


def test_lookup_at_range_edges():
    table = build_table(_sweep(), FP)
    expect = {0: "xelink:one_shot", 1: "xelink:one_shot", 16383: "xelink:one_shot", 16384: "baseline:mpi",
              65535: "baseline:mpi", 65536: "xelink:ring", 1 << 40: "xelink:ring"}
    for nbytes, algo in expect.items():
        assert table.lookup("all_reduce", "float32", nbytes) == algo, nbytes
        assert table.lookup("all_reduce", torch.float32, nbytes) == algo, nbytes
    assert table.lookup("all_reduce", "float64", 64) is None
    assert table.lookup("broadcast", "float32", 64) is None
    with pytest.raises(ValueError, match=r"TuningTable.lookup: nbytes=-1 must be an int >= 0"):
        table.lookup("all_reduce", "float32", -1)


def test_lookup_in_a_gap_of_a_hand_written_table():
    table = TuningTable("fp", {("all_reduce", "int32"): [(0, 10, "xelink:a"), (20, 30, "xelink:b")]})
    assert [table.lookup("all_reduce", "int32", n) for n in (9, 10, 19, 20, 29, 30)] == [
        "xelink:a", None, None, "xelink:b", "xelink:b", None]


def test_save_load_round_trip(tmp_path):
    table = build_table(_sweep(), FP, manifest={"commit": "abc"})
    path = tmp_path / "dir" / "machine.tuning.json"
    table.save(path)
    loaded = load(path)
    assert loaded.entries == table.entries and loaded.fingerprint == FP
    assert loaded.manifest == {"commit": "abc"} and loaded.source == str(path)
    data = json.loads(path.read_text())
    assert data["format"] == "xelink-tuning" and data["version"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["machine.tuning.json"]  # no temporary left


def test_find_table_applies_only_a_matching_fingerprint(tmp_path):
    build_table(_sweep(), fingerprint("2x2", ["a", "a", "b", "b"])).save(tmp_path / "a.tuning.json")
    other = fingerprint("2x2", ["a", "b", "b", "b"])
    build_table(_sweep()[:3], other).save(tmp_path / "b.tuning.json")
    (tmp_path / "notes.json").write_text("not a table, not searched")

    found = find_table({"nranks": 4, "ranks_per_host": [2, 2], "topology": "2x2"}, [tmp_path / "missing", tmp_path])
    assert found is not None and found.source == str(tmp_path / "a.tuning.json")
    assert find_table(other, [tmp_path]).source == str(tmp_path / "b.tuning.json")
    assert find_table(fingerprint("4x1", ["a"] * 4), [tmp_path]) is None
    assert find_table("2x2", [tmp_path]) is None  # the topology name alone is not the same layout
    # An explicit file of another machine is not applied either.
    assert find_table(fingerprint("8", ["h"] * 8), [tmp_path / "a.tuning.json"]) is None
    assert find_table(FP, str(tmp_path / "a.tuning.json")).fingerprint == FP


@pytest.mark.parametrize("content, problem", [
    ("{not json", r"not valid JSON \(line 1, column 2"),
    ("[1, 2]", r"expected a JSON object, found list"),
    ('{"format": "other", "version": 1}', r"'format' is 'other', expected 'xelink-tuning'"),
    ('{"format": "xelink-tuning", "version": 9}', r"unsupported 'version' 9"),
    ('{"format": "xelink-tuning", "version": 1, "entries": []}', r"'fingerprint' is missing"),
    ('{"format": "xelink-tuning", "version": 1, "fingerprint": "f"}', r"'entries' is missing"),
    ('{"format": "xelink-tuning", "version": 1, "fingerprint": "f", "entries": [{"op": "all_reduce", '
     '"dtype": "float32", "ranges": [[0, 10, "xelink:a"], [5, null, "xelink:b"]]}]}',
     r"entries\[0\] \(all_reduce, float32\): ranges\[1\] starts at 5, inside or before the previous range"),
    ('{"format": "xelink-tuning", "version": 1, "fingerprint": "f", "entries": [{"op": "all_reduce", '
     '"dtype": "float32", "ranges": [[10, 10, "xelink:a"]]}]}', r"ranges\[0\]: hi=10 must be an int > lo=10"),
    ('{"format": "xelink-tuning", "version": 1, "fingerprint": "f", "entries": [{"op": "all_reduce", '
     '"dtype": "float32", "ranges": [[0, null, "auto"]]}]}', r"algo='auto' must name a path"),
    ('{"format": "xelink-tuning", "version": 1, "fingerprint": "f", "entries": [{"op": "x", "dtype": "y", '
     '"ranges": [[0, null, "a"]]}, {"op": "x", "dtype": "y", "ranges": [[0, null, "b"]]}]}',
     r"entries\[1\] \(x, y\): a second entry"),
])
def test_malformed_file_raises_naming_the_file_and_the_problem(tmp_path, content, problem):
    path = tmp_path / "broken.tuning.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"tuning.load: .*broken\.tuning\.json: (.*: )?" + problem):
        load(path)
    with pytest.raises(ValueError, match=r"broken\.tuning\.json"):
        find_table(FP, [tmp_path])  # a broken table in the search path is an error, not a silent miss


def test_save_merged_keeps_the_other_families_entries(tmp_path):
    from xelink.tuning import save_merged

    path = tmp_path / "t.tuning.json"
    host = build_table(_sweep(), FP)
    assert save_merged(host, path) is False  # nothing there yet
    gpu = build_table([_row("xelink:direct", 1024, 3, op="cuda:all_reduce", dtype="bfloat16"),
                       _row("xelink:ring", 1024, 1, op="all_gather", dtype="bfloat16")], FP)
    assert save_merged(gpu, path) is True
    table = load(path)
    assert table.lookup("all_reduce", "float32", 1024) == "xelink:one_shot"  # kept from the first family
    assert table.lookup("cuda:all_reduce", "bfloat16", 1024) == "xelink:direct"
    assert table.lookup("all_gather", "bfloat16", 2048) == "xelink:ring"  # the newer entry wins
    # A table of another machine layout at the path is replaced, not merged.
    other = build_table([_row("xelink:ring", 1024, 1, nranks=2)], fingerprint("h", ["a", "a"]))
    assert save_merged(other, path) is False
    assert load(path).entries.keys() == other.entries.keys()
    path.write_text("{}")
    with pytest.raises(ValueError, match=r"t.tuning.json: 'format' is None"):
        save_merged(other, path)
