"""Shape reads that send nothing, folded at any cost for the placed DPs (``Units.bridged``): each is
charged to every stage that holds a unit before it and one after it, and a plan may run it in any
stage in between (``segment_plan.silent_moves``). Checked against the exact placed optimum on the
unfolded graph (the downset DP): the bound stays under it, the plan is scored as ``evaluate`` scores
it, and the charge counts what dropping the compute left out."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from passes.costgraph import CostGraph
from passes.partition import evaluate, is_convex
from passes.partition import segment_plan
from passes.partition.segment_plan import chain_plan, silent_moves, silent_nodes
from passes.partition.segments import build_segments, folded_units
from tests.passes.test_partition_scale import _node
from tests.passes.test_placed import _exact, _opts, _shape_reads


def _members(seg, units, x: int) -> set:
    return set(range(seg.units[0])) | {u for k, u in enumerate(seg.units) if seg.member[x, k]}


def test_start_holds_what_a_downset_may_leave_behind():
    """``Segment.compute`` counts a bridged node once the downset holds its later unit (then it holds
    the node in every plan), ``Segment.start`` once it holds its earlier one (it may hold the node):
    a stage (j, i) runs at least ``compute[i] - start[j]``."""
    g = _shape_reads(0.05, 16)
    opts = _opts(16, 4)
    units, _ = folded_units(g, opts, tiny_silent=math.inf, bridge=True)
    assert len(units.bridged) == 7  # the block's own shape read and the six added ones
    assert all(before < after for _, before, after, _ in units.bridged)
    for seg in build_segments(units):
        for x in range(len(seg.compute)):
            inside = _members(seg, units, x)
            plain = sum(units.compute[u] for u in inside)
            ends = sum(s for s, _, after, _ in units.bridged if after in inside)
            starts = sum(s for s, before, _, _ in units.bridged if before in inside)
            assert seg.compute[x] == pytest.approx(plain + ends, rel=1e-12, abs=1e-15)
            assert seg.start[x] == pytest.approx(plain + starts, rel=1e-12, abs=1e-15)


def test_without_bridging_start_is_compute():
    units, _ = folded_units(_shape_reads(0.05, 16), _opts(16, 4), tiny_silent=math.inf)
    assert not units.bridged
    assert all(seg.start is seg.compute for seg in build_segments(units))


CASES = [("fxpipe", "any", 16, 4), ("fxpipe", "pow2", 16, 4), ("pipedream", "any", 16, 4),
         ("fxpipe", "pow2", 8, 2), ("pipedream", "pow2", 8, 4), ("fxpipe", "pow2", 64, 8),
         ("pipedream", "pow2", 32, 8)]


@pytest.mark.parametrize("share", [0.02, 0.1, 0.3])
@pytest.mark.parametrize("model,replication,K,G", CASES)
@pytest.mark.parametrize("reads", ["spanning", "adjacent"])
def test_bound_under_the_exact_optimum_with_every_shape_read_folded(reads, model, replication, K, G, share):
    """Each shape read costs ``share`` of sum C / K, folded whatever it costs (``quiet``): the placed
    DP's bound (interval or charged) is never above the optimum over every placement of the unfolded
    graph, and its plan scores as ``evaluate`` scores it. The reads span the fused q/k/v unit
    (``spanning``: a stage of it alone lies between a read's two units) or not (``adjacent``)."""
    g = (_shape_reads if reads == "spanning" else _adjacent_reads)(share, K)
    opts = _opts(K, G, cost_model=model, replication=replication)
    res = chain_plan(g, opts, time.monotonic(), math.inf, quiet=1e9)
    assert res is not None
    best = _exact(g, opts, upper=res.bottleneck_s)
    assert res.bound_s <= best * (1 + 1e-9) and best <= res.bottleneck_s * (1 + 1e-9)
    assert res.bottleneck_s == pytest.approx(evaluate(g, res.assignment, res.replicas, opts).bottleneck_s,
                                             rel=1e-12)
    assert sum(res.replicas) == K and is_convex(g, res.assignment)


def _adjacent_reads(share: float, K: int) -> CostGraph:
    """One untied transformer block with six reads of the fused q/k/v output, each costing ``share`` of
    sum C / K, sending nothing, read by q, k or v (which read that output too): no unit lies between a
    read's producer and its reader, so every stage holding one holds the other or neither."""
    from tests.passes.test_partition_scale import transformer_graph

    g = transformer_graph(1, seed=0, tied=False)
    ideal = g.total_compute_s() / K
    nodes, edges = dict(g.nodes), list(g.edges)
    for i, reader in enumerate("qkvqkv"):
        name = f"b0_read{i}"
        nodes[name] = _node(name, cost=share * ideal, out=0, path="blocks.0")
        edges += [("b0_qkv", name), (name, "b0_" + reader)]
    return CostGraph(nodes=nodes, edges=edges, param_sizes=dict(g.param_sizes))


@pytest.mark.parametrize("model,K,G,share,gain", [("pipedream", 32, 8, 0.1, 1.015), ("fxpipe", 8, 4, 0.03, 1.005)])
def test_bridged_compute_raises_the_bound_over_dropping_it(monkeypatch, model, K, G, share, gain):
    """The same search with the reads' compute dropped (no ``bridge``) proves less: the charge is what
    lifts the bound (by ``gain`` here), and it stays under the optimum, which the plan reaches."""
    g = _adjacent_reads(share, K)
    opts = _opts(K, G, cost_model=model, replication="pow2")
    start = time.monotonic()
    bridged = chain_plan(g, opts, start, math.inf, quiet=1e9, bound_only=True, plain=True)
    real = segment_plan.folded_units
    monkeypatch.setattr(segment_plan, "folded_units", lambda *a, **kw: real(*a, **{**kw, "bridge": False}))
    dropped = chain_plan(g, opts, start, math.inf, quiet=1e9, bound_only=True, plain=True)
    best = _exact(g, opts)
    assert bridged.bound_s >= dropped.bound_s * gain
    assert bridged.bound_s <= best * (1 + 1e-9)
    res = chain_plan(g, opts, start, math.inf, quiet=1e9)
    assert res.bound_s <= best * (1 + 1e-9) and best <= res.bottleneck_s * (1 + 1e-9)


def _three_nodes() -> CostGraph:
    """a -> n -> b and a -> b; n sends nothing (a shape read) and costs as much as a."""
    nodes = {"a": _node("a", cost=1.0), "n": _node("n", cost=1.0, out=0), "b": _node("b", cost=0.5)}
    out = _node("out", op="output", cost=0.0, out=0)
    nodes["out"] = out
    return CostGraph(nodes=nodes, edges=[("a", "n"), ("a", "b"), ("n", "b"), ("b", "out")], param_sizes={})


def test_silent_moves_put_a_shape_read_where_there_is_room():
    """Folded with its producer, the read makes the first stage the bottleneck; it may run in its
    reader's stage instead, which has room: moved there, the plan is faster and still convex."""
    g = _three_nodes()
    opts = _opts(2, 1)
    plan = {"a": 0, "n": 0, "b": 1, "out": 1}
    ev = evaluate(g, plan, [1, 1], opts)
    better, moved = silent_moves(g, plan, [1, 1], ev, opts)
    assert moved["n"] == 1 and is_convex(g, moved)
    assert better.bottleneck_s == pytest.approx(1.5) and ev.bottleneck_s == pytest.approx(2.0)
    # nothing to gain: left as it was
    again, same = silent_moves(g, moved, [1, 1], better, opts)
    assert same == moved and again is better
    assert np.isfinite(better.bottleneck_s)
    # the nodes worked out once for every plan of the graph (``silent_nodes``) move the same
    assert silent_nodes(g, opts)[1] == ["n"]
    assert silent_moves(g, plan, [1, 1], ev, opts, silent_nodes(g, opts))[1] == moved


def test_straddling_sum_does_not_depend_on_the_order_of_the_nodes():
    """Equal blocks list their bridged nodes in different orders where reads cross block boundaries;
    a sum that rounded in list order made equal segments compare unequal, and the DP's rows of
    repeated blocks were no longer shared (96 blocks: a pass 0.4 -> 3.5 s)."""
    from passes.partition.coarsen import Units
    from passes.partition.segments import straddling

    values = [0.1e-6, 0.2e-6, 0.3e-6, 1e-9, 7e-7]
    units = Units(members=[], compute=[], param_bytes=[], act_bytes=[], has_compute=[], is_input=[],
                  is_output=[], edges=[], producers=[])
    sums = set()
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        units.bridged = [(values[k], 0, 5, 0) for k in order]
        sums.add(straddling(units, 3))
    assert len(sums) == 1


def test_repeated_blocks_of_the_bundled_profile_share_segment_ids():
    """On the bundled CPU profile of the benchmark GPT, folded for a placed DP with every shape read
    bridged, the segments of repeated blocks compare equal: the distinct ids do not grow with depth."""
    from passes.partition.chain import ChainSolver
    from passes.partition.costmodel import CostOptions, flat_bound
    from tools.bench.partition_scale import deep_gpt

    distinct = []
    for depth in (8, 24):
        g = deep_gpt(depth)
        opts = flat_bound(CostOptions(devices=1024, gpus_per_node=8, intra_bandwidth=1e11, bandwidth=1.25e10,
                                      cost_model="pipedream"), fast=True)
        ideal = g.total_compute_s() / 1024
        units, _ = folded_units(g, opts, tiny=1e-5 * ideal, tiny_silent=math.inf, bridge=True)
        assert units.bridged
        units.hidden = []  # as ``segment_dp`` leaves them for a placed DP (the solver refuses both)
        distinct.append(len(set(ChainSolver(units, build_segments(units), opts)._segment_ids())))
    assert distinct[0] == distinct[1] <= 8


def test_a_solver_refuses_bridged_and_hidden_compute_together():
    """``ChainSolver._late`` reads one compute per point as a prefix's room; with bridged nodes a point
    has two, so units holding both kinds are refused with a message that says what to do."""
    from passes.partition.chain import ChainSolver

    units, _ = folded_units(_shape_reads(0.05, 16), _opts(16, 4), tiny_silent=math.inf, bridge=True)
    units.hidden = units.hidden or [(1e-6, [0], -1, [])]
    with pytest.raises(ValueError, match="clear hidden"):
        ChainSolver(units, build_segments(units), _opts(16, 4))
