"""``side_chains.shrunk``: a wide segment's lattice narrowed by freeing only its side chains, the relaxation
``segment_plan.finer_bound`` searches where a block has more downsets than the exact lattice takes."""
from __future__ import annotations

import itertools
import math

import pytest

from passes.costgraph import CostGraph
from passes.partition import branches, partition, segment_plan, side_chains, wide_segments
from passes.partition.segments import _Lattices, folded_units
from tests.passes.test_anchors import _opts, _wide_best, wide_graph

# the run of ``wide_graph``: q, q_view, q_t, k, k_view, k_t, v, v_view, v_t, att (local predecessors)
RUN = [[], [0], [1], [], [3], [4], [], [6], [7], [2, 5, 8]]
FREE = [False, True, True, False, True, True, False, True, True, False]


def _brute_downsets(local, removed):
    """Subsets of the kept units closed under their (contracted) predecessors, by enumeration."""
    keep = [v for v in range(len(local)) if v not in removed]

    def above(a):
        while a in removed:
            if not local[a]:
                return None
            a = local[a][0]
        return a

    count = 0
    for bits in itertools.product((0, 1), repeat=len(keep)):
        chosen = {v for v, b in zip(keep, bits) if b}
        if all(above(a) is None or above(a) in chosen for v in chosen for a in local[v]):
            count += 1
    return count


def test_chains_are_the_free_branches_and_their_contraction_divides_the_count():
    assert side_chains.chains(RUN, FREE) == [[1, 2], [4, 5], [7, 8]]
    for removed in (set(), {1, 2}, {1, 2, 4, 5}, {1, 2, 4, 5, 7, 8}):
        assert side_chains.downset_count(RUN, removed, 10**4) == _brute_downsets(RUN, removed)
    assert [side_chains.downset_count(RUN, r, 10**4) for r in (set(), {1, 2}, {1, 2, 4, 5})] == [65, 33, 17]
    assert side_chains.downset_count(RUN, set(), 64) is None  # past the cap
    # a unit that joins two branches heads no chain, nor does one whose producer's chain goes on
    joined = [[], [], [0, 1], [2], [3]]
    assert side_chains.chains(joined, [True] * 5) == [[0], [1]]


@pytest.mark.parametrize("seed,K", [(0, 2), (3, 3)])
def test_shrunk_frees_the_cheapest_chains_and_its_bound_lies_between(seed, K):
    """Limit 40, target 20: two of the three reshape chains freed (65 -> 33 -> 17 downsets), the two
    cheapest, the lattice folding builds the one counted, and the bound lies between the relaxation
    that frees all six reshapes and brute force's optimum."""
    g, opts = wide_graph(seed), _opts(K)
    best = _wide_best(seed, K)
    out, freed = side_chains.shrunk(g, opts, limit=40, target=20)
    cost = {b: g.nodes[f"{b}_view"].compute_s + g.nodes[f"{b}_t"].compute_s for b in "qkv"}
    cheap = sorted(cost, key=cost.get)[:2]
    assert sorted(freed) == sorted(f"{b}_{s}" for b in cheap for s in ("view", "t"))
    units, _ = folded_units(out, opts, keep_dead=True)
    (run,) = [r for r in wide_segments.wide_runs(units, limit=10)]
    assert len(_Lattices(units, 10**4).downsets(list(run), False)) == 17

    def bound(graph, nodes):
        _, lower, margin = segment_plan.segment_dp(graph, opts, math.inf,
                                                   hidden=lambda u: branches.forced_compute(g, u, nodes))
        return lower.bound - margin

    loose, every = wide_segments.relaxed(g, opts, limit=40)
    assert len(every) == 6
    assert bound(loose, every) * (1 - 1e-3) <= bound(out, freed) <= best * (1 + 1e-9)
    assert side_chains.shrunk(g, opts, limit=80, target=20) is None  # nothing that wide


def test_finer_bound_shrinks_a_segment_past_its_limit(monkeypatch):
    """Past ``MAX_DOWNSETS`` (40 here) ``finer_bound`` frees the side chains down to half of it, not
    every weightless node: its bound holds and is no lower than the one that frees them all."""
    g, opts = wide_graph(0), _opts(2)
    best = _wide_best(0, 2)
    monkeypatch.setattr(segment_plan, "MAX_DOWNSETS", 40)
    shrunk = segment_plan.finer_bound(g, opts, math.inf, [], [], 0.0, best)
    seen = []
    real = side_chains.shrunk
    monkeypatch.setattr(side_chains, "shrunk", lambda *a, **k: seen.append(a[2:4]) or real(*a, **k))
    assert segment_plan.finer_bound(g, opts, math.inf, [], [], 0.0, best) == shrunk and seen == [(40, 20)]
    monkeypatch.setattr(side_chains, "shrunk", lambda graph, o, limit, target, deadline:
                        wide_segments.relaxed(graph, o, limit, deadline))
    freed_all = segment_plan.finer_bound(g, opts, math.inf, [], [], 0.0, best)
    assert freed_all * (1 - 1e-3) <= shrunk <= best * (1 + 1e-9)


def test_bundled_phi3_proven_on_32_devices():
    """HF Phi3, 24 layers: its attention blocks have 12,041 downsets, past the exact lattice's 4,000.
    Freed whole, the bound left 32 devices 3.2 % open at 10 s; with its side chains freed down to
    2,000 downsets a block the plan is proven within 1 % (0.015 % here)."""
    from tools.bench import partition_scale as bench

    graph = CostGraph.load(bench.BUNDLED / "hf-phi3-24-profile.json.gz")
    res = partition(graph, 32, time_limit=10)
    assert res.gap <= 0.01, (res.gap, res.bottleneck_s, res.bound_s)
    assert graph.total_compute_s() / 32 <= res.bound_s <= res.bottleneck_s


def test_a_segment_longer_than_max_units_is_freed_whole_uncounted(monkeypatch):
    """HF Gemma's graph is one segment of 1,517 units: counting it is time spent for nothing, so a
    segment longer than ``MAX_UNITS`` is freed whole, as ``relaxed`` frees it, and never counted."""
    g, opts = wide_graph(0), _opts(2)
    monkeypatch.setattr(side_chains, "MAX_UNITS", 5)  # the run has 10 units

    def no_count(*a, **k):
        raise AssertionError("counted")

    monkeypatch.setattr(side_chains, "downset_count", no_count)
    out, freed = side_chains.shrunk(g, opts, limit=40, target=20)
    loose, every = wide_segments.relaxed(g, opts, limit=40)
    assert sorted(freed) == sorted(every) and out == loose
