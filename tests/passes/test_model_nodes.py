"""The CP-SAT model's node-boundary charges on a two-level machine (``passes/partition/model_nodes.py``)."""
from __future__ import annotations

import pytest

from passes.partition.coarsen import build_units, model_nodes, to_nodes
from passes.partition.costmodel import allreduce_at, evaluate, flat_bound
from passes.partition.driver import _cp_sat
from passes.partition.model_nodes import crossing_coeffs
from tests.passes.test_partition import random_dag
from tests.passes.test_placed import _exact, _light_cuts, _opts


def _solved(g, opts, machine=None):
    units = build_units(g, opts, [[n] for n in model_nodes(g, opts)])
    fast = flat_bound(opts, fast=True)
    solved = _cp_sat(units, fast, machine=machine).solve(30)
    assert solved.status == "OPTIMAL"
    return solved, evaluate(g, to_nodes(g, units, solved.stage_of), solved.replicas, opts).bottleneck_s


@pytest.mark.parametrize("cost_model", ["fxpipe", "pipedream"])
@pytest.mark.parametrize("K,G", [(8, 2), (8, 4), (6, 3)])
@pytest.mark.parametrize("cuts", [1.0, 30.0])
def test_bound_holds_against_the_exact_placed_optimum(cost_model, K, G, cuts):
    """On small random graphs (activations as made, and 30 times heavier so that cuts decide) the
    model with the boundary charges is still a relaxation: its proven optimum never lies above the
    exact placed optimum (the downset DP), never below the flat B1 model's, and on some graphs above
    that (else the charges would be idle)."""
    tighter = 0
    for seed in range(4):
        g = _light_cuts(random_dag(9, seed), cuts)
        opts = _opts(K, G, cost_model=cost_model)
        best = _exact(g, opts)
        placed, scored = _solved(g, opts, machine=opts)
        flat, _ = _solved(g, opts)
        assert placed.bound <= best * (1 + 1e-9), (seed, placed.bound, best)
        assert scored >= best * (1 - 1e-9)
        assert placed.bound >= flat.bound * (1 - 1e-3)
        tighter += placed.bound > flat.bound * 1.01
    assert tighter


@pytest.mark.parametrize("cost_model", ["fxpipe", "pipedream"])
def test_crossing_charge_is_the_least_over_placements_that_cross(cost_model):
    """``crossing_coeffs``: for every count, no placement of it that touches two nodes or more is
    charged less, and one is charged exactly that."""
    K, G, P = 32, 4, 1e8
    opts = _opts(K, G, cost_model=cost_model)
    coeffs = crossing_coeffs(opts, range(1, K + 1))
    assert 1 not in coeffs and set(coeffs) == set(range(2, K + 1))
    for r, coeff in coeffs.items():
        charges = [r * allreduce_at(P, first, r, opts) / P for first in range(G)
                   if first // G != (first + r - 1) // G]
        assert min(charges) == pytest.approx(coeff, rel=1e-12)


def test_branchy_graph_on_two_nodes_planned_where_the_nodes_end():
    """inception_v3 (325 units, searched on every node) on 2 nodes of 4 under ``pow2``: the flat
    models' plans placed at 0.0980 s, 12 % over their bound (sum C / K); the model that charges the
    node boundary finds 0.0909 s (proven optimal here in 6-8 s; in a slow hour, 2026-12-04, at a 10-s
    limit three runs planned 0.0936, 0.0980 and 0.0909 s, at 20 s all proven optimal: 20 s)."""
    from passes.costgraph import CostGraph
    from passes.partition import partition
    from tests.profiles import PROFILES

    g = CostGraph.load(PROFILES / "inception_v3.txt")
    res = partition(g, 8, gpus_per_node=4, intra_bandwidth=1e10, bandwidth=1.25e9, replication="pow2",
                    time_limit=20)
    assert res.bottleneck_s <= 0.0920
    assert res.bound_s <= res.bottleneck_s
    assert "CP-SAT" in res.method
