"""A side branch computed from the inputs alone (an attention mask) beside the embeddings.

It multiplies the downsets of the first segment; the segment DP then plans
on the graph with the branch as one node and bounds on the graph with the
branch free (``passes/partition/branches.py``). Checked against brute force
on small graphs, and on HF GPT-2 (12 layers, captured through export and
profiled on CPU once; the profile is stored so the test needs neither
transformers nor stable timings).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest

from passes.costgraph import CostGraph, CostNode
from passes.partition import CostOptions, evaluate, is_convex, partition
from passes.partition import branches, chain, segment_plan
from tests.passes.test_partition import B, BAR, brute_force, monotone_assignments, valid

GPT2 = Path(__file__).parent / "data" / "hf_gpt2_12_layers.json"


def _node(name, cost, out, pbytes=0, is_input=False, op="call_function"):
    return CostNode(name=name, op=op, target=name, fwd_s=cost / 3, bwd_s=2 * cost / 3, out_bytes=out,
                    param_bytes=pbytes, is_input=is_input, params=(name,) if pbytes else ())


def masked_graph(seed: int, heavy: float = 1.0) -> CostGraph:
    """ids -> embedding -> layer -> attention -> head, and a four-node mask from ids alone into the
    attention; ``heavy`` scales the mask's first three nodes' compute."""
    rng = random.Random(seed)
    c = lambda: rng.uniform(1e-3, 1e-2)  # noqa: E731
    nb = lambda: rng.randint(1, 9) * 10**6  # noqa: E731
    spec = [("x", [], dict(cost=0, out=10**5, is_input=True, op="placeholder")),
            ("emb", ["x"], dict(cost=c(), out=nb(), pbytes=10**7)),
            ("m1", ["x"], dict(cost=heavy * c(), out=nb())), ("m2", ["m1"], dict(cost=heavy * c(), out=nb())),
            ("m3", ["m1"], dict(cost=heavy * c(), out=nb())), ("mask", ["m2", "m3"], dict(cost=c(), out=10**6)),
            ("layer", ["emb"], dict(cost=c(), out=nb(), pbytes=rng.choice([0, 10**7]))),
            ("att", ["layer", "mask"], dict(cost=c(), out=nb())),
            ("head", ["att"], dict(cost=c(), out=nb(), pbytes=10**6))]
    nodes = {n: _node(n, **kw) for n, _, kw in spec}
    params = {n: nd.param_bytes for n, nd in nodes.items() if nd.param_bytes}
    return CostGraph(nodes=nodes, edges=[(p, n) for n, ps, _ in spec for p in ps], param_sizes=params)


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
@pytest.mark.parametrize("seed,K", [(0, 2), (1, 3), (2, 3), (3, 4)])
def test_branch_plan_and_bound_bracket_brute_force(model, seed, K):
    g = masked_graph(seed)
    opts = CostOptions(devices=K, cost_model=model, bandwidth=B, allreduce_bandwidth=BAR)
    cones = branches.input_only_cones(g, opts)
    assert cones == [("mask", ["m1", "m2", "m3", "mask"])]
    best = brute_force(g, K, model, opts.allowed_replicas())
    units, found, margin = segment_plan.segment_dp(branches.relaxed(g, cones), opts, math.inf)
    assert found.bound - margin <= best * (1 + 1e-9)  # a lower bound of the real graph
    # with the branch's compute counted in the devices of every prefix that needs it: still one, and no
    # lower (but for where each bisection stops, chain.TOLERANCE)
    _, counted, margin2 = segment_plan.segment_dp(branches.relaxed(g, cones), opts, math.inf,
                                             hidden=lambda u: branches.hidden_compute(g, u, cones))
    assert (found.bound - margin) * (1 - 3e-4) <= counted.bound - margin2 <= best * (1 + 1e-9)
    (assignment, replicas), *_ = segment_plan.searched(g, opts, math.inf, cones)
    assert is_convex(g, assignment) and sum(replicas) == K
    assert len({assignment[n] for n in ("m1", "m2", "m3", "mask")}) == 1  # the branch moves as one
    assert evaluate(g, assignment, replicas, opts).bottleneck_s >= best * (1 - 1e-9)


@pytest.mark.parametrize("K", [16, 256, 1024])
def test_hf_gpt2_mask_segment_is_planned_and_bounded_by_the_segment_dp(K):
    g = CostGraph.load(GPT2)
    start = time.monotonic()
    res = partition(g, K, time_limit=10)
    assert time.monotonic() - start < 10.5
    # the segment DP answers within 1 %; above 0.1 % CP-SAT gets the rest of the time and may find a better plan
    assert res.method == "segment DP" or res.status != "OPTIMAL"
    assert g.total_compute_s() / K * (1 - 1e-12) <= res.bound_s <= res.bottleneck_s
    assert res.gap <= 0.01
    assert sum(res.replicas) == K and is_convex(g, res.assignment)
    assert evaluate(g, res.assignment, res.replicas, res.options).bottleneck_s == pytest.approx(res.bottleneck_s)


def test_mask_folded_like_an_input_still_counts_in_the_bound():
    """A second profile of the same GPT-2 (quiet machine, 2 repeats): its segments are small enough for the
    plain segment DP, which places the mask's nodes like model inputs and so forgets their compute in
    its bound and its plan (3 % apart at K=16). The relaxation that counts that compute in every
    prefix that must run it (``branches.hidden_compute``) closes the proof to within 1 %."""
    g = CostGraph.load(GPT2.with_name("hf_gpt2_12_layers_second.json"))
    start = time.monotonic()
    res = partition(g, 16, time_limit=3)
    assert time.monotonic() - start < 4.0
    assert g.total_compute_s() / 16 * (1 - 1e-12) <= res.bound_s <= res.bottleneck_s
    assert res.gap <= 0.01
    assert evaluate(g, res.assignment, res.replicas, res.options).bottleneck_s == pytest.approx(res.bottleneck_s)


def mask_after_a_shared_input_node(seed: int) -> CostGraph:
    """The mask's branch reads p, a weightless node of the inputs that a weighted node reads too, so p
    is no cone member and stays a unit, and the branch's relaxed (free, silent) node m folds into it."""
    rng = random.Random(seed)
    c = lambda lo, hi: rng.uniform(lo, hi)  # noqa: E731
    spec = [("x", [], dict(cost=0, out=10**5, is_input=True, op="placeholder")),
            ("p", ["x"], dict(cost=c(1e-3, 5e-3), out=10**4)),
            ("a", ["x", "p"], dict(cost=c(1e-3, 1e-2), out=10**4, pbytes=10**7)),
            ("m", ["p"], dict(cost=c(1e-3, 1e-2), out=10**4)),
            ("mask", ["m"], dict(cost=c(1e-5, 1e-4), out=10**4)),
            ("b", ["a"], dict(cost=c(1e-3, 1e-2), out=10**4, pbytes=10**7)),
            ("c", ["b", "mask"], dict(cost=c(1e-3, 1e-2), out=10**4, pbytes=10**7))]
    nodes = {n: _node(n, **kw) for n, _, kw in spec}
    return CostGraph(nodes=nodes, edges=[(q, n) for n, ps, _ in spec for q in ps],
                     param_sizes={n: nd.param_bytes for n, nd in nodes.items() if nd.param_bytes})


