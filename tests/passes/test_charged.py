"""Pieces of the charged placed DP (``passes/partition/charged.py``) that its speed rests on."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from passes.errors import FxpipeError
from passes.partition.charged import ChargedChainSolver, _packed, _CHARGED, _Charged, _LOW, _REPS, _VAL
from passes.partition.costmodel import allreduce_span, stage_time_s
from passes.partition.offsets import EPS
from passes.partition.segments import build_segments, folded_units
from tests.passes.test_partition_scale import _uniform_blocks, transformer_graph
from tests.passes.test_placed import _opts


def _solver(K=64, G=8, **kw) -> ChargedChainSolver:
    opts = _opts(K, G, **kw)
    units, _ = folded_units(transformer_graph(3, seed=4), opts)
    return ChargedChainSolver(units, build_segments(units), opts)


def test_packed_orders_like_the_tuple_and_unpacks():
    """One minimum over packed integers keeps the fewest devices, then the fewest replicas: what the
    per-column comparisons it replaced kept (columns rise in r, ties kept the first)."""
    triples = list(itertools.product([0, 1, 5, 1025], [0, 1, 7, 1024], [0, 3, 7]))
    packed = _packed(*(np.array(x) for x in zip(*triples)))
    assert [triples[i] for i in np.argsort(packed, kind="stable")] == sorted(triples)
    assert np.array_equal(packed >> _VAL, [t[0] for t in triples])
    assert np.array_equal((packed >> _REPS) & _LOW, [t[1] for t in triples])
    assert np.array_equal(packed & _LOW, [t[2] for t in triples])


@pytest.mark.parametrize("model", ["pipedream", "fxpipe"])
def test_flat_fits_equal_the_stage_times(model):
    """Under PipeDream's charges the flat models' answers are thresholds worked out once per T; they
    must equal the stage times evaluated count by count (fxpipe's are evaluated)."""
    solver = _solver(cost_model=model, replication="any" if model == "pipedream" else "pow2")
    rng = np.random.default_rng(3)
    n, K = 300, solver.opts.devices
    C = rng.uniform(1e-5, 3e-3, n)
    params = rng.uniform(0, 3e8, n)
    tied = np.where(rng.random(n) < 0.3, rng.uniform(0, 5e7, n), 0.0)
    zeros, T = np.zeros(n), 1e-4
    stages = (C, params, zeros, zeros, tied, np.zeros(n, bool), np.zeros(n, bool), None, None)
    ch = solver._stage_intervals(stages, T)
    col = _Charged(*(x[:, None] for x in ch))
    for r in range(1, K + 1):
        fast, slow = solver._flat_fits(col, np.full((n, 1), r), T)
        for got, flat in zip((fast, slow), solver.flat):
            want = stage_time_s(C, params, 0.0, 0.0, r, flat, tied, ch.partners) <= T * (1 + EPS)
            assert np.array_equal(got[:, 0], want), (r, np.nonzero(got[:, 0] != want))
    assert len(_CHARGED) == len(ch)


def test_span_table_is_the_charge_per_byte():
    """``_span[r, m]`` times the bytes is ``allreduce_span`` at every count and offset."""
    solver = _solver(K=96, G=8, cost_model="pipedream")
    P = 3.7e8
    r = np.arange(97)[:, None]
    m = np.arange(8)[None, :]
    assert np.allclose(P * solver._span, allreduce_span(P, m, r, solver.opts), rtol=1e-12, atol=0)


def test_more_devices_than_the_packed_field_holds_is_refused():
    with pytest.raises(FxpipeError, match="20 bits"):
        _solver(K=1 << 20, G=8, cost_model="pipedream")


@pytest.mark.parametrize("K,G,tied", [(64, 8, True), (48, 4, False), (256, 8, True)])
def test_settled_pairs_give_the_column_loops_answer(monkeypatch, K, G, tied):
    """Under PipeDream's charges the pairs that fit at every offset from some count on skip the column
    loop from there (``_settled``); the fewest devices and every back-pointer must be what the loop
    alone finds, at T from the bound up, and the shortcut must really have taken pairs."""
    opts = _opts(K, G, cost_model="pipedream")
    units, _ = folded_units(transformer_graph(4, seed=5, tied=tied), opts)
    segs = build_segments(units)
    ideal = sum(units.compute) / K
    taken = []
    real = ChargedChainSolver._settled

    def counting(self, rows, s, ch):
        out = real(self, rows, s, ch)
        taken.append(0 if out is None else out[0].size)
        return out

    answers = {}
    for name, settle in (("settled", counting), ("loop", lambda *a: None)):
        monkeypatch.setattr(ChargedChainSolver, "_settled", settle)
        solver = ChargedChainSolver(units, segs, opts)
        answers[name] = [solver.devices_needed(ideal * f) for f in (1.0, 1.01, 1.05, 1.2, 2.0)]
    assert sum(taken) > 0
    for (need, back), (want, want_back) in zip(answers["settled"], answers["loop"]):
        assert need == want
        assert np.array_equal(back, want_back)


@pytest.mark.parametrize("model,replication", [("pipedream", "any"), ("fxpipe", "pow2")])
def test_room_skips_counts_without_changing_the_answer(monkeypatch, model, replication):
    """A pass tries no count that leaves its end point more devices than the compute after it can
    spare (``room``): such an end is dropped anyway. The fewest devices and the plan must be what the
    pass finds without that cut, at T from the bound up, and counts must really have been skipped."""
    opts = _opts(64, 8, cost_model=model, replication=replication)
    units, _ = folded_units(transformer_graph(4, seed=5, tied=True), opts)
    segs = build_segments(units)
    ideal = sum(units.compute) / opts.devices
    real, skipped = ChargedChainSolver._charged_best, []

    def counting(self, rows, s, ch, T, room=None, known=None, cuts=None):
        cols, inside, _ = self._candidates(ch)
        after = rows[s].min(axis=1)[:, None] + cols  # the fewest devices each tried count can end on
        tried = inside & (after <= self.opts.devices)
        skipped.append(0 if room is None else int((tried & (after > room[:, None])).sum()))
        return real(self, rows, s, ch, T, room, known, cuts)

    def every_count(self, rows, s, ch, T, room=None, known=None, cuts=None):
        return real(self, rows, s, ch, T, known=known, cuts=cuts)

    answers = {}
    for name, targets in (("room", counting), ("all", every_count)):
        monkeypatch.setattr(ChargedChainSolver, "_charged_best", targets)
        answers[name] = _passes(ChargedChainSolver(units, segs, opts), ideal)
    assert sum(skipped) > 0
    assert answers["room"] == answers["all"]


def _passes(solver: ChargedChainSolver, ideal: float, factors=(1.0, 1.01, 1.05, 1.2, 2.0)) -> list:
    """(fewest devices, plan or None) of ``solver``'s passes at T from ``ideal`` (sum C / K) up."""
    out = []
    for f in factors:
        need, back = solver.devices_needed(ideal * f)
        out.append((need, solver.plan(back) if need <= solver.opts.devices else None))
    return out


@pytest.mark.parametrize("model,replication", [("pipedream", "any"), ("fxpipe", "pow2"), ("pipedream", "pow2")])
def test_repeated_blocks_reuse_what_fits_without_changing_the_answer(monkeypatch, model, replication):
    """Whether a stage fits at a start offset depends on the stage, not on the devices before it, so a
    pass works it out once per level of equal blocks at a T (``_known_fits``) and the later blocks
    read it. The fewest devices and the plans must be those of passes that work it out block by block,
    at T from the bound up, and the tables must really have been read."""
    from tools.bench.partition_scale import deep_gpt

    opts = _opts(64, 8, cost_model=model, replication=replication)
    units, _ = folded_units(deep_gpt(4), opts)  # four equal blocks (one profiled block repeated)
    segs = build_segments(units)
    ideal = sum(units.compute) / opts.devices
    real, read = ChargedChainSolver._known_fits, []

    def recording(self, *args):
        out = real(self, *args)
        read.append(out is not None)
        return out

    answers = {}
    for name, known in (("known", recording), ("per block", lambda self, *args: None)):
        monkeypatch.setattr(ChargedChainSolver, "_known_fits", known)
        # infeasible, just feasible, loose (on 4 blocks a pass takes 2-3 s: the suite keeps three)
        answers[name] = _passes(ChargedChainSolver(units, segs, opts), ideal, (1.0, 1.05, 2.0))
    assert any(read)
    assert answers["known"] == answers["per block"]


@pytest.mark.parametrize("model,replication", [("pipedream", "any"), ("fxpipe", "pow2")])
def test_counts_below_the_node_floor_are_not_tried_and_change_nothing(monkeypatch, model, replication):
    """Past G ranks no placement charges a stage less than the nodes it must touch
    (``node_floor.NodeFloor``), so the charged DP starts a stage's candidate counts at the floor's
    fewest instead of the faster flat model's: the counts between fit at no offset. The fewest devices
    and the plans must be those of passes that try them, at T from the bound up, on a machine where
    stages need more than G replicas, and fewer (pair, count) cells must have been checked."""
    opts = _opts(256, 8, cost_model=model, replication=replication)
    units, _ = folded_units(_uniform_blocks(4), opts)
    segs = build_segments(units)
    ideal = sum(units.compute) / opts.devices
    real, cells = ChargedChainSolver._column_fits, []

    def counted(self, ch, live, r, exact, T):
        cells[-1] += live.size
        return real(self, ch, live, r, exact, T)

    monkeypatch.setattr(ChargedChainSolver, "_column_fits", counted)
    answers, checked = {}, {}
    for name in ("floor", "every count"):
        solver, cells[:] = ChargedChainSolver(units, segs, opts), [0]
        assert solver._floor is not None
        if name == "every count":
            solver._floor = None
        answers[name], checked[name] = _passes(solver, ideal), cells[0]
    assert answers["floor"] == answers["every count"]
    assert any(need <= opts.devices for need, _ in answers["floor"])
    assert checked["floor"] < checked["every count"]


def test_pool_rows_of_repeated_blocks_reused_without_changing_the_answer(monkeypatch):
    """The placed DPs work out each pool row's stages once per T among equal runs of segments
    (``PlacedChainSolver._pool_stages``, ``ChainSolver.row_keys``). The fewest devices and the plans
    must be those of passes that work out every row, for both placed DPs, and fewer rows worked out."""
    from passes.partition import chain
    from passes.partition.placed import PlacedChainSolver

    g = _uniform_blocks(16)
    for model, replication, kind in (("fxpipe", "any", PlacedChainSolver), ("pipedream", "any", ChargedChainSolver),
                                     ("fxpipe", "pow2", ChargedChainSolver)):
        opts = _opts(64, 8, cost_model=model, replication=replication)
        units, _ = folded_units(g, opts)
        segs = build_segments(units)
        ideal = sum(units.compute) / opts.devices
        real, rows = kind._pool_stages_of, [0]

        def counted(self, pool, seg, T):
            rows[0] += pool[0].size
            return real(self, pool, seg, T)

        monkeypatch.setattr(kind, "_pool_stages_of", counted)
        answers, worked = {}, {}
        for name in ("reused", "every row"):
            if name == "every row":
                monkeypatch.setattr(chain.ChainSolver, "row_keys", lambda self, a, gid: [None] * gid.size)
            rows[0] = 0
            answers[name], worked[name] = _passes(kind(units, segs, opts), ideal), rows[0]
        monkeypatch.undo()
        assert answers["reused"] == answers["every row"], (model, replication)
        assert any(need <= opts.devices for need, _ in answers["reused"])
        assert worked["reused"] < 0.75 * worked["every row"], (model, replication, worked)


@pytest.mark.parametrize("model", ["pipedream", "fxpipe"])
def test_rising_over_allowed_counts_is_the_least_allowed_from_which_all_fit(model):
    """Under pow2 the bisection asks only the allowed counts (``_rising_from(allowed=...)``): per stage
    the least allowed count >= 2 from which every larger allowed count meets T (K + 1 if the largest
    does not), by brute force over random stages, tied weights included (fxpipe's tied ring rises
    again)."""
    from passes.partition.charged import _rising_from

    solver = _solver(K=512, G=8, cost_model=model, replication="pow2")
    rng = np.random.default_rng(7)
    n, K = 400, solver.opts.devices
    C = rng.uniform(1e-5, 3e-3, n)
    params = rng.uniform(0, 3e8, n)
    tied = np.where(rng.random(n) < 0.4, rng.uniform(0, 5e7, n), 0.0)
    q = rng.integers(1, 64, n).astype(float)
    allowed = np.asarray(solver.opts.allowed_replicas(), dtype=np.int64)
    for T in (2e-5, 1e-4, 5e-4):
        for flat in solver.flat:
            def time_at(r, k):
                return stage_time_s(C[k], params[k], 0.0, 0.0, r, flat, tied[k], q[k])
            got = _rising_from(time_at, n, T, K, allowed)
            counts = allowed[allowed >= 2]
            fits = np.stack([time_at(np.full(n, r), slice(None)) <= T * (1 + EPS) for r in counts], axis=1)
            want = np.full(n, K + 1)
            for i in range(n):
                for j in range(counts.size - 1, -1, -1):  # walk down while every larger allowed count fits
                    if not fits[i, j]:
                        break
                    want[i] = counts[j]
            assert np.array_equal(got, want), (T, np.nonzero(got != want))


def test_rising_from_a_guess_is_the_bisection_answer():
    """Under PipeDream's charges with any count the bisection starts from the root of the flat time's
    quadratic (``_pipedream_rise``) and asks it and its neighbour first, and takes it unasked where the
    stage has no tied weight and the root is clear of an integer: per stage the same least count as
    bisection from scratch, with tied weights (whose falling term puts the answer above the guess),
    every weight size from none to a time that never meets T, T in several decades, and a fifth of
    the stages built so that their root is an integer (where rounding decides, so they are asked)."""
    from passes.partition.charged import _pipedream_rise, _rising_from

    solver = _solver(K=1024, G=8, cost_model="pipedream", replication="any")
    rng = np.random.default_rng(11)
    n, K = 2000, solver.opts.devices
    C0 = rng.uniform(1e-6, 3e-3, n)
    params = np.where(rng.random(n) < 0.1, 0.0, 10 ** rng.uniform(2, 9, n))
    tied = np.where(rng.random(n) < 0.3, params * rng.random(n), 0.0)
    q = rng.integers(1, 64, n).astype(float)
    root = rng.integers(2, K + 3, n).astype(float)
    on_root = rng.random(n) < 0.2
    for T in (3e-6, 2e-5, 1e-4, 5e-4, 2e-3):
        for flat in solver.flat:
            b = 4.0 * (params - tied) / flat.bandwidth  # C from T·r^2 - (C + b)·r + b = 0 at r = root
            C = np.where(on_root & (T * root - b + b / root > 0), T * root - b + b / root, C0)

            def time_at(r, k):
                return stage_time_s(C[k], params[k], 0.0, 0.0, r, flat, tied[k], q[k])
            want = _rising_from(time_at, n, T, K)
            guess, clear = _pipedream_rise(C, params - tied, T, flat.bandwidth)
            got = _rising_from(time_at, n, T, K, guess=guess)
            assert np.array_equal(got, want), (T, np.nonzero(got != want))
            sure = clear & (tied == 0)
            assert sure.mean() > 0.4 and not sure[on_root & (C != C0)].any()
            read = _rising_from(time_at, n, T, K, guess=guess, sure=sure)
            assert np.array_equal(read, want), (T, np.nonzero(read != want))
            settled = (want <= K) & (want > 2)
            untied = settled & (tied == 0)
            assert np.abs(guess[untied] - want[untied]).max() <= 1  # the root is the answer, rounding aside
            assert (guess[settled] <= want[settled] + 1).all()  # a tied sync only adds time


def _crossing_chain():
    """input -> s0 (1.8 ms, 8 MB of weights) -> a (4 ms) -> b (1 ms) -> c (1 ms) -> output, with 22.5
    MB cut after ``a``: on 8 devices in nodes of 4 at 1 ms, 2 + 4 + 1 + 1 replicas are the only
    counts (one stage of 8 syncs s0's weights across nodes: 2.1 ms), so ``a`` sits on ranks 2-5
    across the node boundary and ``b``'s one rank receives from two ranks in each node (2.0 ms);
    each side alone, at its cheapest, looks like 0.9 and 0.45 ms."""
    from passes.costgraph import CostGraph, CostNode

    spec = [("n0", 0.0, 1000, 0), ("s0", 1.8e-3, 1000, 8_000_000), ("a", 4e-3, 22_500_000, 0),
            ("b", 1e-3, 1000, 0), ("c", 1e-3, 1000, 0), ("out", 0.0, 0, 0)]
    nodes = {name: CostNode(name=name, op="placeholder" if name == "n0" else "output" if name == "out"
                            else "call_module", target="t", fwd_s=c / 3, bwd_s=2 * c / 3, out_bytes=nb,
                            param_bytes=pb, is_input=name == "n0") for name, c, nb, pb in spec}
    names = [name for name, *_ in spec]
    return CostGraph(nodes=nodes, edges=list(zip(names, names[1:])))


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
def test_exact_cuts_charge_a_rank_whose_partners_sit_in_two_nodes(model):
    """With the previous stage's count in the state (``exact_cuts``) the pass charges the cut into
    ``b`` as its ranks pay it: 1 ms is infeasible, and the fewest devices at the optimum (the placed
    downset DP, exact for ``evaluate``) and just under it are what that DP says; the plain pass takes
    1 ms for feasible (each side at its cheapest), so only the exact one proves the optimum."""
    from tests.passes.test_placed import _exact

    g = _crossing_chain()
    opts = _opts(8, 4, cost_model=model, replication="pow2")
    units, _ = folded_units(g, opts)
    segs = build_segments(units)
    plain, exact = ChargedChainSolver(units, segs, opts), ChargedChainSolver(units, segs, opts, exact_cuts=True)
    assert plain.devices_needed(1e-3 * (1 + 1e-9))[0] <= 8
    assert exact.devices_needed(1e-3 * (1 + 1e-9))[0] > 8
    best = _exact(g, opts)
    assert best > 1.005e-3
    assert exact.devices_needed(best * (1 + 1e-9))[0] <= 8
    assert exact.devices_needed(best * (1 - 1e-6))[0] > 8


def test_exact_cuts_refused_without_pow2():
    opts = _opts(16, 4, replication="any")
    units, _ = folded_units(_crossing_chain(), opts)
    with pytest.raises(FxpipeError, match="pow2"):
        ChargedChainSolver(units, build_segments(units), opts, exact_cuts=True)


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
@pytest.mark.parametrize("seed,K,G", [(s, K, G) for s in range(4) for K, G in ((8, 4), (16, 4), (8, 2), (16, 8))])
def test_exact_cuts_bound_meets_the_placed_optimum_on_chains(model, seed, K, G):
    """On weightless-enough chains with heavy cuts (nothing folds, no tied weight), the exact-cut pass's
    feasibility flips at the optimum of the placed downset DP: never infeasible at it (the bound stays
    a bound), never feasible just under it."""
    import random

    from tests.passes.test_partition import make_graph
    from tests.passes.test_placed import _exact, _light_cuts

    g = _light_cuts(make_graph(8, [(i, i + 1) for i in range(7)], random.Random(50 + seed), output=True), 4.0)
    opts = _opts(K, G, cost_model=model, replication="pow2")
    units, _ = folded_units(g, opts)
    solver = ChargedChainSolver(units, build_segments(units), opts, exact_cuts=True)
    best = _exact(g, opts)
    assert solver.devices_needed(best * (1 + 1e-9))[0] <= K
    assert solver.devices_needed(best * (1 - 1e-6))[0] > K


@pytest.mark.parametrize("model", ["pipedream", "fxpipe"])
def test_pool_answered_in_chunks_as_at_once(monkeypatch, model):
    """``_from_pool`` takes the pool ``POOL_CHUNK`` pairs at a time and keeps each point's best across
    chunks, the earliest source on a tie: a pass with chunks of one pool row gives the devices and the
    back-pointers of a pass with the whole pool at once, at several T (feasible and not)."""
    import passes.partition.charged as charged

    def run(chunk):
        monkeypatch.setattr(charged, "POOL_CHUNK", chunk)
        solver = _solver(K=64, G=8, cost_model=model, replication="pow2" if model == "fxpipe" else "any")
        low = float(np.sum(solver.units.compute)) / 64
        return [solver.devices_needed(low * f) for f in (1.0, 1.3, 1.8, 3.0)]

    whole, one_row = run(1 << 40), run(1)
    for (need_a, back_a), (need_b, back_b) in zip(whole, one_row):
        assert need_a == need_b
        assert np.array_equal(back_a, back_b)
    assert any(need <= 64 for need, _ in whole) and any(need > 64 for need, _ in whole)


def test_fewest_count_under_pipedream_from_the_rising_threshold():
    """Under PipeDream's charges a stage's fewest count at the faster flat model is one where one
    replica meets T, else the count from which its time (falling from r = 2 on) meets T: what
    ``_stage_intervals`` reads instead of ``min_replicas``; equal to it on random stages, tied weights
    included, with any count and with powers of two."""
    from passes.partition.charged import _one_fits, _pipedream_rise, _rising_from
    from passes.partition.costmodel import min_replicas

    rng = np.random.default_rng(3)
    n = 3000
    C = rng.uniform(1e-6, 3e-3, n)
    params = np.where(rng.random(n) < 0.1, 0.0, 10 ** rng.uniform(2, 9, n))
    tied = np.where(rng.random(n) < 0.3, params * rng.random(n), 0.0)
    q = rng.integers(1, 64, n).astype(float)
    for replication in ("any", "pow2"):
        solver = _solver(K=1024, G=8, cost_model="pipedream", replication=replication)
        fast, K = solver.flat[0], solver.opts.devices
        allowed = np.asarray(solver.opts.allowed_replicas(), dtype=np.int64) if replication == "pow2" else None
        for T in (3e-6, 2e-5, 1e-4, 5e-4, 2e-3):
            def time_at(r, k):
                return stage_time_s(C[k], params[k], 0.0, 0.0, r, fast, tied[k], q[k])
            one = _one_fits(time_at, C, tied == 0, T)  # untied stages: their compute, unasked
            guess, clear = (None, None) if allowed is not None else _pipedream_rise(C, params - tied, T, fast.bandwidth)
            sure = None if clear is None else clear & (tied == 0)
            got = np.where(one, 1, _rising_from(time_at, n, T, K, allowed, guess, sure))
            want = np.minimum(min_replicas(C, params, 0.0, 0.0, T, fast, tied, q), K + 1)
            assert np.array_equal(got, want), (replication, T, np.nonzero(got != want))
