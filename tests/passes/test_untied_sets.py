"""``ChainSolver._untied``: on a graph with a tied weight, the stages inside a segment that holds none
of its users (HF GPT-2's and Gemma's blocks: the tied embedding is read before them and after them)
are counted as untied stages, without the users' columns. The counts must be exactly those of the
full treatment (every pass's device count and plan), and with ``floor_counts`` never above them."""
from __future__ import annotations

import numpy as np
import pytest

from passes.partition import CostOptions, branches
from passes.partition.chain import ChainSolver
from passes.partition.segments import build_segments, folded_units
from tests.passes.test_partition_tied import tied_gpt2


def _segmented(graph, opts: CostOptions):
    """Units and segments as the segment DP's relaxation builds them: the attention mask's cone (read by
    every layer, so no cut between layers is a single value) free but its exit."""
    units, _ = folded_units(branches.relaxed(graph, branches.input_only_cones(graph, opts)), opts)
    segs = build_segments(units)
    assert segs is not None and units.shared  # the head and the embedding share a weight
    return units, segs


def _solver(graph, opts: CostOptions, floor_counts: bool, untied: bool, monkeypatch) -> ChainSolver:
    solver = ChainSolver(*_segmented(graph, opts), opts, floor_counts=floor_counts)
    if not untied:  # every set keeps its users' columns, as before ``_untied``
        monkeypatch.setattr(solver, "_untied", lambda seg: False)
    return solver


def _passes(solver: ChainSolver, ideal: float):
    return [solver.devices_needed(ideal * f) for f in (1.0, 1.1, 1.3, 1.7, 2.5)]


def test_blocks_hold_no_tied_weight_and_the_ends_do():
    """The segments between the embedding's and the head's hold no user: ``_untied``; the ones that
    hold a user do not qualify."""
    g = tied_gpt2()
    opts = CostOptions(devices=16, bandwidth=1.25e9)
    units, segs = _segmented(g, opts)
    solver = ChainSolver(units, segs, opts)
    flags = [solver._untied(seg) for seg in solver.segs]
    users = {u for _, us in units.shared.values() for u in us}
    holding = [bool(users & set(seg.units)) for seg in solver.segs]
    assert any(flags) and any(holding)
    for seg, flag, holds in zip(solver.segs, flags, holding):
        if holds:
            assert not flag
        elif seg.sub_j.size:  # a segment with stages inside it, none of them holding a user
            assert flag


CASES = [  # (cost model, replication, devices, tied replicas: ``1f1b-stash``'s common count)
    ("fxpipe", "any", 16, None), ("fxpipe", "any", 64, None), ("pipedream", "any", 32, None),
    ("fxpipe", "pow2", 64, None), ("fxpipe", "any", 32, 2), ("pipedream", "any", 16, 1),
]


@pytest.mark.parametrize("model,replication,K,tied", CASES)
def test_exact_counts_unchanged(model, replication, K, tied, monkeypatch):
    """Every pass (T from the work floor to 2.5x it) needs the same devices and back-pointers as with the
    users' columns kept."""
    g = tied_gpt2()
    opts = CostOptions(devices=K, bandwidth=1.25e9, cost_model=model, replication=replication, tied_replicas=tied)
    ideal = g.total_compute_s() / K
    fast = _passes(_solver(g, opts, False, True, monkeypatch), ideal)
    full = _passes(_solver(g, opts, False, False, monkeypatch), ideal)
    assert any(need <= K for need, _ in fast) and any(need > K for need, _ in fast)  # both sides tried
    for (need, back), (need0, back0) in zip(fast, full):
        assert need == need0
        assert np.array_equal(back, back0)


@pytest.mark.parametrize("K", [16, 64])
def test_floor_counts_never_above_the_exact_ones(K, monkeypatch):
    """With ``floor_counts`` the untied sets count ``replicas_floor`` (the graph's tie kept it from every
    stage before): a pass never needs more devices than the exact counts say, so an infeasible one is
    still a proof."""
    g = tied_gpt2()
    opts = CostOptions(devices=K, bandwidth=1.25e9)
    ideal = g.total_compute_s() / K
    floor = _passes(_solver(g, opts, True, True, monkeypatch), ideal)
    exact = _passes(_solver(g, opts, False, False, monkeypatch), ideal)
    assert all(n <= n0 for (n, _), (n0, _) in zip(floor, exact))