@pytest.mark.parametrize("seed,K", [(3, 3), (0, 2), (1, 3), (5, 3)])
def test_branch_compute_forced_in_by_its_exit_not_by_the_unit_it_folds_into(seed, K):
    """m's compute must run by mask's stage, not by p's: forcing it into every prefix that holds p's
    unit (as the relaxation once did) put the bound above the optimum on seed 3 (8.22 vs 7.85 ms)."""
    g = mask_after_a_shared_input_node(seed)
    opts = CostOptions(devices=K, bandwidth=B, allreduce_bandwidth=BAR)
    cones = branches.input_only_cones(g, opts)
    assert cones == [("mask", ["m", "mask"])]
    _, found, margin = segment_plan.segment_dp(branches.relaxed(g, cones), opts, math.inf,
                                              hidden=lambda u: branches.hidden_compute(g, u, cones))
    assert found.bound - margin <= brute_force(g, K, "fxpipe", opts.allowed_replicas()) * (1 + 1e-9)


def _counted_bound(g: CostGraph, opts: CostOptions, cones) -> float:
    _, found, margin = segment_plan.segment_dp(branches.relaxed(g, cones), opts, math.inf,
                                              hidden=lambda u: branches.hidden_compute(g, u, cones))
    return found.bound - margin


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
def test_forced_compute_runs_where_there_is_room(model, monkeypatch):
    """A stage that first holds a unit forcing the mask's compute in runs what the stages before it cannot
    hold (``ChainSolver._late``), at its own replica count: still below brute force, and above the
    bound that counts that compute over the whole prefix (its slack anywhere) on some of these graphs."""
    raised = 0
    for seed, K in [(5, 2), (2, 3), (7, 3), (9, 3), (0, 4), (1, 4)]:
        g = masked_graph(seed, heavy=2.0)
        opts = CostOptions(devices=K, cost_model=model, bandwidth=B, allreduce_bandwidth=BAR)
        cones = branches.input_only_cones(g, opts)
        best = brute_force(g, K, model, opts.allowed_replicas())
        bound = _counted_bound(g, opts, cones)
        assert bound <= best * (1 + 1e-9), (seed, K)
        with monkeypatch.context() as m:  # the prefix-wide count alone
            m.setattr(chain.ChainSolver, "_late", staticmethod(lambda h, c, d, T: np.zeros(np.broadcast(h, c, d).shape)))
            raised += bound > _counted_bound(g, opts, cones) * (1 + 1e-3)
    assert raised


