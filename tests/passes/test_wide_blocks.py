"""Wide blocks (``wide_blocks.py``): on a GPU profile every node costs about a kernel launch, shape
reads stop folding away and a GPT block has ~1,600 downsets; the planner first plans on the narrow
lattice where they fold, then the exact lattice proves that plan or beats it.

The graph is the benchmark GPT profiled on an H100 (``tools/bench/data/h100``), repeated to 16 blocks.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from passes.costgraph import CostGraph
from passes.partition import CostOptions, partition, wide_blocks
from passes.partition.chain import solve as chain_solve, unit_bottleneck
from passes.partition.segments import build_segments, folded_units
from tools.bench.partition_scale import deep_gpt

H100 = Path(__file__).resolve().parents[2] / "tools" / "bench" / "data" / "h100" / "gpt-2block-profile.json"


@pytest.fixture(scope="module")
def gpt16() -> CostGraph:
    return deep_gpt(16, CostGraph.load(H100))


def _fine(graph: CostGraph, opts: CostOptions):
    ideal = graph.total_compute_s() / opts.devices
    return folded_units(graph, opts, tiny=1e-5 * ideal, tiny_silent=1e-3 * ideal, tiny_input=0.02 * ideal)


def test_the_gpu_profile_makes_wide_blocks_and_the_narrow_plan_is_bounded_by_the_exact_optimum(gpt16) -> None:
    opts = CostOptions(devices=64)
    units, folded = _fine(gpt16, opts)
    segs = build_segments(units)
    assert wide_blocks.wide(segs)  # what the module is for
    ideal = gpt16.total_compute_s() / opts.devices
    first = wide_blocks.first_plan(gpt16, opts, time.monotonic() + 60, 0.0,
                                   dict(tiny=1e-5 * ideal, tiny_input=0.02 * ideal))
    assert first is not None and len(first.units) < len(units)
    exact = chain_solve(units, segs, opts, math.inf, lambda so, r: unit_bottleneck(units, so, r, opts))
    assert exact.complete
    assert first.bound_s <= exact.bound * (1 + 1e-9)  # a bound of the optimum, as the exact lattice's
    assert first.real_s >= first.bound_s
    assert first.real_s <= exact.objective * 1.01  # and its plan near it (equal here)


def test_partition_answers_as_the_exact_lattice_alone_does(gpt16, monkeypatch) -> None:
    """Same plan time and a bound as high, with the narrow lattice first and without it."""
    got = partition(gpt16, 64, time_limit=30)
    monkeypatch.setattr(wide_blocks, "WIDE", 10 ** 9)
    alone = partition(gpt16, 64, time_limit=30)
    assert alone.status == got.status == "OPTIMAL"
    assert got.bottleneck_s <= alone.bottleneck_s * (1 + 1e-9)
    assert got.bound_s >= alone.bound_s * (1 - 1e-3)
    assert got.bound_s <= got.bottleneck_s
