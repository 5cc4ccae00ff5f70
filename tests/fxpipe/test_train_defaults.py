"""``fxpipe train``'s microbatches when none are asked for: the planner's default, or the reused split's."""
from __future__ import annotations

from pathlib import Path

from fxpipe.trainer import _default_microbatches
from passes.costgraph import CostGraph, CostNode
from passes.partition.costmodel import default_microbatches
from tests.plans import synthetic_plan


def _two_stage_graph() -> CostGraph:
    nodes = [CostNode("x", "placeholder", "x", 0.0, 0.0, 8, 0, is_input=True),
             CostNode("a", "call_function", "f", 1.0, 2.0, 100, 10),
             CostNode("b", "call_function", "f", 1.0, 2.0, 100, 10)]
    return CostGraph({n.name: n for n in nodes}, [("x", "a"), ("a", "b")])


def test_devices_given_trains_with_what_the_planner_plans_for():
    assert _default_microbatches(2, "1f1b-flush", None, None) == 8 == default_microbatches(2, "1f1b-flush")
    assert _default_microbatches(3, "1f1b-stash", None, None) == 12
    # gpipe holds all M microbatches: with a memory limit the planner keeps M = devices, and so does train
    assert _default_microbatches(4, "gpipe", None, 2**30) == 4


def test_a_reused_split_trains_with_the_microbatches_it_was_planned_for(tmp_path: Path):
    g = _two_stage_graph()
    plan = synthetic_plan(g, {"x": 0, "a": 0, "b": 1}, [1, 2], microbatches=6)
    plan.save(tmp_path / "plan.json")
    assert _default_microbatches(None, "1f1b-flush", str(tmp_path), None) == 6
    # --devices beside --split: the count asked for wins
    assert _default_microbatches(3, "1f1b-flush", str(tmp_path), None) == 12