def test_pieces_of_a_cone_form_a_chain_and_expand_to_a_convex_plan():
    """The plan's graph with the mask in 2-3 pieces: each piece reads the inputs and earlier pieces only,
    the exit's piece keeps its name, and the DP's plan, expanded, is convex on all K devices and no
    faster than brute force."""
    for seed, K, pieces in [(0, 3, 2), (1, 3, 3), (3, 4, 3)]:
        g = masked_graph(seed, heavy=4.0)
        opts = CostOptions(devices=K, bandwidth=B, allreduce_bandwidth=BAR)
        cones = branches.input_only_cones(g, opts)
        rep = branches.pieces_of(g, cones, pieces)
        assert rep["mask"] == "mask" and len(set(rep.values())) == pieces
        merged = branches.contracted(g, cones, pieces)
        order = list(merged.nodes)
        assert all(order.index(u) < order.index(v) for u, v in merged.edges)  # still topological
        assert sum(n.compute_s for n in merged.nodes.values()) == pytest.approx(g.total_compute_s())
        (assignment, replicas), *_ = segment_plan.searched(g, opts, math.inf, cones, keep_dead=True, pieces=pieces)
        assert set(assignment) == set(g.nodes) and is_convex(g, assignment) and sum(replicas) == K
        best = brute_force(g, K, "fxpipe", opts.allowed_replicas())
        assert evaluate(g, assignment, replicas, opts).bottleneck_s >= best * (1 - 1e-9)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_gpt2_at_64_devices_proven(tied):
    """HF GPT-2's mask (0.36 ms, 70 % of a stage) at 64 devices, the bundled CPU profile: the bound let
    it fill the slack of replicated stages anywhere before its exit (untied 2.3 % under the plan), and
    the plan held it in one stage (tied 1.3 % over the optimum). With the late compute charged to the
    stage that first needs it and the mask in pieces, both are proven within 0.1 %."""
    data = Path(__file__).parents[2] / "tools" / "bench" / "data"
    g = CostGraph.load(data / f"hf-gpt2-{'tied' if tied else 'untied'}-profile.json")
    start = time.monotonic()
    res = partition(g, 64, time_limit=10)
    assert time.monotonic() - start < 10.5
    assert res.status == "OPTIMAL" and res.bound_s <= res.bottleneck_s
    assert sum(res.replicas) == 64 and is_convex(g, res.assignment)
    assert evaluate(g, res.assignment, res.replicas, res.options).bottleneck_s == pytest.approx(res.bottleneck_s)


def tied_masked_graph(seed: int, tied_bytes: float) -> CostGraph:
    """``masked_graph`` (mask twice as heavy) with the embedding's weight tied to the head."""
    g = masked_graph(seed, heavy=2.0)
    nodes = dict(g.nodes)
    nodes["emb"] = dataclasses.replace(nodes["emb"], params=("w",), param_bytes=int(tied_bytes))
    nodes["head"] = dataclasses.replace(nodes["head"], params=("w",), param_bytes=0)
    sizes = {k: v for k, v in g.param_sizes.items() if k not in ("emb", "head")}
    return CostGraph(nodes=nodes, edges=list(g.edges), param_sizes={**sizes, "w": int(tied_bytes)})


def evaluated_brute_force(g: CostGraph, opts: CostOptions) -> float:
    """The best ``evaluate`` gives any valid plan (the reference cost model has no tied weights)."""
    best = math.inf
    for S in range(1, opts.devices + 1):
        vectors = [v for v in itertools.product(opts.allowed_replicas(), repeat=S) if sum(v) == opts.devices]
        for stage in (monotone_assignments(g, S) if vectors else ()):
            if valid(g, stage, S, opts.cost_model):
                best = min(best, min(evaluate(g, stage, list(v), opts).bottleneck_s for v in vectors))
    return best


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
def test_tied_prefix_room_and_a_branch_alone_in_the_first_stage(model, monkeypatch):
    """A prefix that holds the embedding but not the head pays the weight's sync somewhere (``_debt``),
    room the mask's compute cannot use: the bound rises on some of these graphs and stays below brute
    force on all. The best plan of several puts the mask's nodes alone in the first stage; the bound
    once charged the whole branch to the first stage of the relaxed plan and stood 11 % above it
    (seed 0, 40 MB, K = 2: 37.8 against 34.1 ms)."""
    raised = 0
    for tied_bytes, seed, K in itertools.product((1e7, 4e7), range(8), (2, 3)):
        g = tied_masked_graph(seed, tied_bytes)
        opts = CostOptions(devices=K, cost_model=model, bandwidth=B, allreduce_bandwidth=BAR)
        cones = branches.input_only_cones(g, opts)
        bound = _counted_bound(g, opts, cones)
        assert bound <= evaluated_brute_force(g, opts) * (1 + 1e-9), (tied_bytes, seed, K)
        with monkeypatch.context() as m:
            m.setattr(chain.ChainSolver, "_debt", lambda self, shared: np.zeros(shared.shape[:-1]))
            raised += bound > _counted_bound(g, opts, cones) * (1 + 1e-3)
    assert raised
