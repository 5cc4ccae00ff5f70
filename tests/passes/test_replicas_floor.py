"""``costmodel.replicas_floor``: the replica counts a bound-only chain DP pass runs on (``ChainSolver``'s
``floor_counts``, used by ``segment_plan.early_bound`` and ``finer_bound``). Never above the exact
fewest count (else an infeasible pass would prove a T a plan meets), equal to it away from the hair
around whole-number ratios, and the bound of a search on them equal to the exact search's."""
from __future__ import annotations

import math

import numpy as np
import pytest

from passes.partition import CostOptions
from passes.partition.chain import ChainSolver, solve as chain_solve, unit_bottleneck
from passes.partition.costmodel import min_replicas, replicas_floor, stage_time_s
from passes.partition.segments import build_segments, folded_units
from tests.passes.test_partition_scale import transformer_graph


def _points(rng, n: int, T: float):
    """Prefix sums of compute and weight bytes at ``n`` points, and each point's cut."""
    compute = np.cumsum(rng.uniform(0, T, n) * rng.choice([0.1, 1.0, 3.0], n))
    params = np.cumsum(rng.choice([0.0, 1e3, 1e4, 1e5, 5e5], n))
    cut = rng.choice([0.0, 1e5, T * 1e9 / 2, T * 1e9 / 2 * (1 + 1e-12), 3 * T * 1e9 / 2 * (1 - 1e-12)], n)
    return compute, params, cut


@pytest.mark.parametrize("K", [1, 8, 64, 1024])
def test_floor_never_above_the_fewest_count(K):
    """Rows of starts against columns of ends, as a pool meets a segment: counts from one replica to
    past K, all-reduce terms above T (nothing past one replica fits), and bottlenecks at a stage's
    exact time for some count, where the ratio is a whole number and the floor may come out one low."""
    opts = CostOptions(devices=K, bandwidth=1e9, allreduce_bandwidth=2e9)
    rng = np.random.default_rng(K)
    T = 1e-3
    c, p, cut = _points(rng, 400, T)
    span = float(c[-1] + 2.0 * p[-1] / opts.ar_bandwidth)
    rows, cols = slice(0, 200), slice(150, 400)
    args = (c[rows, None], p[rows, None], cut[rows, None], c[None, cols], p[None, cols], cut[None, cols])

    def exact(T):
        return min_replicas(args[3] - args[0], args[4] - args[1], args[2], args[5], T, opts)

    stages = np.broadcast_shapes(args[0].shape, args[3].shape)
    C, P = (args[3] - args[0]).ravel(), (args[4] - args[1]).ravel()
    falls = np.nonzero(C > 1.01 * 2.0 * P / opts.ar_bandwidth)[0]  # stages whose time falls with r
    pick = rng.choice(falls, 40)
    edges = stage_time_s(C[pick], P[pick], 0.0, 0.0, rng.integers(2, K + 1, 40), opts) if K > 1 else []
    equal = total = 0
    for t in np.r_[T, 0.3 * T, 4 * T, 2e-2, edges]:
        want, got = exact(float(t)), replicas_floor(*args, float(t), opts, span)
        assert got.shape == stages
        assert (got <= want).all()
        equal += int((got == want).sum())
        total += want.size
    assert equal >= 0.99 * total  # low only on the hair around whole-number ratios (the cuts above sit on it)
    assert (exact(T) > 1).any() and (exact(T) == K + 1).any()  # the counts tried span the range


def test_floor_at_the_all_reduce_term():
    """Weights whose all-reduce alone takes T or more: one replica fits a stage of compute up to T (it
    syncs nothing), no count fits one of more; the floor says so too, as ``min_replicas`` does."""
    opts = CostOptions(devices=64, bandwidth=1e9, allreduce_bandwidth=2e9)
    T = 1e-2  # 2P/B_ar = 1e-2 for 1e7 bytes
    c_end, p_end = np.array([5e-3, 2e-2, 1e-2, 3e-2, 5e-3]), np.array([1e7, 1e7, 1e7, 2e7, 2e7])
    want = min_replicas(c_end, p_end, 0.0, 0.0, T, opts)
    span = float(c_end.sum() + 2.0 * p_end.sum() / opts.ar_bandwidth)
    got = replicas_floor(0.0, 0.0, 0.0, c_end, p_end, 0.0, T, opts, span)
    assert want.tolist() == [1, 65, 1, 65, 1]  # the last two: all-reduce terms past T (2e-2)
    assert got.tolist() == want.tolist()
    c_end = T * (1 + np.array([-1e-12, 0.0, 1e-12, 1e-6]))  # compute a hair around T, no weights
    want = min_replicas(c_end, 0.0, 0.0, 0.0, T, opts)
    got = replicas_floor(0.0, 0.0, 0.0, c_end, 0.0, 0.0, T, opts, float(c_end.sum()))
    assert want.tolist() == [1, 1, 2, 2] and (got <= want).all() and got[-1] == 2


@pytest.mark.parametrize("K", [3, 8, 16])
def test_bound_of_a_floor_search_equals_the_exact_one(K):
    """A bound-only search on the floor counts proves the bound the exact counts prove (the same passes
    fail), under the plan the exact search finds; the solver takes the floor only where it applies (with
    a tied weight, in the segments that hold none of its users)."""
    g = transformer_graph(4, seed=K, tied=False)
    opts = CostOptions(devices=K, bandwidth=1e9, allreduce_bandwidth=2e9)
    units, _ = folded_units(g, opts, keep_dead=True)
    segs = build_segments(units, limit=100_000)
    score = lambda so, r: unit_bottleneck(units, so, r, opts)  # noqa: E731
    exact = chain_solve(units, segs, opts, math.inf, score)
    floor = ChainSolver(units, segs, opts, floor_counts=True)
    assert floor._floor_span is not None
    lower = chain_solve(units, segs, opts, math.inf, score, floor, bound_only=True)
    assert lower.bound <= exact.objective * (1 + 1e-12)
    assert lower.bound == pytest.approx(exact.bound, rel=1e-9)
    pipedream = CostOptions(devices=K, bandwidth=1e9, cost_model="pipedream")
    assert ChainSolver(units, segs, pipedream, floor_counts=True)._floor_span is None
    # with a tied weight the floor counts only the stages of segments that hold none of its users
    # (``ChainSolver._untied``), and the bound is again the exact one
    tied = folded_units(transformer_graph(4, seed=K, tied=True), opts, keep_dead=True)[0]
    tied_segs = build_segments(tied, limit=100_000)
    tied_floor = ChainSolver(tied, tied_segs, opts, floor_counts=True)
    users = {u for _, us in tied.shared.values() for u in us}
    assert all(not tied_floor._untied(seg) for seg in tied_segs if users & set(seg.units))
    tied_score = lambda so, r: unit_bottleneck(tied, so, r, opts)  # noqa: E731
    tied_exact = chain_solve(tied, tied_segs, opts, math.inf, tied_score)
    tied_lower = chain_solve(tied, tied_segs, opts, math.inf, tied_score, tied_floor, bound_only=True)
    assert tied_lower.bound <= tied_exact.objective * (1 + 1e-12)
    assert tied_lower.bound == pytest.approx(tied_exact.bound, rel=1e-9)
