"""Device peer memory behind one interface: symmetric allocation, peer views, put/get by the SMs and by the
copy engine, semaphores ordered on a stream with deadlines, the device barrier, and the rules every kernel
on peer memory follows (epochs, scratch parity, graph replay, calls in flight: ``xelink.symm.cuda``'s
docstring). ``cuda`` is the NVIDIA backend. ``xelink.symm.sycl`` is the SYCL one, for one process driving
several devices: its calls take explicit queues and events (``alloc``, ``copy``, ``reduce``, ``barrier``,
``Team``, ``Work``); it is not re-exported here, so importing xelink never loads dpctl.

Every function takes the group and, where it enqueues work, an explicit ``stream`` (None: the current
stream of the group's device). Kernels of composed ops use ``xelink.symm.device`` (Triton device
functions: ``pick``, ``notify``, ``wait_at_least``, ``block_barrier``) and ``Team.kernel``/``Team.run``.
"""
from .cuda import (MAX_BLOCKS, MAX_WORLD, SIGNAL_SLOTS, Bound, Copy, Join, Kernel, Mailboxes, Pair, Team, Work,
                   available, barrier, copy_engine, copy_engine_2d, empty, get, pair_of,
                   peer_addresses, peer_tensor, put, signal, synchronize, team_of, timeout_ns, wait,
                   word_dtype, WORDS)

__all__ = ["MAX_BLOCKS", "MAX_WORLD", "SIGNAL_SLOTS", "Bound", "Copy", "Join", "Kernel", "Mailboxes", "Pair",
           "Team", "Work", "available", "barrier", "copy_engine", "copy_engine_2d", "empty", "get",
           "pair_of", "peer_addresses", "peer_tensor", "put", "signal", "synchronize", "team_of",
           "timeout_ns", "wait", "word_dtype", "WORDS"]
