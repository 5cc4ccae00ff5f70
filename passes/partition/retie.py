"""Plans that pay for a tied weight's real sync, for the segment DP.

While it searches, the DP charges a weight that two stages hold (GPT's
embedding and output projection) ``tied_floor_s`` over the stage and the
replicas the weight's other users need on their own at the bottleneck T
(``costmodel.partner_replicas``). That keeps its bound a bound and closes it
where the other user's stage holds little more than that user, but the plan
found at T may give the partner stage more (it holds more compute, or is
padded), and ``evaluate`` charges that larger group in full (the test suite's
synthetic 6-block GPT at K=64 under the PipeDream model: the DP's plan 2 %
above its bound, the re-searched one 0.2 %).

``recharged`` searches again with the tied weights made heavier by the
largest ratio of real to floor (one partner rank) sync in the plan so far, so
the plan it finds leaves room for that sync; every plan is scored on the real
graph, the best kept. Only plans change: the bound still comes from the DP.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

from passes.costgraph import CostGraph
from passes.partition.costmodel import CostOptions, StagePlan, allreduce_s, evaluate, tied_floor_s
from passes.partition.memory_guard import past

Plan = Tuple[Dict[str, int], List[int]]  # node -> stage, replicas per stage


def excess(stages: List[StagePlan], opts: CostOptions) -> float:
    """Largest ratio of a stage's tied-weight sync (as ``evaluate`` charges it) to ``tied_floor_s``; 1 if none."""
    worst = 1.0
    for s in stages:
        if s.tied_bytes:
            floor = float(tied_floor_s(s.tied_bytes, s.replicas, opts))
            real = s.allreduce_s - allreduce_s(s.param_bytes - s.tied_bytes, s.replicas, opts)
            if floor > 0:
                worst = max(worst, real / floor)
    return worst


def recharged(graph: CostGraph, opts: CostOptions, best_s: float, stages: List[StagePlan],
              search: Callable[[CostGraph], Optional[Plan]], good_enough: float, deadline: float,
              rounds: int = 3):
    """(plan, evaluation) of the fastest plan found by ``search`` on ``graph`` with its tied weights
    made heavier (see the module docstring) if it beats ``best_s``; stops once a plan scores at most
    ``good_enough`` seconds, after ``rounds`` searches, or at the deadline. None if none does."""
    users: Dict[str, int] = {}
    for node in graph.nodes.values():
        for p in node.params:
            users[p] = users.get(p, 0) + 1
    tied = {p for p, count in users.items() if count > 1}
    scale, found = 1.0, None
    for _ in range(rounds):
        if best_s <= good_enough or past(deadline):
            break
        ratio = excess(stages, opts)
        if ratio <= scale * (1 + 1e-9):
            break
        scale = ratio
        heavier = dataclasses.replace(graph, param_sizes={p: int(b * scale) if p in tied else b
                                                          for p, b in graph.param_sizes.items()})
        plan = search(heavier)
        if plan is None:
            break
        ev = evaluate(graph, plan[0], plan[1], opts)
        if ev.bottleneck_s < best_s:
            best_s, stages, found = ev.bottleneck_s, ev.stages, (plan, ev)
    return found
