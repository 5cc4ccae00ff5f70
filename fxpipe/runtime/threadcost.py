"""How much faster the workers' torch threads run the model than one thread, for ``fxpipe train``'s prediction.

The profile times every node on one thread (thread CPU time: each node
undisturbed), and the plan's stage times come from it. With fewer workers
than cores, ``launch`` gives each worker ``cores // N`` intra-op threads, so
their forwards and backwards run faster than the profile by that many
threads' speed-up, which depends on the shapes (small matrices gain little):
on the 2-core build machine one worker of the predict benchmark's MLP ran
its microbatches 1.55x faster than the one-thread profile, and the prediction
read 1.52x too slow. The parent measures the speed-up once before training:
the split run in order in this process (``run_local``), forward and backward
of the example minibatch, on one thread (the median of a few runs' thread
CPU time, as the profile counts) and on the workers' count (the least wall
time of a few runs: the other threads' work must count, and load only adds to
it), each within about ``BUDGET_S`` after a warm-up run. The simulator
divides compute by the ratio.

The model's own parameters are what the split holds, so gradients, buffers
(BatchNorm statistics) and the random-number state are put back as they were.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_leaves

from passes.capture_check import restore_buffers, save_buffers

BUDGET_S = 2.0  # per thread count: runs beyond the first warm-up one stop at about this much time


def thread_speedup(split: Any, inputs: Sequence[Any], threads: int, repeats: int = 5) -> float:
    """Seconds of one forward + backward of ``split`` on one thread over that on ``threads`` threads."""
    if threads <= 1:
        return 1.0
    from fxpipe.local import run_local

    params = [p for st in split.stages for p in st.parameters()]
    grads = [p.grad for p in params]
    for p in params:  # else backward would add into the caller's gradient tensors in place
        p.grad = None
    saved = save_buffers(*split.stages)
    before = torch.get_num_threads()

    def once(clock) -> float:
        start = clock()
        out = run_local(split, *inputs)
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
                  and t.is_floating_point()]
        if leaves:
            sum(t.float().sum() for t in leaves).backward()
        for p in params:
            p.grad = None
        return clock() - start

    try:
        with torch.random.fork_rng(devices=[]):
            took = {}
            # one thread: its CPU time, as the profile measures (undisturbed by other work on the machine);
            # several: wall time (the other threads' work counts), the least of the runs (load only adds)
            for n, clock, pick in ((1, time.thread_time, statistics.median), (threads, time.perf_counter, min)):
                torch.set_num_threads(n)
                warm = once(time.perf_counter)  # warm-up: allocator, first-call dispatch
                runs = max(1, min(repeats, int(BUDGET_S / max(warm, 1e-9))))  # a large model: fewer runs
                took[n] = pick(once(clock) for _ in range(runs))
    finally:
        torch.set_num_threads(before)
        for p, g in zip(params, grads):
            p.grad = g
        restore_buffers(saved)
    return took[1] / took[threads] if took[threads] > 0 else 1.0

