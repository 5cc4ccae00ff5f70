"""What one point-to-point message costs in CPU, measured, for the simulator.

On gloo a message is CPU work on both sides: the executor hands the buffer to
its poster thread (``fxpipe.runtime.poster``), which posts it, and gloo's I/O
thread and the kernel move the bytes. None of it shows in the profile, and
where ranks have no idle core (as many ranks as cores, or more) it comes out
of their compute. Measured once per process rather than guessed: two gloo
process groups of one pair of ranks, joined through an in-memory store in
this very process, each with a poster thread of its own as the runtime has,
exchange messages of two sizes, and the process's CPU time (every thread's)
per message, halved, is one side's cost: a fixed part and a part per byte.

Charging only the caller's posting time, as before, missed most of it: on the
2-core build machine a 128-KiB message cost 310 µs of CPU through the
posters (both sides) against the 9–14 µs the post itself takes.
It takes under a second (three rounds of two sizes, ~0.1 s each, and a warm-up); repeated
measurements on that machine spread by about ±15 % (128 KiB: 115–157 µs a side, at 0.2 s a size).
"""
from __future__ import annotations

import functools
import statistics
import threading
import time
from datetime import timedelta
from typing import List, Tuple

import torch
import torch.distributed as dist

from fxpipe.runtime.poster import Poster

SIZES = (4 << 10, 256 << 10)  # bytes: a small message (mostly fixed cost) and an activation-sized one
ROUNDS = 3  # interleaved measurements of both sizes; the median of each (a busy machine spikes single ones)


def _groups() -> List:
    store = dist.HashStore()
    groups: List = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def _cpu_per_message(groups: List, posters: List[Poster], nbytes: int, budget_s: float) -> float:
    """Process CPU seconds per message of ``nbytes`` (both sides), sent and received through the posters."""
    buf = torch.zeros(max(1, nbytes // 4))
    out = torch.empty_like(buf)
    timeout = timedelta(seconds=30)

    def one(tag: int) -> None:
        sent = posters[0].post(lambda t, p, tag: groups[0].send([t], p, tag), buf, 1, tag=tag)
        got = posters[1].post(lambda t, p, tag: groups[1].recv([t], p, tag), out, 0, tag=tag)
        got.wait(timeout)
        sent.wait(timeout)

    n, cpu0, end = 0, time.process_time(), time.perf_counter() + budget_s
    while n < 20 or time.perf_counter() < end:
        one(n)
        n += 1
    return (time.process_time() - cpu0) / n


@functools.lru_cache(maxsize=None)
def message_cost_s(budget_s: float = 0.1) -> Tuple[float, float]:
    """(seconds, seconds per byte): the CPU one side of a gloo message costs, ``fixed + per_byte * bytes``.

    Measured once per process at the two ``SIZES``, ``ROUNDS`` times each for about ``budget_s``
    after a warm-up, the median of each size kept.
    """
    groups = _groups()
    posters = [Poster(), Poster()]
    try:
        for n in SIZES:  # warm-up: connections, threads, allocator
            _cpu_per_message(groups, posters, n, budget_s / 2)
        runs = [[_cpu_per_message(groups, posters, n, budget_s) / 2 for n in SIZES] for _ in range(ROUNDS)]
        small, large = (statistics.median(col) for col in zip(*runs))
    finally:
        for p in posters:
            p.close()
    per_byte = max(0.0, (large - small) / (SIZES[1] - SIZES[0]))
    return max(0.0, small - per_byte * SIZES[0]), per_byte
