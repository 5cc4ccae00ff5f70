"""Measured optimizer-step time per stage, for ``fxpipe train``'s prediction.

The profile times every node's forward and backward, but the optimizer is a
training option (``--optimizer``), so the plan knows nothing of the step. It
matters most for ``1f1b-stash``, which steps after every backward and makes a
new weight version at the next forward: there the step is paid once per
microbatch, not once per minibatch, and a small stage's step is a visible share
of its forward and backward (numbers in docs/results.md, "Predicted
against measured").

So before training the parent times, per stage, the very optimizer the
workers build (``make_optimizer``) on throwaway copies of the stage's
parameters with gradients set, on as many threads as each worker runs; with a copying
stash (``weight_stash="copy"``), plus the copy of the weights that makes the
next version (the default copy-free stash has none). The model's own
parameters and optimizer state are never touched. A stage over
``SAMPLE_NUMEL`` elements is timed on one tensor of that size and the time
scaled by its element count (a fused step is linear in bytes), so the copies
and optimizer state never cost the parent more than a few hundred MiB.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, List

import torch
import torch.nn as nn

from fxpipe.runtime.loop import STASHING, TrainConfig, make_optimizer
from fxpipe.runtime.optim import is_out_of_place, run_step

SAMPLE_NUMEL = 16 * 2**20  # 64 MiB of fp32


def stage_step_s(stage: nn.Module, cfg: TrainConfig, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of one optimizer step (and, with a copying stash, one weight copy) for ``stage``."""
    params = [p for p in stage.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    if numel > SAMPLE_NUMEL:
        sample = torch.zeros(SAMPLE_NUMEL, dtype=params[0].dtype, device=params[0].device)
        return _time_step([sample], cfg, repeats, warmup) * numel / SAMPLE_NUMEL
    return _time_step(params, cfg, repeats, warmup)


def _time_step(params: List[torch.Tensor], cfg: TrainConfig, repeats: int, warmup: int) -> float:
    copies = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in params])
    stashing = cfg.schedule in STASHING
    opt = make_optimizer(cfg, copies, copy_free=stashing and cfg.weight_stash == "copy-free")
    stash = stashing and not is_out_of_place(opt)  # a copying stash clones the weights once per update
    times = []
    for i in range(warmup + repeats):
        # gradients afresh every time: a copy-free step consumes them (SGD writes the weights over them)
        for p in copies:
            p.grad = torch.zeros_like(p)
        start = time.perf_counter()
        run_step(opt)  # as the executor steps
        if stash:
            for p in copies:
                p.detach().clone()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_costs(split: Any, cfg: TrainConfig, threads: int = 1, repeats: int = 5) -> List[float]:
    """``stage_step_s`` of every stage of ``split``, timed on the ``threads`` the workers run."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [stage_step_s(stage, cfg, repeats) for stage in split.stages]
    finally:
        torch.set_num_threads(before)
