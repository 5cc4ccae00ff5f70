"""Segment construction at the graph's end: an output unit without compute after a wide block.

torchvision's inception_v3 in training mode ends in a branchy block, a namedtuple of the two heads and
the graph's output; the segment holding the output alone added no point, started a group of its own
after a block of more than 64 points, and dropped its one point (``fxpipe plan`` died with an
IndexError). Checked here on a small graph of that shape, against brute force.
"""
from __future__ import annotations

import pytest

from passes.costgraph import CostGraph, CostNode
from passes.partition import CostOptions, partition
from passes.partition.segments import build_segments, folded_units
from tests.passes.test_partition import B, BAR, brute_force, reference_cost

WIDE = 7  # parallel nodes: 2^7 downsets in the last block, past the 64 points a group gathers


def _node(name: str, cost: float, out: int, pbytes: int = 0, op: str = "call_function",
          is_input: bool = False) -> CostNode:
    return CostNode(name=name, op=op, target=name, fwd_s=cost / 3, bwd_s=2 * cost / 3, out_bytes=out,
                    param_bytes=pbytes, is_input=is_input)


def wide_end_graph() -> CostGraph:
    """x -> a -> b -> WIDE parallel nodes -> join -> heads (a tuple of two values) -> output."""
    nodes = {"x": _node("x", 0.0, 10**5, op="placeholder", is_input=True),
             "a": _node("a", 4e-3, 10**5, pbytes=10**5), "b": _node("b", 3e-3, 10**5, pbytes=10**5)}
    edges = [("x", "a"), ("a", "b")]
    for k in range(WIDE):
        nodes[f"w{k}"] = _node(f"w{k}", 1e-3 * (1 + k % 3), 10**4, pbytes=10**4)
        edges += [("b", f"w{k}"), (f"w{k}", "join")]
    nodes["join"] = _node("join", 2e-4, 10**4)
    nodes["aux"] = _node("aux", 1e-3, 100, pbytes=10**3)
    nodes["heads"] = _node("heads", 1e-6, 200)
    nodes["output"] = _node("output", 0.0, 0, op="output")
    edges += [("b", "aux"), ("join", "heads"), ("aux", "heads"), ("heads", "output")]
    return CostGraph(nodes=nodes, edges=edges)


def test_an_output_segment_without_compute_keeps_its_point() -> None:
    units, _ = folded_units(wide_end_graph(), CostOptions(devices=2))
    assert not units.has_compute[-1] and units.is_output[-1]  # the shape that failed
    segments = build_segments(units)
    assert all(len(seg.compute) for seg in segments)
    assert set(segments[-1].units) >= {len(units) - 1}


@pytest.mark.parametrize("K", [2, 3, 4])
def test_plans_a_graph_ending_in_a_wide_block(K: int) -> None:
    g = wide_end_graph()
    res = partition(g, K, bandwidth=B, allreduce_bandwidth=BAR, time_limit=10)
    best = brute_force(g, K, "fxpipe", range(1, K + 1))
    assert res.bottleneck_s == pytest.approx(reference_cost(g, res.assignment, res.replicas, "fxpipe"), rel=1e-9)
    assert best * (1 - 1e-9) <= res.bottleneck_s <= best * 1.001
    assert res.bound_s <= best * (1 + 1e-9)
