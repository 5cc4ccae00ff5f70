"""The node-count floor of PipeDream's two-level all-reduce (``passes/partition/node_floor.py``)."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from passes.partition import CostOptions
from passes.partition.chain import TOLERANCE
from passes.partition.costmodel import _allreduce, allreduce_span, flat_bound
from passes.partition.node_floor import NodeFloorSolver, applies
from passes.partition.offsets import EPS
from passes.partition.segment_plan import chain_plan
from passes.partition.segments import build_segments, folded_units
from tests.passes.test_partition import random_dag
from tests.passes.test_partition_scale import transformer_graph
from tests.passes.test_placed import _exact, _opts

B1, B2 = 1.0e11, 1.25e10


def _solver(K: int = 256, G: int = 8, b2: float = B2) -> NodeFloorSolver:
    g = transformer_graph(4, seed=3, tied=False)
    opts = CostOptions(devices=K, bandwidth=b2, intra_bandwidth=B1, gpus_per_node=G, cost_model="pipedream")
    units, _ = folded_units(g, opts)
    return NodeFloorSolver(units, build_segments(units), opts)


def _random_stages(rng, m: int, weights: float):
    """Stages wider than a node: compute, own and tied weight bytes, partners, cut bytes, and the B1
    model's fewest count (past G = 8) to start from."""
    tied = np.where(rng.random(m) < 0.3, rng.uniform(0, weights / 4, m), 0.0)
    return (rng.uniform(1e-4, 1e-2, m), rng.uniform(0, weights, m), tied, rng.integers(1, 4, m).astype(float),
            rng.uniform(0, 1e6, m), rng.integers(9, 200, m))


