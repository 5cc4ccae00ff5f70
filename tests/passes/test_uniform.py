"""The uniform PP x DP layouts (passes/partition/uniform.py): valid plans, cuts between blocks, and the
partitioner never answers slower than the best of them."""
from __future__ import annotations

import pytest

from passes.partition import CostOptions, evaluate, partition
from passes.partition.uniform import best_layout, layouts
from tests.passes.test_partition import random_dag
from tests.passes.test_partition_scale import transformer_graph


@pytest.mark.parametrize("seed", range(5))
def test_layouts_of_a_random_dag_put_every_edge_forward(seed):
    g = random_dag(12, seed)
    for assignment, _ in layouts(g, CostOptions(devices=4)):
        assert sorted(assignment) == sorted(g.nodes)
        assert all(assignment[u] <= assignment[v] for u, v in g.edges)


@pytest.mark.parametrize("K,replication", [(8, "any"), (16, "pow2"), (6, "none")])
def test_layouts_are_contiguous_convex_and_use_every_device(K, replication):
    g = transformer_graph(6, seed=1)
    opts = CostOptions(devices=K, replication=replication)
    order = g.order()
    seen = []
    for assignment, replicas in layouts(g, opts):
        stages = [assignment[n] for n in order]
        assert stages == sorted(stages) and set(stages) == set(range(len(replicas)))  # contiguous runs
        assert all(assignment[u] <= assignment[v] for u, v in g.edges)  # so every edge points forward
        assert sum(replicas) == K and len(set(replicas)) == 1 and replicas[0] in opts.allowed_replicas()
        seen.append(len(replicas))
    assert seen and all(K % pp == 0 for pp in seen)


def test_cuts_fall_between_blocks():
    """Cuts move to the fewest live bytes near their equal-compute point: between transformer blocks,
    where only the residual stream crosses, as a person splitting blocks evenly would cut."""
    g = transformer_graph(8, seed=3)
    opts = CostOptions(devices=4, replication="none")
    (assignment, replicas), = list(layouts(g, opts))
    ev = evaluate(g, assignment, replicas, opts)
    residual = min(b for b in ev.cut_bytes)
    assert len(replicas) == 4 and all(b == residual for b in ev.cut_bytes)


def test_partition_never_slower_than_the_best_uniform_layout():
    """Cut short by a tiny time limit on a deep model, the search still answers at least as well as the
    best uniform layout, with the search's own bound below it."""
    g = transformer_graph(24, seed=5)
    for K, extra in ((64, {}), (64, dict(gpus_per_node=8, intra_bandwidth=1e11, bandwidth=1.25e10,
                                         cost_model="pipedream"))):
        res = partition(g, K, time_limit=0.3, **extra)
        ev, _, _ = best_layout(g, res.options)
        assert res.bottleneck_s <= ev.bottleneck_s * (1 + 1e-12)
        assert res.bound_s <= res.bottleneck_s
        assert res.bottleneck_s == pytest.approx(
            evaluate(g, res.assignment, res.replicas, res.options).bottleneck_s, rel=1e-12)


def test_bracket_before_the_charged_dp_holds_the_uniform_layout(monkeypatch):
    """Before the charged DP the bracket's plan is its ceiling: the uniform layout is one of its
    candidates, so even a bracket whose flat search found nothing in time (here: none at all) hands the
    charged DP a plan to prove, with the bound it was given."""
    import time

    from passes.partition import driver

    g = transformer_graph(8, seed=2)
    opts = CostOptions(devices=32, gpus_per_node=8, intra_bandwidth=1e11, bandwidth=1.25e10, replication="pow2")
    ev, assignment, replicas = best_layout(g, opts)
    monkeypatch.setattr(driver, "chain_plan", lambda *a, **k: None)
    now = time.monotonic()
    bracket = driver._bracketed(g, opts, now, now + 5.0, plain=True, floor=1e-6, before_charged=True)
    assert bracket is not None and bracket.method == "uniform layout"
    assert bracket.assignment == assignment and bracket.replicas == list(replicas)
    assert bracket.bottleneck_s == pytest.approx(ev.bottleneck_s, rel=1e-12) and bracket.bound_s == 1e-6
    assert driver._bracketed(g, opts, now, now + 5.0, plain=True, floor=1e-6) is None  # not asked for: none
