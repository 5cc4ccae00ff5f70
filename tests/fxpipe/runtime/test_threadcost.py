"""The thread speed-up ``fxpipe train`` measures for its prediction leaves the model as it found it.

What it returns is a timing (not asserted beyond being a positive number);
what it must not do is train: the split holds the user's own parameters, so
their gradients, BatchNorm statistics, the random-number state and torch's
thread count are checked to be as before.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

import fxpipe
from fxpipe.runtime import launch
from fxpipe.runtime.loop import TrainConfig
from fxpipe.runtime.threadcost import thread_speedup


def _split():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.1), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    return model, (x,), fxpipe.split(model, (x,), 2, progress=False, time_limit=3)


def test_measuring_the_speedup_changes_nothing_it_ran() -> None:
    model, inputs, sm = _split()
    first = next(model.parameters())
    first.grad = torch.full_like(first, 3.0)
    bn = model[1]
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    speed = thread_speedup(sm, inputs, 2, repeats=2)
    assert math.isfinite(speed) and speed > 0
    assert torch.equal(first.grad, torch.full_like(first, 3.0))
    assert all(p.grad is None for p in model.parameters() if p is not first)
    assert all(torch.equal(a, b) for a, b in zip(stats, (bn.running_mean, bn.running_var, bn.num_batches_tracked)))
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    assert thread_speedup(sm, inputs, 1) == 1.0  # one thread per worker: the profile's own


def test_the_prediction_divides_compute_by_the_speedup(monkeypatch, capsys) -> None:
    _, inputs, sm = _split()
    cfg = TrainConfig(microbatches=4)
    one = launch._predict(sm, cfg, 2, on_cpu=True, inputs=inputs, threads=1)
    monkeypatch.setattr("fxpipe.runtime.threadcost.thread_speedup", lambda split, inputs, threads: 2.0)
    faster = launch._predict(sm, cfg, 2, on_cpu=True, inputs=inputs, threads=2)
    assert "2 threads per worker run the model 2.00x as fast as the profile's one" in capsys.readouterr().err
    assert faster > one
