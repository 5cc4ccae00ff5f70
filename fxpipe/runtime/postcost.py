"""What posting one point-to-point message costs the posting rank, measured, for the simulator.

A send or receive action of the executor hands a buffer to gloo and returns
(the bytes move in gloo's own threads), but the handing over is time the
rank does not compute. The simulator charges it per action (``post_s``).
It is measured here once per process rather than guessed: two gloo process
groups of one pair of ranks, joined through an in-memory store in this very
process (no other process, no network beyond loopback), post ``repeats``
send/receive pairs of a small tensor; the median time of one post is the
cost. It takes about a tenth of a second.
"""
from __future__ import annotations

import functools
import statistics
import threading
import time
from datetime import timedelta
from typing import List

import torch
import torch.distributed as dist


@functools.lru_cache(maxsize=None)
def posting_cost_s(repeats: int = 200, numel: int = 1024) -> float:
    """Median seconds to post one ``isend`` or ``irecv`` on gloo (CPU), measured once per process."""
    store = dist.HashStore()
    groups: List = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    buf, out = torch.zeros(numel), torch.empty(numel)
    posts: List[float] = []
    for i in range(repeats):
        start = time.perf_counter()
        sent = groups[0].send([buf], 1, i)
        mid = time.perf_counter()
        got = groups[1].recv([out], 0, i)
        posts += [mid - start, time.perf_counter() - mid]
        sent.wait()
        got.wait()
    return statistics.median(posts)
