"""The last stage's step lines cost the same at step 100,000 as at step 1.

Each step's line needs that step's mean loss; it was read off the list of
every step's means, rebuilt per step, so a run's reporting grew with the square
of its steps (1,600 flush steps: 1.28 million ``max`` calls, a fifth of the
profiled run; 100,000 steps would have spent minutes on it).
"""
from __future__ import annotations

import pytest

from fxpipe.runtime.report import Reporter


def test_a_step_line_reads_only_its_own_step(monkeypatch, capsys) -> None:
    losses: list = []
    rep = Reporter(steps=3000, microbatches=2, samples_per_step=8, printing=True, losses=losses)
    monkeypatch.setattr(Reporter, "step_losses", property(lambda self: pytest.fail("every step's losses read")))
    for s in range(3000):
        losses += [(2 * s, float(s)), (2 * s + 1, float(s) + 1.0)]
        rep.step_done(s)
        assert not losses  # the step's losses are taken off the executor's list
    monkeypatch.undo()
    assert rep.step_losses[:2] == [0.5, 1.5] and rep.step_losses[-1] == 2999.5 and len(rep.step_losses) == 3000
    assert "step 3000/3000  loss 2999.500000" in capsys.readouterr().out


def test_log_every_prints_every_nth_step_and_the_last_with_the_rate_over_them(monkeypatch, capsys) -> None:
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr("fxpipe.runtime.report.time.perf_counter", lambda: next(clock))
    losses: list = []
    rep = Reporter(steps=7, microbatches=1, samples_per_step=10, printing=True, losses=losses, every=3)
    for s in range(7):
        losses.append((s, float(s)))
        rep.step_done(s)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["3/7", "6/7", "7/7"]
    assert all(line.endswith("samples/s 10.0") for line in lines)  # one second a step on this clock
    assert rep.step_losses == [float(s) for s in range(7)]  # every step is still recorded