@pytest.mark.parametrize("K,G", [(256, 8), (96, 4), (64, 16)])
def test_floor_never_above_the_charge_at_any_offset(K, G):
    """The premise: for every count and every rank the stage may start at, PipeDream's placed all-reduce
    (``allreduce_span``) is at least the floor: the B1 ring up to G ranks, the band's least beyond."""
    solver = _solver(K, G)
    P = 1.0e8
    for r in range(2, K + 1):
        n = -(-r // G)
        floor = _allreduce(P, r, solver.opts) if r <= G else \
            P * max(4.0 * (r - 1) / (B1 * r), float(solver.floor._band(np.array([n]))[0])) / r
        assert P * solver.floor._own[r] == pytest.approx(floor, rel=1e-12)  # the table the pass reads
        placed = allreduce_span(P, np.arange(G), r, solver.machine)
        assert placed.min() >= floor * (1 - 1e-12), (r, placed.min(), floor)


@pytest.mark.parametrize("b2", [B2, B1])
def test_fewest_count_is_the_least_that_meets_t_band_by_band(b2):
    """``_fewest_across`` against trying every count: the band's time falls with r, so bisecting each band
    from its top finds the same fewest count (or ``devices + 1`` where none meets T), and so does the
    count read from the closed form where it is read (stages without tied weights; a quarter of them
    built so that it is an integer, where rounding decides and the count is asked instead). With B2 as
    fast as B1 the ring outweighs the band's least charge and every count is asked."""
    solver = _solver(256, 8, b2)
    m, T = 400, 2e-4
    rng = np.random.default_rng(0)
    C, own, tied, q, cut, start = _random_stages(rng, m, 4e8)
    n = -(-start // 8)
    whole = rng.integers(9, 256, m) * T * (1 + EPS) - own * solver.floor._bands[n]
    C = np.where((rng.random(m) < 0.25) & (whole > 2.0 * cut / B1) & (whole > 0), whole, C)
    got = solver.floor._fewest_across(C, own, tied, q, cut, start, T)
    for k in range(m):
        want = solver.opts.devices + 1
        for r in range(int(start[k]), solver.opts.devices + 1):
            if solver.floor._time(C[k], own[k], tied[k], q[k], cut[k], r) <= T * (1 + EPS):
                want = r
                break
        # past MAX_BANDS bands the answer is a floor of the fewest count, never above it
        assert got[k] == want or (got[k] < want and got[k] > start[k] + 16 * solver.G - solver.G), (k, got[k], want)


def test_fewest_count_never_below_the_flat_b1_model():
    """Stages the B1 model fits within one node keep its count; wider ones need at least as many."""
    solver = _solver(256, 8)
    rng = np.random.default_rng(1)
    C = rng.uniform(1e-4, 5e-2, 300)
    P = rng.uniform(0, 4e8, 300)
    zeros = np.zeros(300)
    T = 3e-4
    fast = solver._r(zeros, zeros, np.zeros((300, 0)), zeros, C, P, np.zeros((300, 0)), zeros, T)
    from passes.partition.costmodel import min_replicas
    flat = min_replicas(C, P, 0.0, 0.0, T, solver.opts)
    assert (fast >= flat).all()
    assert (fast[flat <= 8] == flat[flat <= 8]).all()
    assert (fast[flat > 8] > flat[flat > 8]).any()  # the floor bites where stages span nodes


@pytest.mark.parametrize("seed,K,G", [(s, K, G) for s in range(4) for K, G in ((8, 2), (8, 4), (6, 3))])
def test_bound_holds_against_the_exact_placed_optimum(seed, K, G):
    """The floor's bound on small graphs: never above the exact placed optimum (the downset DP), never
    below the flat B1 model's, and its plan scored placed."""
    g = random_dag(9, seed)
    opts = _opts(K, G, cost_model="pipedream")
    assert applies(opts)
    now = time.monotonic()
    floored = chain_plan(g, flat_bound(opts, fast=True), now, math.inf, plain=True, machine=opts)
    flat = chain_plan(g, flat_bound(opts, fast=True), now, math.inf, plain=True)
    best = _exact(g, opts)
    assert floored.bound_s <= best * (1 + 1e-9) and best <= floored.bottleneck_s * (1 + 1e-9)
    assert floored.bound_s >= flat.bound_s * (1 - 1e-9)


def test_deep_gpt_on_many_nodes_bounded_closer_than_the_b1_model():
    """Where plans replicate stages over many nodes (8 transformer blocks on 128 devices, 8 a node),
    the floor's bound lies above the B1 model's and still below the plan it finds, scored placed."""
    g = transformer_graph(8, seed=1)
    opts = CostOptions(devices=128, bandwidth=B2, intra_bandwidth=B1, gpus_per_node=8, cost_model="pipedream")
    now = time.monotonic()
    floored = chain_plan(g, flat_bound(opts, fast=True), now, now + 60, plain=True, machine=opts)
    flat = chain_plan(g, flat_bound(opts, fast=True), now, now + 60, plain=True)
    assert flat.bound_s < floored.bound_s <= floored.bottleneck_s


def test_floor_pass_stops_at_the_deadline():
    """A pass checks the deadline in its fewest-replicas step too (``ChainSolver.deadline``), not only
    between segments: on few, large segments one step can take a second."""
    from passes.partition.chain import DeadlineExceeded

    solver = _solver(256, 8)
    C, P = np.full(4, 1e-2), np.full(4, 1e8)
    zeros, none = np.zeros(4), np.zeros((4, 0))
    solver._r(zeros, zeros, none, zeros, C, P, none, zeros, 1e-4)  # no pass running: no deadline
    solver.deadline = time.monotonic() - 1.0
    with pytest.raises(DeadlineExceeded):
        solver._r(zeros, zeros, none, zeros, C, P, none, zeros, 1e-4)


# fxpipe's charges with power-of-two counts: one ring at its slowest link, B2 past G ranks


def _ring_solver(K: int = 256, G: int = 8) -> NodeFloorSolver:
    g = transformer_graph(4, seed=3, tied=False)
    opts = CostOptions(devices=K, bandwidth=B2, intra_bandwidth=B1, gpus_per_node=G, replication="pow2")
    units, _ = folded_units(g, opts)
    return NodeFloorSolver(units, build_segments(units), opts)


def test_applies_to_fxpipe_only_with_power_of_two_counts():
    """fxpipe's charges with any count have the exact interval DP (``placed.py``); pow2 gets the floor."""
    assert applies(_opts(64, 8, replication="pow2"))
    assert not applies(_opts(64, 8))
    assert not applies(_opts(64, 8, cost_model="pipedream", replication="pow2"))
    assert not applies(_opts(8, 8, replication="pow2"))  # one node: the B1 model says it all


@pytest.mark.parametrize("K,G", [(256, 8), (64, 4), (128, 16)])
def test_ring_floor_never_above_the_charge_at_any_offset(K, G):
    """The premise under fxpipe's ring: at every count and start rank the placed all-reduce is at least
    the floor's charge (B1 up to G ranks, B2 beyond: r > G ranks cross a node boundary anywhere)."""
    solver = _ring_solver(K, G)
    P = 1.0e8
    for r in range(2, K + 1):
        placed = allreduce_span(P, np.arange(G), r, solver.machine)
        assert placed.min() >= P * solver.floor._own[r] * (1 - 1e-12), (r, placed.min(), P * solver.floor._own[r])
        if r > G:  # and it is the B2 ring there: the floor is exact past G
            assert P * solver.floor._own[r] == pytest.approx(2.0 * (r - 1) / r * P / B2, rel=1e-12)


def test_ring_fewest_count_is_the_least_allowed_that_meets_t():
    """``_fewest_counted`` against trying every power of two from ``start`` on under ``_time``."""
    solver = _ring_solver(256, 8)
    m, T = 300, 2e-4
    C, own, tied, q, cut, start = _random_stages(np.random.default_rng(2), m, 4e7)
    got = solver.floor._fewest_counted(C, own, tied, q, cut, start, T)
    for k in range(m):
        want = next((r for r in (16, 32, 64, 128, 256) if r >= start[k] and
                     solver.floor._time(C[k], own[k], tied[k], q[k], cut[k], r) <= T * (1 + 1e-9)), 257)
        assert got[k] == want, (k, got[k], want)


@pytest.mark.parametrize("seed,K,G", [(s, K, G) for s in range(4) for K, G in ((8, 2), (16, 4), (8, 4))])
def test_ring_bound_holds_against_the_exact_placed_optimum(seed, K, G):
    """Under fxpipe's charges with pow2 counts: never above the exact placed optimum (the downset DP),
    never below the flat B1 model's bound, and its plan scored placed."""
    g = random_dag(9, seed)
    opts = _opts(K, G, replication="pow2")
    now = time.monotonic()
    floored = chain_plan(g, flat_bound(opts, fast=True), now, math.inf, plain=True, machine=opts)
    flat = chain_plan(g, flat_bound(opts, fast=True), now, math.inf, plain=True)
    best = _exact(g, opts)
    assert floored.bound_s <= best * (1 + 1e-9) and best <= floored.bottleneck_s * (1 + 1e-9)
    # each bisection stops within its tolerance of its own optimum, at a T of its own path
    assert floored.bound_s >= flat.bound_s * (1 - TOLERANCE)


def test_pow2_on_many_nodes_proven_by_the_floor():
    """The bundled GPT profile, 8 blocks on 1,024 devices (8 a node), pow2: the interval DP for any count
    bounds it 9 % under the plan in 30 s (it cannot see counts round up to a power of two), and the
    partitioner gave 21.9 % before the floor (the benchmark, 10 s); with it the plan is proven."""
    from passes.partition import partition
    from tools.bench.partition_scale import deep_gpt

    g = deep_gpt(8)
    res = partition(g, 1024, bandwidth=B2, intra_bandwidth=B1, gpus_per_node=8, replication="pow2",
                    time_limit=30)
    now = time.monotonic()
    relaxed = chain_plan(g, _opts(1024, 8), now, now + 30, plain=True, bound_only=True)
    assert res.status == "OPTIMAL", (res.gap, res.bound_s, res.bottleneck_s)
    assert relaxed.bound_s * 1.05 < res.bound_s <= res.bottleneck_s
    # the floor alone, as the driver runs it, proves it, so the driver answers at once (stopped at 0.3 % it
    # did not, and the row took the whole limit for 0.55 %)
    floored = chain_plan(g, flat_bound(res.options, fast=True), now, now + 30, plain=True, machine=res.options,
                         bound_only=True)
    assert floored.status == "OPTIMAL", floored.gap
    assert all(r & (r - 1) == 0 for r in res.replicas)
    assert res.options == _opts(1024, 8, replication="pow2")


def test_pow2_any_dp_starts_from_the_floor(monkeypatch):
    """Under pow2 the ``any`` DP runs after the floor for its bound alone (``driver._placed_chain``), so
    a pass of it below the floor's bound proves nothing new: none may run there, and it stops
    bisecting within ``RELAXED_TOLERANCE`` (its passes below the floor took 3 of 10 s on the bundled
    GPT, 8 blocks on 512 devices, before the charged DP's one decisive pass)."""
    from passes.partition import driver, placed

    g = transformer_graph(16, seed=2, tied=True)
    opts = _opts(64, 8, replication="pow2")
    floors, tried = [], []
    real_plan, real_pass = driver.chain_plan, placed.PlacedChainSolver.devices_needed

    def plan(graph, o, *a, **k):
        out = real_plan(graph, o, *a, **k)
        if k.get("machine") is not None and out is not None:
            floors.append(out.bound_s)
        return out

    def needed(self, T, *a, **k):
        if type(self) is placed.PlacedChainSolver:
            tried.append(T)
        return real_pass(self, T, *a, **k)

    monkeypatch.setattr(driver, "chain_plan", plan)
    monkeypatch.setattr(placed.PlacedChainSolver, "devices_needed", needed)
    monkeypatch.setattr(driver, "CHARGED_SHARE", 0.0)
    monkeypatch.setattr(driver, "POW2_SHARE", 0.0)
    monkeypatch.setattr(driver, "EXACT_SHARE", 0.0)
    driver._placed_chain(g, opts, time.monotonic(), time.monotonic() + 60)
    assert floors and tried
    assert min(tried) > floors[0]


def test_floor_bisection_stops_at_the_tolerance_it_is_given(monkeypatch):
    """``chain_plan(tolerance=...)`` reaches the node-floor DP as it does the placed one (where the
    driver stops the ``any`` DP early): a looser tolerance takes fewer passes, and its bound lies
    within that tolerance of the full bisection's."""
    g = transformer_graph(16, seed=2, tied=True)
    opts = _opts(64, 8, replication="pow2")
    passes = _counting_passes(monkeypatch)
    found = {}
    for tol in (None, 0.01):
        passes.append(0)
        found[tol] = chain_plan(g, flat_bound(opts, fast=True), time.monotonic(), math.inf, plain=True,
                                machine=opts, bound_only=True, tolerance=tol)
    assert passes[1] < passes[0]
    assert found[None].bound_s * (1 - 0.01) <= found[0.01].bound_s <= found[None].bound_s * (1 + 1e-9)


def test_floor_bisection_settles_when_told(monkeypatch):
    """``chain_plan(settle_by=...)`` reaches the node-floor DP (it had been dropped on the way): past that
    time the bisection stops once it holds a plan, with a bound no higher than the full one's. The
    driver settles the bracket's floor early where the charged DP follows (``driver.FAST_SHARE``): its
    passes near the optimum decide the answer, and on 96 blocks over 1,024 devices the floor's last
    fine steps took the time the second of them needed."""
    g = transformer_graph(16, seed=2, tied=True)
    opts = _opts(64, 8, cost_model="pipedream")
    passes = _counting_passes(monkeypatch)
    found = {}
    for settle in (math.inf, 0.0):  # 0: already past it, so the first plan ends the search
        passes.append(0)
        found[settle] = chain_plan(g, flat_bound(opts, fast=True), time.monotonic(), math.inf, plain=True,
                                   machine=opts, settle_by=settle)
    assert passes[1] < passes[0]
    assert found[0.0].replicas and found[0.0].bound_s <= found[math.inf].bound_s * (1 + 1e-9)


def _counting_passes(monkeypatch) -> list:
    """A list whose last entry counts the node-floor passes run (append a 0 to start a count)."""
    passes, real = [], NodeFloorSolver.devices_needed

    def counted(self, T, *a, **k):
        passes[-1] += 1
        return real(self, T, *a, **k)

    monkeypatch.setattr(NodeFloorSolver, "devices_needed", counted)
    return passes
