"""Freed compute a stage must run itself (``passes/partition/pins.py``): a freed node whose producer and
reader are both in a stage runs there, not in the slack of a stage before its producer."""
from __future__ import annotations

import dataclasses
import math

import pytest

from passes.costgraph import CostGraph, CostNode
from passes.partition import CostOptions, branches, segment_plan
from tests.passes.test_partition import B, BAR, brute_force


def _node(name, cost, out, pbytes=0, op="call_function", is_input=False):
    return CostNode(name=name, op=op, target=name, fwd_s=cost / 3, bwd_s=2 * cost / 3, out_bytes=out,
                    param_bytes=pbytes, is_input=is_input)


def sandwich() -> CostGraph:
    """``x -> a -> b -> f -> c -> output``: ``f`` (3 ms, no weights) between ``b`` (2 ms) and ``c`` (1 ms),
    ``a`` (4 ms) before them; weights heavy enough that no stage pays for a replica. On 2 devices the
    optimum is 6 ms ([a] [b f c] or [a b] [f c])."""
    spec = [("x", _node("x", 0.0, 10**3, op="placeholder", is_input=True)),
            ("a", _node("a", 4e-3, 10**3, 10**9)), ("b", _node("b", 2e-3, 10**3, 10**9)), ("f", _node("f", 3e-3, 10**3)),
            ("c", _node("c", 1e-3, 10**3, 10**9)), ("output", _node("output", 0.0, 0, op="output"))]
    names = [n for n, _ in spec]
    return CostGraph(nodes=dict(spec), edges=list(zip(names, names[1:])))


def _relaxed_bound(g: CostGraph, opts: CostOptions, hidden) -> float:
    """The segment DP's bound on ``g`` with ``f`` free of compute (still sending), its compute given back
    as ``hidden`` gives it."""
    nodes = {n: dataclasses.replace(node, fwd_s=0.0, bwd_s=0.0) if n == "f" else node for n, node in g.nodes.items()}
    free = CostGraph(nodes=nodes, edges=list(g.edges))
    _, found, margin = segment_plan.segment_dp(free, opts, math.inf, hidden=hidden)
    return found.bound - margin


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
def test_pinned_compute_stays_in_its_stage(model):
    g = sandwich()
    opts = CostOptions(devices=2, bandwidth=B, allreduce_bandwidth=BAR, cost_model=model)
    best = brute_force(g, 2, model, range(1, 3))
    assert best == pytest.approx(6e-3, rel=1e-6)
    pinned = _relaxed_bound(g, opts, lambda units: branches.forced_compute(g, units, ["f"]))
    assert best * 0.999 <= pinned <= best * (1 + 1e-9)
    # without the units ``f`` runs after, its compute fills the 1 ms ``a``'s stage leaves (a stage that
    # cannot hold it: ``a`` runs before ``b``, ``f``'s producer)
    loose = _relaxed_bound(g, opts, lambda units: [(s, forcing, home, [])
                                                   for s, forcing, home, _ in branches.forced_compute(g, units, ["f"])])
    assert loose <= 5.05e-3 < pinned


def test_units_a_freed_node_runs_after_are_its_nearest_first_nodes():
    """``heads_above``: through nodes that head no unit, up to the first ones that do."""
    g = sandwich()
    heads = {"a": 0, "c": 2}  # ``b`` heads no unit here: the walk goes on to ``a``
    above = branches.heads_above(g, heads)
    assert above["f"] == {0} and above["c"] == {0} and above["a"] == frozenset()
    assert branches.heads_above(g, {"a": 0, "b": 1, "c": 2})["f"] == {1}
