"""The watchdog over the GPU waits' error words (xelink.symm.watchdog), with host tensors standing in for the
pinned words the kernels set: a word set later is reported once, within a few polls, naming the rank, the
communicator and the peers; "abort" ends the process; "off" and a word whose error a call raised say nothing."""
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from xelink.errors import TimeoutError, XelinkError
from xelink.symm import cuda as sc
from xelink.symm import watchdog


def _comm(name="w.7"):
    failed = []
    return types.SimpleNamespace(rank=2, name=name, timeout=5.0, fail=failed.append, failed=failed)


def _word(comm, ranks=(0, 1, 2, 3), pair=False):
    return sc._ErrorWord(comm, ranks, "a GPU wait ran past its deadline", torch.zeros(1 + sc.MAX_WORLD,
                                                                                      dtype=torch.int32), pair=pair)


def _wait_for(capsys, text, seconds=3.0):
    seen = ""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen += capsys.readouterr().err
        if text in seen:
            return seen
        time.sleep(watchdog.INTERVAL_S)
    return seen


def test_a_wait_that_gives_up_is_reported_once_naming_rank_comm_and_peers(monkeypatch, capsys):
    monkeypatch.setenv("XELINK_WATCHDOG", "warn")
    comm = _comm("w.team")
    word = _word(comm)
    time.sleep(3 * watchdog.INTERVAL_S)
    assert "w.team" not in capsys.readouterr().err  # nothing set: nothing said
    word.tensor[1 + 3], word.tensor[0] = 1, 1  # the kernel: a wait gave up, waiting for rank 3
    seen = _wait_for(capsys, "w.team")
    assert "xelink watchdog: rank 2 of w.team" in seen and "rank(s) [3]" in seen, seen
    time.sleep(3 * watchdog.INTERVAL_S)
    assert "w.team" not in capsys.readouterr().err  # once
    with pytest.raises(TimeoutError):  # the next call still raises, and breaks the communicator
        word.raise_if_set("all_reduce")
    assert len(comm.failed) == 1


def test_a_pairs_wrong_size_is_reported(monkeypatch, capsys):
    monkeypatch.setenv("XELINK_WATCHDOG", "warn")
    word = _word(_comm("w.pair"), ranks=[5], pair=True)
    word.tensor[2], word.tensor[3] = 1, 4096
    seen = _wait_for(capsys, "w.pair")
    assert "rank 5 sent a message of 4096 B to a receive of another size" in seen, seen
    with pytest.raises(XelinkError, match="recv: rank 5 of w.pair sent a message of 4096 B to a receive of another "
                                          "size on rank 2"):
        word.raise_if_set("recv")  # the call still raises, and breaks the communicator
    assert len(word.comm.failed) == 1


def test_a_word_is_read_whole_one_poll_after_it_is_first_seen_set(monkeypatch):
    # The kernels' stores reach the host one at a time (the flag may come before a late program's peer): a word
    # first seen set is told at the next poll, with every peer that has landed by then. (Not watched: "off".)
    monkeypatch.setenv("XELINK_WATCHDOG", "off")
    word = _word(_comm("w.halfway"))
    word.tensor[0] = 1
    assert word.tripped() is None
    word.tensor[1 + 1], word.tensor[1 + 3] = 1, 1
    assert "waited 5 s for rank(s) [1, 3]" in word.tripped()
    pair = _word(_comm("w.halfpair"), ranks=[5], pair=True)
    pair.tensor[2] = 1
    assert pair.tripped() is None
    pair.tensor[3] = 4096
    assert "sent a message of 4096 B" in pair.tripped()


def test_an_error_a_call_raised_and_off_say_nothing(monkeypatch, capsys):
    monkeypatch.setenv("XELINK_WATCHDOG", "warn")
    word = _word(_comm("w.raised"))
    word.tensor[0], word.tensor[1] = 1, 1
    with pytest.raises(TimeoutError):
        word.raise_if_set("barrier")  # raised before the thread's next poll
    monkeypatch.setenv("XELINK_WATCHDOG", "off")
    quiet = _word(_comm("w.off"))
    quiet.tensor[0], quiet.tensor[1] = 1, 1
    time.sleep(4 * watchdog.INTERVAL_S)
    err = capsys.readouterr().err
    assert "w.raised" not in err and "w.off" not in err, err


def test_bad_mode_names_the_knob(monkeypatch):
    monkeypatch.setenv("XELINK_WATCHDOG", "loud")
    with pytest.raises(ValueError, match="XELINK_WATCHDOG='loud'"):
        watchdog.mode()


def test_abort_ends_the_process():
    code = textwrap.dedent("""
        import os, time, types, torch
        os.environ["XELINK_WATCHDOG"] = "abort"
        from xelink.symm import cuda as sc
        comm = types.SimpleNamespace(rank=0, name="w.abort", timeout=1.0, fail=lambda e: None)
        word = sc._ErrorWord(comm, [1], "a wait gave up", torch.zeros(1 + sc.MAX_WORLD, dtype=torch.int32))
        word.tensor[0], word.tensor[1] = 1, 1
        time.sleep(10)
        print("still alive")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "still alive" not in run.stdout, (run.returncode, run.stdout, run.stderr)
    assert "xelink watchdog: rank 0 of w.abort" in run.stderr, run.stderr
