"""The uniform PP x DP layouts (passes/partition/uniform.py): valid plans, cuts between blocks, and the
partitioner never answers slower than the best of them."""
from __future__ import annotations

import pytest

from passes.costgraph import CostGraph
from passes.partition import CostOptions, evaluate, partition
from passes.partition.uniform import best_layout, layouts
from tests.passes.test_partition import random_dag
from tests.passes.test_partition_scale import _node, transformer_graph


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
    found = list(layouts(g, opts))
    assert found
    for assignment, replicas in found:
        ev = evaluate(g, assignment, replicas, opts)
        residual = min(b for b in ev.cut_bytes)
        assert len(replicas) == 4 and all(b == residual for b in ev.cut_bytes)


def test_a_heavy_first_layer_does_not_push_a_block_onto_a_later_stage():
    """16 equal blocks (a wide value inside each, the narrow residual between them) after an embedding
    worth 0.7 of a block, on 4 stages: the cut nearest the first equal-compute point (4.175 blocks'
    worth) leaves the first stage 3 blocks and the embedding, and the rest then spread 13 blocks
    over 3 stages, one of them 5. Cutting at block boundaries with the least heaviest stage gives 4
    blocks to each (the embedding with the first), as a person would by hand; the best layout is
    that one."""
    nodes = [_node("x", op="placeholder", cost=0, out=8, is_input=True), _node("emb", cost=0.7e-3, out=100)]
    edges, prev = [("x", "emb")], "emb"
    for b in range(16):
        nodes += [_node(f"b{b}_in", cost=0.5e-3, out=10_000), _node(f"b{b}_out", cost=0.5e-3, out=100)]
        edges += [(prev, f"b{b}_in"), (f"b{b}_in", f"b{b}_out")]
        prev = f"b{b}_out"
    g = CostGraph(nodes={n.name: n for n in nodes}, edges=edges)
    opts = CostOptions(devices=4, replication="none", bandwidth=1e15)
    ev, assignment, _ = best_layout(g, opts)
    per_stage = [sum(1 for b in range(16) if assignment[f"b{b}_out"] == s) for s in range(4)]
    assert per_stage == [4, 4, 4, 4] and ev.bottleneck_s == pytest.approx(4.7e-3)
    heaviest = [evaluate(g, a, r, opts).bottleneck_s for a, r in layouts(g, opts)]
    assert heaviest == pytest.approx([5e-3, 4.7e-3])  # the equal-compute cuts alone miss it


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
    hand = best_layout(g, opts)
    bracket = driver._bracketed(g, opts, now, now + 5.0, plain=True, floor=1e-6, hand=hand)
    assert bracket is not None and bracket.method == "uniform layout, segment DP bound"
    assert bracket.assignment == assignment and bracket.replicas == list(replicas)
    assert bracket.bottleneck_s == pytest.approx(ev.bottleneck_s, rel=1e-12) and bracket.bound_s == 1e-6
    assert driver._bracketed(g, opts, now, now + 5.0, plain=True, floor=1e-6) is None  # not asked for: none


def test_no_plan_in_the_time_falls_back_to_the_uniform_layout(monkeypatch):
    """Where no search finishes a plan within the limit (on the bench's 32-block GPT, K=1024 under
    PipeDream's charges, one pass of the floor DP took longer than the 10 s), the answer is the best
    uniform layout, HEURISTIC, bounded by sum C / K, not an error; where no uniform layout fits the
    memory limit either, the search's error stands."""
    from passes.partition import driver
    from passes.partition.result import InfeasibleError

    def no_plan(*args, **kwargs):
        raise InfeasibleError("partition: no plan found in 10s; raise --time-limit")

    monkeypatch.setattr(driver, "_searched_plan", no_plan)
    g = transformer_graph(8, seed=4)
    res = partition(g, 16, time_limit=1, gpus_per_node=8, intra_bandwidth=1e11, bandwidth=1.25e10)
    ev, assignment, replicas = best_layout(g, res.options)
    assert res.status == "HEURISTIC" and res.assignment == assignment and res.replicas == replicas
    assert res.bottleneck_s == ev.bottleneck_s
    assert res.bound_s == pytest.approx(sum(n.compute_s for n in g.nodes.values()) / 16)
    with pytest.raises(InfeasibleError, match="no plan found"):
        partition(g, 16, time_limit=1, memory=1)
