"""PipeDream-2BW as data: its order, its validator rule, its simulated run and its memory model.

The numbers checked: per rank one update per batch right after the batch's
last backward, no drain between batches (1F1B carries on), at most two weight
versions in the simulator's memory, and the cost model's two versions.
The training semantics themselves are checked against a single-process
reference in tests/fxpipe/runtime/test_tied_exact.py.
"""
from __future__ import annotations

import pytest

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from fxpipe.schedule import ScheduleError, build_schedule, validate
from fxpipe.simulate import ActionCosts, simulate
from fxpipe.validate import Schedule
from passes.partition.costmodel import SCHEDULES, CostOptions, in_flight, memory_bytes, weight_versions


def chain(S):
    return [(i, i + 1) for i in range(S - 1)]


@pytest.mark.parametrize("replicas", [(1, 1), (1, 1, 1, 1), (2, 1), (1, 2, 1)])
@pytest.mark.parametrize("M", [4, 8])
def test_one_update_per_batch_after_its_last_backward(replicas, M):
    lay, steps = Layout.of(replicas), 3
    sched = build_schedule("2bw", lay, M, chain(len(replicas)), steps=steps)
    validate(sched)
    for rank, actions in sched.items():
        compute = [a for a in actions if a.kind in (Kind.F, Kind.B, Kind.STEP)]
        updates = [i for i, a in enumerate(compute) if a.kind is Kind.STEP]
        assert len(updates) == steps
        for t, i in enumerate(updates):
            before = compute[i - 1]
            mine = [a.mb for a in compute if a.kind is Kind.B and a.mb // M == t]
            assert before.kind is Kind.B and before.mb == max(mine) == compute[i].mb


def test_no_drain_between_batches():
    """On the input stage the next batch's forwards run before this batch's last backward."""
    lay, M = Layout.of([1, 1, 1, 1]), 4
    acts = [a for a in build_schedule("2bw", lay, M, chain(4), steps=2)[0] if a.kind in (Kind.F, Kind.B)]
    first_next = acts.index(Action(Kind.F, M))
    last_this = acts.index(Action(Kind.B, M - 1))
    assert first_next < last_this


def test_validator_refuses_a_third_version_and_a_misplaced_backward():
    lay = Layout.of([1])
    # batch 2's forward before the update of batch 0: it would need version 1, not made yet
    bad = Schedule({0: [Action.parse(x) for x in "F0 F1 F4 B0 B1 STEP1 F2 F3 B2 B3 STEP3 B4 F5 B5 STEP5".split()]},
                   name="2bw", layout=lay, microbatches=2)
    with pytest.raises(ScheduleError, match="F4 .*batch 2.* before the update of batch 0"):
        validate(bad)
    # batch 1's backward before the update of batch 0: its gradient would join batch 0's
    bad = Schedule({0: [Action.parse(x) for x in "F0 F1 F2 B0 B2 B1 STEP1 F3 B3 STEP3".split()]},
                   name="2bw", layout=lay, microbatches=2)
    with pytest.raises(ScheduleError, match="B2 .*batch 1.* after 0 updates"):
        validate(bad)


def test_too_few_microbatches_for_two_versions_is_refused():
    with pytest.raises(ScheduleError, match="2bw: stage 0 keeps 4 microbatches in flight.*--microbatches >= 3"):
        build_schedule("2bw", Layout.of([1, 1, 1, 1]), 2, chain(4))
    with pytest.raises(ScheduleError, match="only 2bw builds several steps"):
        build_schedule("1f1b-flush", Layout.of([1, 1]), 4, chain(2), steps=2)


def test_simulated_steady_state_beats_flush_and_keeps_two_versions():
    S, M, steps = 4, 4, 6
    lay = Layout.of([1] * S)
    costs = [ActionCosts(1.0, 2.0, param_bytes=100, activation_bytes=1)] * S
    two = simulate(build_schedule("2bw", lay, M, chain(S), steps=steps), costs, lay)
    flush = simulate(build_schedule("1f1b-flush", lay, M, chain(S)), costs, lay)
    # no drain: steps x M microbatches take about that many 1F1B periods, not steps flushes
    assert two.step_s < steps * flush.step_s * 0.75
    assert two.steady_samples_per_s == pytest.approx(1 / 3.0)
    for j in range(S):  # two versions at most, activations as 1F1B's
        assert two.peak_memory[j] == 2 * 100 + (S - j)


def test_cost_model_counts_two_weight_versions_and_1f1b_activations():
    assert "2bw" in SCHEDULES
    opts = CostOptions(devices=4, schedule="2bw", microbatches=8)
    for j in range(4):
        assert weight_versions(j, [1] * 4, opts) == 2
        assert in_flight(j, [1] * 4, "2bw") == in_flight(j, [1] * 4, "1f1b-stash") == 4 - j
    # flush's window, uncapped (no drain): on 1-2-1 the input stage holds 5, whatever M is
    assert in_flight(0, [1, 2, 1], "2bw") == in_flight(0, [1, 2, 1], "1f1b-flush") == 5
    assert in_flight(0, [1, 2, 1], "2bw", 2) == 2 and in_flight(0, [1, 2, 1], "1f1b-flush", 2) == 2
    assert memory_bytes(100, 10, 0, [1] * 4, opts) == 100 * (2 + 1 + 1) + 10 * 4


@pytest.mark.parametrize("options,message", [
    ({"clip_grad_norm": 1.0}, "--clip-grad-norm is not supported with --schedule 2bw"),
    ({"precision": "fp16"}, "not 2bw; use --precision bf16 with 2bw"),
])
def test_what_2bw_does_not_support_is_refused_in_one_line(options, message):
    from fxpipe.runtime.loop import TrainConfig
    from passes.errors import FxpipeError

    with pytest.raises(FxpipeError, match=message):
        TrainConfig(schedule="2bw", **options)
