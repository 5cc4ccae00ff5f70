"""The order DP with contiguous placement on a two-level machine (``order_placed``)."""
from __future__ import annotations

import dataclasses

import pytest

from passes.costgraph import CostGraph
from passes.partition import driver, heuristic, order_placed
from passes.partition.coarsen import build_units, model_nodes, to_nodes
from passes.partition.costmodel import CostOptions, evaluate
from tests.profiles import PROFILES


def _setup(name: str, K: int, model: str, **kw):
    g = CostGraph.load(PROFILES / f"{name}.txt")
    opts = CostOptions(devices=K, cost_model=model, bandwidth=1.25e9, gpus_per_node=8, intra_bandwidth=1e10, **kw)
    return g, opts, build_units(g, opts, [[n] for n in model_nodes(g, opts)])


@pytest.mark.parametrize("name", ["gnmt", "vgg16", "alexnet"])
@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
@pytest.mark.parametrize("K", [16, 64])
@pytest.mark.parametrize("replication", ["any", "pow2"])
def test_its_objective_is_never_below_the_plans_real_time(name, model, K, replication):
    """Every cut is charged at the slower bandwidth, the all-reduce exactly where the ranks sit: the
    plan, scored placed by ``evaluate``, is never slower than the DP said."""
    g, opts, units = _setup(name, K, model, replication=replication)
    plan = order_placed.best_placed_order(units, opts)
    assert plan is not None and sum(plan.replicas) == K
    assert set(plan.replicas) <= set(opts.allowed_replicas())
    real = evaluate(g, to_nodes(g, units, plan.stage_of), plan.replicas, opts).bottleneck_s
    assert real <= plan.objective * (1 + 1e-12)


def test_with_one_bandwidth_it_is_the_flat_order_dp():
    """B1 = B2 under fxpipe's charges: placement changes nothing, so the table is the flat one's."""
    g, opts, units = _setup("gnmt", 32, "fxpipe")
    same = dataclasses.replace(opts, intra_bandwidth=opts.bandwidth)
    flat = dataclasses.replace(opts, gpus_per_node=None, intra_bandwidth=None)
    for order in heuristic.topo_orders(units):
        placed, plain = order_placed.placed_order_dp(units, same, order), heuristic.order_dp(units, flat, order)
        assert placed.objective == pytest.approx(plain.objective, rel=1e-12)


def test_large_tables_are_left_out():
    _, opts, units = _setup("gnmt_large", 64, "fxpipe")
    assert order_placed.fits(units, opts)
    assert order_placed.fits(units, dataclasses.replace(opts, devices=256))
    assert not order_placed.fits(units, dataclasses.replace(opts, devices=1024))


def test_gnmt_on_eight_nodes_of_eight_is_proven(monkeypatch):
    """CP-SAT, blind to placement, read 0.00-32.6 % open here by the run; the placed order DP's plan
    meets the bound. CP-SAT is left out so that the test does not hang on its luck."""
    monkeypatch.setattr(driver, "_placed_cpsat", lambda *a, **k: (_ for _ in ()).throw(driver.InfeasibleError("x")))
    g = CostGraph.load(PROFILES / "gnmt.txt")
    res = driver.partition(g, 64, bandwidth=1.25e9, intra_bandwidth=1e10, gpus_per_node=8, time_limit=10)
    assert res.status == "OPTIMAL" and res.method.startswith("order DP, placed")
    assert res.bottleneck_s == pytest.approx(evaluate(g, res.assignment, res.replicas, res.options).bottleneck_s,
                                             rel=1e-12)
