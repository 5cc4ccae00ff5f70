"""``ChainSolver._near`` keeps the counts of the passes bracketing the next T (``_bracketing``) and works
out again only the pairs whose counts differ there. Every count is the fewest replicas meeting T, so it
never rises with T: the counts must equal a fresh solver's at every T of a bisection, under both cost
models, counted from below (``floor_counts``), and under ``1f1b-stash``'s rule for one count or a range."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from passes.partition import CostOptions, chain
from passes.partition.segments import build_segments, folded_units
from tests.passes.test_partition_scale import transformer_graph

CASES = [  # (tied, options beside devices, floor_counts)
    (False, {}, False),
    (False, {}, True),
    (False, {"cost_model": "pipedream"}, False),
    (True, {}, False),
    (True, {"schedule": "1f1b-stash", "tied_replicas": 2}, False),
    (True, {"schedule": "1f1b-stash", "tied_replicas": 1, "tied_replicas_upto": 4}, False),
]


@pytest.mark.parametrize("tied,extra,floor_counts", CASES)
def test_counts_kept_between_passes_equal_fresh_ones(tied, extra, floor_counts, monkeypatch):
    g = transformer_graph(6, seed=4, tied=tied)
    opts = dataclasses.replace(CostOptions(devices=64), **extra)
    units, _ = folded_units(g, opts)
    segs = build_segments(units)
    kept = chain.ChainSolver(units, segs, opts, floor_counts=floor_counts)
    counted = []  # pairs each ``_near_slice`` call of the kept solver works out
    real = chain.ChainSolver._near_slice

    def slice_counted(self, ends, pairs, a, b, T, one):
        if self is kept:
            counted.append(b - a)
        return real(self, ends, pairs, a, b, T, one)

    monkeypatch.setattr(chain.ChainSolver, "_near_slice", slice_counted)
    ideal = sum(units.compute) / opts.devices
    lo, hi, per_pass = ideal, 3 * ideal, []
    for T in [hi, lo * 1.01] + [None] * 8:  # a bisection's Ts, each pass's side by its devices
        T = T if T is not None else (lo + hi) / 2
        counted.clear()
        got = kept._near(T)
        fresh = chain.ChainSolver(units, segs, opts, floor_counts=floor_counts)._near(T)
        assert len(got) == len(fresh)
        for x, y in zip(got, fresh):
            assert np.array_equal(x, y), T
        per_pass.append(sum(counted))
        need, _ = kept.devices_needed(T)
        lo, hi = (T, hi) if need > opts.devices else (lo, T)
    assert kept._near_seen and len(kept._near_seen) <= 3
    assert max(per_pass[2:]) < per_pass[0]  # once bracketed, fewer pairs than the first pass worked out


def test_counts_not_kept_are_worked_out_when_a_segment_reads_them(monkeypatch):
    """Where the counts are not kept between passes, ``_near`` works out each distinct set when the pass
    first reads it (``_PerSegment``): a pass far under the optimum stops where nothing can start the next
    stage, and the sets after that are never counted; the devices and plans are those of a pass that
    counts every set first, at T under, near and above the optimum."""
    g = transformer_graph(6, seed=4, tied=False)
    opts = CostOptions(devices=64)
    units, _ = folded_units(g, opts)
    segs = build_segments(units)
    monkeypatch.setattr(chain, "NEAR_CACHED", 0)  # nothing kept: the lazy path
    counted = []
    real = chain.ChainSolver._near_set

    def tallied(self, s, *args):
        counted.append(s)
        return real(self, s, *args)

    monkeypatch.setattr(chain.ChainSolver, "_near_set", tallied)
    ideal = sum(units.compute) / opts.devices
    lazy, eager = chain.ChainSolver(units, segs, opts), chain.ChainSolver(units, segs, opts)
    eager_near = eager._near

    def every_set(T):
        near = eager_near(T)
        return [near[a] for a in range(len(near))]  # all read at once, before the DP

    eager._near = every_set
    for f in (0.2, 1.0, 1.05, 1.3, 3.0):
        counted.clear()
        got = lazy.devices_needed(ideal * f)
        lazy_sets = len(set(counted))
        want = eager.devices_needed(ideal * f)
        assert got[0] == want[0] and np.array_equal(got[1], want[1]), f
        if f == 0.2:  # infeasible early: only the sets of the segments it reached
            assert got[0] > opts.devices and lazy_sets < len(lazy._pairs[0])
