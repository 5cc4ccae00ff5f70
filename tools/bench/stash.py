"""Benchmark: what weight stashing costs per microbatch, copying against copy-free.

    python -m tools.bench.stash [--repeats 200] [--rounds 3]

One process, one thread: the first half of the runtime bench's GPT and MLP
(``tools.bench.runtime``'s models, the pieces of stage 0 of 2) is one stage.
Per microbatch, as a ``1f1b-stash`` rank does with one microbatch in flight
between forward and backward: make a weight version (``WeightStash``),
forward on it, backward, move the gradients to the master, optimizer step
(the executor's order).
The process keeps freed memory as fxpipe's ranks do (``fxpipe.runtime.heap``;
``--heap both`` also runs every mode with glibc's default thresholds).
Only the stash's own work is timed (making the version, moving the
gradients, the step; the forward and backward are the same in every mode and
would only add their noise). Modes, run interleaved in every round (best
round's median kept; load from other processes only slows a run down):

- ``none``: no stash and no step (what remains: clearing the gradients);
- ``copy``: torch's fused optimizer (in place) and a clone of the weights per
  version (``weight_stash="copy"``);
- ``copy-free``: ``fxpipe.runtime.optim``'s out-of-place optimizer and
  versions that alias the replaced tensors (the default).

The table gives the stash's ms per microbatch for SGD (the runtime bench's
optimizer), SGD with momentum 0.9 and AdamW, and copy's time over copy-free's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, Sequence

import torch

from fxpipe.runtime.heap import keep_freed_memory
from tools.bench.procmem import load_note
from tools.bench.runtime import MODELS, Stack, bounds

MODES = ("none", "copy", "copy-free")
OPTIMIZERS = ("sgd", "sgd-momentum", "adamw")


def _stage(model: str) -> tuple:
    pieces, x, _, _ = MODELS[model]()
    cuts = bounds(len(pieces), 2)
    return Stack(pieces[cuts[0]:cuts[1]]), x


def _time(model: str, opt: str, mode: str, repeats: int) -> float:
    from fxpipe.runtime.loop import TrainConfig, make_optimizer
    from fxpipe.runtime.optim import is_out_of_place
    from fxpipe.runtime.stash import WeightStash

    stage, x = _stage(model)
    cfg = TrainConfig(schedule="1f1b-stash", optimizer=opt.split("-")[0], lr=1e-3,
                      momentum=0.9 if opt == "sgd-momentum" else 0.0)
    optimizer = make_optimizer(cfg, stage, copy_free=mode == "copy-free")
    stash = WeightStash(stage, stash=mode != "none", copy_free=is_out_of_place(optimizer))
    times = []
    for g in range(repeats + 5):
        start = time.perf_counter()
        if mode != "none":
            stash.keep_current()  # what the forward does first: make the version
        spent = time.perf_counter() - start
        out = stash.forward(g, (x,))
        out.float().pow(2).mean().backward()
        start = time.perf_counter()
        stash.backward_done(g)
        if mode != "none":
            stash.gather_grads()
            stash.before_update()
            optimizer.step()
            stash.stepped()
        optimizer.zero_grad(set_to_none=True)
        if g >= 5:
            times.append(spent + time.perf_counter() - start)
    return statistics.median(times)


def _set_heap(heap: str) -> None:
    """kept: as fxpipe's ranks run (fxpipe.runtime.heap); default: glibc's initial thresholds, fixed by
    mallopt (which also turns off glibc's dynamic threshold: not what a process that never calls it gets)."""
    if heap == "kept":
        keep_freed_memory()
    else:
        keep_freed_memory(mmap_threshold=128 * 1024, trim_threshold=128 * 1024)


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200, help="microbatches timed per mode (median)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best median is kept")
    p.add_argument("--models", default="gpt,mlp")
    p.add_argument("--heap", choices=("kept", "default", "both"), default="kept",
                   help="kept: freed memory stays in the process, as fxpipe's ranks run; default: mmap and "
                        "trim thresholds fixed at glibc's initial 128 KiB (mallopt: glibc's dynamic "
                        "threshold off); both: a row set of each, interleaved")
    args = p.parse_args(list(argv) or None)
    from tabulate import tabulate

    torch.set_num_threads(1)
    heaps = ("kept", "default") if args.heap == "both" else (args.heap,)
    load0 = os.getloadavg()
    rows = []
    for model in args.models.split(","):
        for opt in OPTIMIZERS:
            best: Dict[tuple, float] = {}
            for _ in range(args.rounds):
                for heap in heaps:
                    _set_heap(heap)
                    for mode in MODES:
                        t = _time(model, opt, mode, args.repeats)
                        best[heap, mode] = min(best.get((heap, mode), t), t)
            for heap in heaps:
                for mode in MODES:
                    ratio = f"{best[heap, 'copy'] / best[heap, mode]:.2f}" if mode == "copy-free" else ""
                    rows.append([model, opt, heap, mode, f"{best[heap, mode] * 1e3:.3f}", ratio])
    print(tabulate(rows, headers=["model", "optimizer", "heap", "stash", "ms / microbatch", "copy / copy-free"]))
    print(f"1 thread; {load_note(load0)}; median of {args.repeats} microbatches, best of {args.rounds} "
          "interleaved rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
