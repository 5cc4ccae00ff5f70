"""``polish.py``: a plan's boundaries searched again on single nodes, against ``evaluate`` and brute force."""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Sequence

import pytest

from passes.costgraph import CostGraph, CostNode
from passes.partition import evaluate, is_convex
from passes.partition import polish
from passes.partition.costmodel import CostOptions, tied_weights
from passes.partition.result import PartitionResult
from passes.partition.topology import stage_ranks
from tests.passes.test_partition import random_dag


def _random_plan(g: CostGraph, S: int, rng: random.Random):
    """A convex plan of ``S`` stages, each running a node that is neither input nor output: stage
    boundaries at random places of a topological order."""
    order = list(g.nodes)  # the test graphs' names are in a topological order
    work = [i for i, n in enumerate(order) if not g.nodes[n].is_input and g.nodes[n].op != "output"]
    cuts = sorted(rng.sample(work[1:], S - 1))
    return {n: sum(i >= c for c in cuts) for i, n in enumerate(order)}


def _opts(K: int, model: str, two_level: bool, bandwidth: float) -> CostOptions:
    if two_level:
        return CostOptions(devices=K, cost_model=model, gpus_per_node=2, intra_bandwidth=8 * bandwidth,
                           bandwidth=bandwidth)
    return CostOptions(devices=K, cost_model=model, bandwidth=bandwidth)


