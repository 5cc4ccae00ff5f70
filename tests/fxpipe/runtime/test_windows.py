"""A ``1f1b-stash`` or ``2bw`` run is one action list over all its steps; the worker makes it and runs it a
window of steps at a time (``loop.windows``), so a long run holds a window, not the run. Cutting the list
must change nothing: the same weights and losses, bit for bit, for windows of one step as for one window.
"""
from __future__ import annotations

import pytest
import torch

from fxpipe.actions import Kind
from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig, windows
from fxpipe.schedule import build_schedule, rank_actions
from tests.fxpipe.runtime import cases, fakes
from tests.fxpipe.runtime.harness import spawn


@pytest.mark.parametrize("schedule,extra", [("1f1b-stash", {}), ("2bw", {"steps": 7})])
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_pieces_are_the_list_cut_after_the_update_that_closes_a_step(schedule, extra, steps):
    layout, links, M = Layout.of((2, 1, 1)), [(0, 1), (1, 2), (0, 2)], 4
    count = 7 * M if schedule == "1f1b-stash" else M
    whole = build_schedule(schedule, layout, count, links, tied_stages=[0, 2] if schedule == "2bw" else (), **extra)
    for rank in range(layout.world_size):
        stream = rank_actions(schedule, layout, count, links, rank, [0, 2] if schedule == "2bw" else (), **extra)
        pieces = list(windows(stream, M, steps))
        assert [a for piece, _ in pieces for a in piece] == whole[rank]
        assert [last for _, last in pieces] == [False] * (len(pieces) - 1) + [True]
        assert len(pieces) == -(-7 // steps)
        for k, (piece, last) in enumerate(pieces):
            closed = {a.mb // M for a in piece if a.kind is Kind.STEP}
            assert closed <= set(range(k * steps, (k + 1) * steps))  # each step's updates in one piece
            if not last:
                assert piece[-1].kind is Kind.STEP


CASES = [("1f1b-stash", "chain2", (2, 1)), ("2bw", "chain2", (2, 1)), ("1f1b-stash", "tied", (1, 1)),
         ("2bw", "chain4", (1, 1, 1, 1))]


@pytest.mark.parametrize("schedule,name,replicas", CASES)
def test_a_run_in_windows_of_one_step_equals_one_window(schedule, name, replicas) -> None:
    def run(window: int) -> list:
        cfg = TrainConfig(log=False, schedule=schedule, microbatches=4, steps=5, optimizer="sgd", lr=0.1,
                          momentum=0.9, window_steps=window).to_json()
        return spawn(cases.train_case, sum(replicas), (name, replicas, cfg)).ok()

    one, cut = run(32), run(1)
    for a, b in zip(one, cut):
        assert a["stage"] == b["stage"] and a["losses"] == b["losses"]
        assert a["state"].keys() == b["state"].keys()
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]), schedule
    trained, start = cases.merged_state(name, one), fakes.MODELS[name]()[0].state_dict()
    assert trained.keys() == start.keys() and all(not torch.equal(trained[k], start[k]) for k in start)
    assert len(one[-1]["losses"]) == 5