def _cases(count: int):
    """Random DAGs and plans, both cost models, flat and on nodes of two, links slow enough to be the
    bottleneck in about half of them (1e8 bytes/s) or not (1e9), every third the tied graph (a weight
    tied across stages, or inside one), every fifth a memory limit."""
    rng = random.Random(7)
    for seed in range(count):
        g = _tied_graph(("emb", "head") if seed % 2 else ("a", "b")) if seed % 3 == 2 else \
            random_dag(rng.randint(10, 16), seed)
        S = rng.randint(2, 4)
        replicas = [rng.choice([1, 1, 2, 3]) for _ in range(S)]
        two_level = seed % 3 == 0
        K = sum(replicas) + (sum(replicas) % 2 if two_level else 0)
        bandwidth = (1e8, 1e9)[seed % 4 // 2] * (1e-3 if g.param_sizes else 1.0)  # the tied graph's bytes are few
        plan, opts = _random_plan(g, S, rng), _opts(K, ("fxpipe", "pipedream")[seed % 2], two_level, bandwidth)
        if seed % 5 == 4:  # a memory limit the plan just meets
            opts = dataclasses.replace(opts, memory=evaluate(g, plan, replicas, opts).peak_memory_bytes)
        yield g, plan, replicas, opts


def test_the_corridor_dp_scores_stages_as_evaluate_does():
    """The DP's bottleneck for the plan it picks equals ``evaluate``'s, under both cost models, flat and
    on nodes of two (ranks as the plan places them), with either window order, and the plan it starts
    from lies in the corridor."""
    links = 0
    for g, plan, replicas, opts in _cases(90):
        ranks = stage_ranks(replicas)
        ev = evaluate(g, plan, replicas, opts, ranks=ranks)
        links += any(s.comm_s >= s.time_s for s in ev.stages)
        for order in (0, 1):  # windows cut in graph order, and a branch at a time
            new, reps, predicted = polish._round(polish._Graph(g), plan, replicas, ranks, opts, math.inf, order)
            assert is_convex(g, new) and reps == replicas
            got = evaluate(g, new, replicas, opts, ranks=ranks).bottleneck_s
            assert predicted == pytest.approx(got, rel=1e-9, abs=1e-15)
            assert got <= ev.bottleneck_s * (1 + 1e-12)
            if opts.memory is not None:
                assert evaluate(g, new, replicas, opts, ranks=ranks).peak_memory_bytes <= opts.memory
    assert links >= 20  # a link sets some stage's time in many of the plans


def _moved_round(g, plan, replicas, ranks, opts):
    """A round with replica moves, checked: convex, devices kept (no more with ``fewer_devices``), each
    count moved by at most one, its bottleneck ``evaluate``'s (ranks placed in stage order where counts
    moved) and never above the round that keeps the counts. Its (counts, ranks)."""
    kept = polish._round(polish._Graph(g), plan, replicas, ranks, opts, math.inf)
    new, reps, predicted = polish._round(polish._Graph(g), plan, replicas, ranks, opts, math.inf, moves=2)
    assert is_convex(g, new)
    assert sum(reps) <= sum(replicas) if opts.fewer_devices else sum(reps) == sum(replicas)
    assert all(abs(a - b) <= 1 and a >= 1 for a, b in zip(reps, replicas))
    placed = ranks if reps == replicas else stage_ranks(reps)
    assert predicted == pytest.approx(evaluate(g, new, reps, opts, ranks=placed).bottleneck_s, rel=1e-9, abs=1e-15)
    assert predicted <= kept[2] * (1 + 1e-12)
    return reps, placed


def test_rounds_that_move_replicas_score_as_evaluate_does():
    """With replica moves (``_moved_round``'s checks), flat and on nodes of two, under both cost models:
    never with a memory limit, and never for a stage holding a tied weight."""
    moved, two_level = 0, 0
    for seed, (g, plan, replicas, base) in enumerate(_cases(90)):
        ranks = stage_ranks(replicas)
        for opts in [base] + ([dataclasses.replace(base, fewer_devices=True)] if seed % 4 == 1 else []):
            reps, _ = _moved_round(g, plan, replicas, ranks, opts)
            if reps != replicas:
                moved += 1
                two_level += opts.gpus_per_node is not None
                assert opts.memory is None
                tied = {j for group in tied_weights(g, plan) for j in group}
                assert all(reps[j] == replicas[j] for j in tied)
    assert moved >= 10 and two_level >= 3  # random plans' counts are rarely the best


def test_replica_moves_on_nodes_keep_tied_stages_ranks():
    """On nodes of two a stage holding a tied weight keeps its ranks (its group's sync depends on them):
    no device moves before it; and stages not on consecutive ranks in stage order move nothing."""
    rng = random.Random(3)
    moved = 0
    for seed in range(150):
        g = _tied_graph((("emb", "head"), ("b", "d"), ("a", "head"))[seed % 3])
        S = rng.randint(3, 4)
        replicas = [rng.choice([1, 2, 3]) for _ in range(S)]
        K = sum(replicas) + sum(replicas) % 2
        opts = _opts(K, ("fxpipe", "pipedream")[seed % 2], True, 1e6)
        plan = _random_plan(g, S, rng)
        ranks = stage_ranks(replicas)
        reps, placed = _moved_round(g, plan, replicas, ranks, opts)
        tied = {j for group in tied_weights(g, plan) for j in group}
        assert all(placed[j] == ranks[j] for j in tied)
        moved += reps != replicas and any(0 < j < S - 1 for j in tied)  # a tied stage between others
        backwards = [list(r) for r in reversed(stage_ranks(replicas[::-1]))]
        if backwards != ranks:
            new, same, _ = polish._round(polish._Graph(g), plan, replicas, backwards, opts, math.inf, moves=2)
            assert same == replicas
    assert moved >= 2  # 3 of 150 here


def _weighted_line(work_ms: Sequence[int], cuts: Sequence[int]):
    """A line x -> l0 -> ... -> out whose layers take ``work_ms`` forward and as much backward, and a plan
    whose stages begin at the given places of that line (x is place 0)."""
    nodes = {"x": CostNode(name="x", op="placeholder", target="x", fwd_s=0.0, bwd_s=0.0, out_bytes=10,
                           param_bytes=0, is_input=True)}
    for i, c in enumerate(work_ms):
        nodes[f"l{i}"] = CostNode(name=f"l{i}", op="call_module", target="t", fwd_s=c * 1e-3, bwd_s=c * 1e-3,
                                  out_bytes=10, param_bytes=0)
    nodes["out"] = CostNode(name="out", op="output", target="o", fwd_s=0.0, bwd_s=0.0, out_bytes=0, param_bytes=0)
    names = list(nodes)
    g = CostGraph(nodes=nodes, edges=list(zip(names, names[1:])))
    return g, {n: sum(i >= c for c in cuts) for i, n in enumerate(names)}


def test_the_first_stage_takes_a_replica():
    """A heavy first stage (one replica) beside a light replicated one: a replica moves to stage 0, where
    no device was moved before it (keeping the counts: 14 ms; moved: 12 ms a stage), flat and on nodes of
    two."""
    g, start = _weighted_line([4] * 3 + [1] * 12, (4, 10))
    for opts in (CostOptions(devices=4), CostOptions(devices=4, gpus_per_node=2, intra_bandwidth=1e10)):
        replicas = [1, 2, 1]
        kept = polish.polished(g, start, replicas, stage_ranks(replicas), opts)
        assert kept is not None and evaluate(g, kept[0], replicas, opts).bottleneck_s == pytest.approx(14e-3)
        assignment, reps, placed = polish.polished(g, start, replicas, stage_ranks(replicas), opts, moves=2)
        assert reps == [2, 1, 1] and placed == stage_ranks(reps)
        assert evaluate(g, assignment, reps, opts, ranks=placed).bottleneck_s == pytest.approx(12e-3)


def test_a_replica_moves_to_the_slow_stage():
    """Three stages of a line on 4 devices, the two replicas on a light first stage: keeping the counts,
    the heavy middle stage gives up at most a node a side (16 ms); moving a replica to it makes every stage
    12 ms."""
    g, start = _weighted_line([1] * 6 + [4] * 3 + [1] * 6, (7, 10))
    opts, replicas = CostOptions(devices=4), [2, 1, 1]
    ranks = stage_ranks(replicas)
    kept = polish.polished(g, start, replicas, ranks, opts)
    assert kept is not None and kept[1] == replicas
    assert evaluate(g, kept[0], replicas, opts).bottleneck_s == pytest.approx(16e-3)
    assignment, reps, placed = polish.polished(g, start, replicas, ranks, opts, moves=2)
    assert reps == [1, 2, 1] and placed == stage_ranks(reps)
    assert evaluate(g, assignment, reps, opts).bottleneck_s == pytest.approx(12e-3)
    ev = evaluate(g, start, replicas, opts)  # the answer ``result`` gives: counts and ranks with the plan
    found = PartitionResult(assignment=start, replicas=replicas, stages=ev.stages, bottleneck_s=ev.bottleneck_s,
                            options=opts, status="FEASIBLE", objective_s=ev.bottleneck_s, bound_s=11e-3,
                            wall_s=0.0, units=len(g.nodes), method="segment DP")
    lines = []
    out = polish.result(g, found, math.inf, lines.append)
    assert out.replicas == [1, 2, 1] and [s.ranks for s in out.stages] == stage_ranks([1, 2, 1])
    assert out.method == "segment DP, boundaries polished, replicas moved" and "1 replica to other stages:" in lines[0]
    assert out.bottleneck_s == pytest.approx(12e-3) and out.bound_s == 11e-3


def test_polished_plans_are_plans_and_faster():
    """Every answer is convex, keeps every stage's work, leaves inputs and outputs where they were, and is
    faster than the plan it started from; without moves it keeps the stages, their replicas and ranks;
    with moves the devices in all (ranks then placed in stage order), and where a stage was split, each
    fixed node keeps its place among the others (stage order)."""
    improved = split = 0
    for g, plan, replicas, opts in _cases(60):
        ranks = stage_ranks(replicas)
        for moves in (0, 2):
            found = polish.polished(g, plan, replicas, ranks, opts, moves=moves)
            if found is None:
                continue
            new, reps, placed = found
            assert (reps, placed) == (replicas, ranks) if moves == 0 or reps == replicas else \
                placed == stage_ranks(reps) and sum(reps) == sum(replicas)
            improved += 1
            assert is_convex(g, new) and set(new.values()) == set(range(len(reps)))
            fixed = [n for n, nd in g.nodes.items() if nd.is_input or nd.op == "output"]
            if len(reps) == len(replicas):
                assert all(new[n] == plan[n] for n in fixed)
            else:
                split += 1
                assert moves and len(reps) > len(replicas)
                assert all(new[a] <= new[b] for a in fixed for b in fixed if plan[a] < plan[b])
            working = {new[n] for n, nd in g.nodes.items() if not nd.is_input and nd.op != "output"}
            assert working == set(range(len(reps)))
            assert evaluate(g, new, reps, opts, ranks=placed).bottleneck_s < \
                evaluate(g, plan, replicas, opts, ranks=ranks).bottleneck_s
    assert improved >= 40  # random cuts are rarely the best; the search must find better ones


def test_a_replicated_stage_splits_where_its_all_reduce_costs_more_than_a_boundary():
    """Twelve 2 ms layers of 0.5 MB weights on 3 devices, planned as 6 layers on one device and 6 on two
    (12 ms, and 6 ms + a 3 ms all-reduce): moving boundaries and replicas leaves a replicated stage (at
    best 10.5 ms); splitting it gives three stages of four layers, 8 ms each, as the rounds alone cannot
    (they keep the stage count)."""
    g, start = _weighted_line([1] * 12, (7,))
    for name in list(g.nodes)[1:-1]:
        g.nodes[name] = dataclasses.replace(g.nodes[name], param_bytes=500_000)
    replicas = [1, 2]
    ranks = stage_ranks(replicas)
    for opts in (CostOptions(devices=3, bandwidth=1e9), CostOptions(devices=3, bandwidth=1e9, replication="pow2")):
        _split_three_ways(g, start, replicas, ranks, opts)
    held = CostOptions(devices=3, bandwidth=1e9, memory=10**9)  # a memory limit: no split (in flight moves)
    found = polish.polished(g, start, replicas, ranks, held, moves=2)
    assert found is None or found[1] == replicas


def _split_three_ways(g, start, replicas, ranks, opts):
    """The rounds alone stay at 10.5 ms or more; ``polished`` with moves and ``result`` split to 8 ms."""
    moved = polish._descended(polish._Graph(g), (start, replicas, ranks),
                              evaluate(g, start, replicas, opts).bottleneck_s, opts, math.inf, 2, {})
    assert len(moved[0][1]) == 2 and moved[1] >= 10.5e-3 - 1e-9  # no split: a stage of two replicas stays
    kept = polish.polished(g, start, replicas, ranks, opts)
    assert kept is None or kept[1] == replicas
    assignment, reps, placed = polish.polished(g, start, replicas, ranks, opts, moves=2)
    assert reps == [1, 1, 1] and placed == stage_ranks(reps) and is_convex(g, assignment)
    assert evaluate(g, assignment, reps, opts).bottleneck_s == pytest.approx(8e-3)
    ev = evaluate(g, start, replicas, opts)  # ``result`` says so
    found = PartitionResult(assignment=start, replicas=replicas, stages=ev.stages, bottleneck_s=ev.bottleneck_s,
                            options=opts, status="FEASIBLE", objective_s=ev.bottleneck_s, bound_s=7e-3,
                            wall_s=0.0, units=len(g.nodes), method="segment DP")
    lines = []
    out = polish.result(g, found, math.inf, lines.append)
    assert out.replicas == [1, 1, 1] and len(out.stages) == 3 and out.bottleneck_s == pytest.approx(8e-3)
    assert out.method == "segment DP, boundaries polished, stages split"
    assert "1 replicated stage split in two" in lines[0]


def _line(n: int, seed: int) -> CostGraph:
    """A chain of ``n`` nodes with random compute, an input first and an output last."""
    rng = random.Random(seed)
    nodes = {"x": CostNode(name="x", op="placeholder", target="x", fwd_s=0.0, bwd_s=0.0, out_bytes=10,
                           param_bytes=0, is_input=True)}
    for i in range(n):
        nodes[f"l{i}"] = CostNode(name=f"l{i}", op="call_module", target="t", fwd_s=rng.uniform(1e-3, 1e-2),
                                  bwd_s=rng.uniform(1e-3, 2e-2), out_bytes=10, param_bytes=0)
    nodes["out"] = CostNode(name="out", op="output", target="o", fwd_s=0.0, bwd_s=0.0, out_bytes=0, param_bytes=0)
    names = list(nodes)
    return CostGraph(nodes=nodes, edges=list(zip(names, names[1:])))


@pytest.mark.parametrize("seed", range(6))
def test_rounds_reach_the_best_cuts_of_a_line(seed):
    """On a line of 24 nodes cut in 4 one-replica stages, rounds of the corridor move the boundaries
    from equal node counts to the best cuts found by trying every placement of the three."""
    g = _line(24, seed)
    opts = CostOptions(devices=4)
    names = list(g.nodes)
    body = names[1:-1]

    def plan(cuts):
        stage = {n: sum(i >= c for c in cuts) for i, n in enumerate(body)}
        return {"x": 0, **stage, "out": 3}

    best = min(evaluate(g, plan(c), [1] * 4, opts).bottleneck_s for c in itertools.combinations(range(1, 24), 3))
    start = plan((6, 12, 18))
    new = polish.polished(g, start, [1] * 4, stage_ranks([1] * 4), opts)
    got = evaluate(g, new[0] if new is not None else start, [1] * 4, opts).bottleneck_s
    assert got == pytest.approx(best, rel=1e-12)


def _tied_graph(tie=("emb", "head")) -> CostGraph:
    """x -> emb -> a -> b -> c -> d -> head -> out; the two nodes of ``tie`` share weight w, the other
    layers each hold their own."""
    names = ["x", "emb", "a", "b", "c", "d", "head", "out"]
    sizes = {"w": 4000, **{f"p{n}": 2000 for n in names}}
    nodes = {}
    for i, n in enumerate(names):
        params = ("w",) if n in tie else (f"p{n}",) if n not in ("x", "out") else ()
        nodes[n] = CostNode(name=n, op="placeholder" if n == "x" else "output" if n == "out" else "call_module",
                            target=n, fwd_s=0.0 if n in ("x", "out") else 1e-3 * (1 + i % 3),
                            bwd_s=0.0 if n in ("x", "out") else 2e-3, out_bytes=1000, is_input=n == "x",
                            params=params, param_bytes=sum(sizes[p] for p in params))
    return CostGraph(nodes=nodes, edges=list(zip(names, names[1:])), param_sizes=sizes)


def test_a_stage_keeps_work():
    """A window may take every node of a stage but one, and that one may be an input: a plan whose stage
    would run nothing is refused (here moving y1 and y2 out of the bottleneck stage, to the replicated
    stages beside it, would make the plan 4x faster)."""
    spec = [("x", 0.0, True), ("a", 1e-3, False), ("y1", 5e-3, False), ("inp2", 0.0, True), ("y2", 5e-3, False),
            ("b", 1e-3, False), ("out", 0.0, False)]
    nodes = {n: CostNode(name=n, op="placeholder" if inp else "output" if n == "out" else "call_module", target=n,
                         fwd_s=c, bwd_s=c, out_bytes=10, param_bytes=0, is_input=inp) for n, c, inp in spec}
    edges = [("x", "a"), ("a", "y1"), ("y1", "y2"), ("inp2", "y2"), ("y2", "b"), ("b", "out")]
    g = CostGraph(nodes=nodes, edges=edges)
    start = {"x": 0, "a": 0, "y1": 1, "inp2": 1, "y2": 1, "b": 2, "out": 2}
    opts, replicas = CostOptions(devices=5), [2, 1, 2]
    new, _, _ = polish._round(polish._Graph(g), start, replicas, stage_ranks(replicas), opts, math.inf)
    assert new["y1"] == 0 and new["y2"] == 2  # what the corridor's best is
    for moves in (0, 2):
        kept = polish.polished(g, start, replicas, stage_ranks(replicas), opts, moves=moves)
        assert kept is None or {kept[0][n] for n in ("a", "y1", "y2", "b")} == {0, 1, 2}


def test_tied_holders_stay_and_memory_holds():
    """Nodes holding a tied weight never move, and a memory limit the plan meets is met after."""
    g = _tied_graph()
    start = {"x": 0, "emb": 0, "a": 0, "b": 0, "c": 0, "d": 1, "head": 1, "out": 1}
    base = CostOptions(devices=2)
    ranks = stage_ranks([1, 1])
    free = polish.polished(g, start, [1, 1], ranks, base)
    assert free is not None and free[0]["emb"] == 0 and free[0]["head"] == 1
    mem = max(s.memory_bytes for s in evaluate(g, start, [1, 1], base).stages)
    tight = CostOptions(devices=2, memory=mem)
    held = polish.polished(g, start, [1, 1], ranks, tight, moves=2)
    if held is not None:
        assert held[1] == [1, 1]
        assert max(s.memory_bytes for s in evaluate(g, held[0], [1, 1], tight).stages) <= mem


def test_result_keeps_bound_ranks_and_replicas():
    """``polish.result`` on a FEASIBLE answer: faster plan, same bound, replicas and ranks; the method
    says so; an OPTIMAL answer is left alone."""
    g = _line(24, 3)
    opts = CostOptions(devices=4)
    body = list(g.nodes)[1:-1]
    start = {"x": 0, **{n: min(i // 6, 3) for i, n in enumerate(body)}, "out": 3}
    ev = evaluate(g, start, [1] * 4, opts)
    bound = sum(n.fwd_s + n.bwd_s for n in g.nodes.values()) / 4
    found = PartitionResult(assignment=start, replicas=[1] * 4, stages=ev.stages, bottleneck_s=ev.bottleneck_s,
                            options=opts, status="FEASIBLE", objective_s=ev.bottleneck_s, bound_s=bound,
                            wall_s=0.0, units=len(g.nodes), method="segment DP")
    out = polish.result(g, found, math.inf)
    assert out.bottleneck_s < found.bottleneck_s and out.bound_s == bound and out.replicas == [1] * 4
    assert [s.ranks for s in out.stages] == [s.ranks for s in found.stages]
    assert out.method == "segment DP, boundaries polished"
    assert out.bottleneck_s == evaluate(g, out.assignment, out.replicas, opts).bottleneck_s
    found.status = "OPTIMAL"
    assert polish.result(g, found, math.inf) is found


def test_splits_stop_after_tries_that_do_not_help(monkeypatch):
    """Ten stages of two replicas each, every stage as slow as any split would leave it (no weights,
    equal work): the polish tries ``SPLIT_TRIES`` splits, not one per stage, then answers."""
    g, start = _weighted_line([1] * 40, tuple(range(5, 41, 4)))
    opts, replicas = CostOptions(devices=20), [2] * 10
    calls = []
    real = polish._descended
    monkeypatch.setattr(polish, "_descended", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert polish.polished(g, start, replicas, stage_ranks(replicas), opts, moves=2) is None
    assert len(calls) == 1 + polish.SPLIT_TRIES
