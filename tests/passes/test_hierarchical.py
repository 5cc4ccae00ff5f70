"""PipeDream's hierarchical optimizer, reproduced: its published numbers, and fxpipe's exact
two-level search against it."""
from __future__ import annotations

import time

import pytest

from passes.costgraph import CostGraph
from passes.partition import CostOptions, evaluate, partition
from passes.partition.hierarchical import OutOfTime, pipedream_hierarchical
from tests.profiles import PROFILES


def _load(name: str) -> CostGraph:
    return CostGraph.load(PROFILES / f"{name}.txt")


def test_vgg16_two_levels_as_published():
    """``-n 4 4 -b 10000000000 1250000000`` (activations counted): 0.0671 s per minibatch, 12-1-1-1-1."""
    h = pipedream_hierarchical(_load("vgg16"), [4, 4], [1e10, 1.25e9])
    assert round(h.time_s, 4) == 0.0671
    assert h.replicas == [12, 1, 1, 1, 1]
    assert h.ranks[0] == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11] and h.ranks[1:] == [[12], [13], [14], [15]]


@pytest.mark.parametrize("name,K,time_s,layout", [
    ("vgg16", 16, 0.0548, [13, 2, 1]), ("vgg16", 4, 0.1763, [3, 1]), ("alexnet", 8, 0.0151, [7, 1]),
    ("resnet50", 8, 0.0822, [4, 3, 1]),
])
def test_one_level_is_pipedreams_flat_table(name, K, time_s, layout):
    """The rows of examples/pipedream/README.md (one level, -b 1250000000)."""
    h = pipedream_hierarchical(_load(name), [K], [1.25e9])
    assert round(h.time_s, 4) == time_s and h.replicas == layout


def _exact(g: CostGraph, G: int, N: int):
    return partition(g, G * N, bandwidth=1.25e9, intra_bandwidth=1e10, gpus_per_node=G, cost_model="pipedream")


@pytest.mark.parametrize("name,G,N", [("vgg16", 4, 4), ("vgg16", 8, 2), ("alexnet", 4, 4), ("alexnet", 8, 2),
                                      ("resnet18", 4, 4)])
def test_exact_search_is_no_slower_than_level_by_level(name, G, N):
    g = _load(name)
    h = pipedream_hierarchical(g, [G, N], [1e10, 1.25e9])
    res = _exact(g, G, N)
    assert res.status == "OPTIMAL"
    assert res.bottleneck_s <= h.time_s * (1 + 1e-9)
    assert res.hierarchical is not None and res.hierarchical["time_s"] == pytest.approx(h.time_s)


def test_pipedreams_first_stage_discount():
    """Why the exact search is not always below PipeDream's number (squeezenet, -n 4 4).

    PipeDream divides the first top-level stage's inter-node all-reduce of ALL
    its weights by the GPUs of a node, even where its per-node pipeline holds
    most weights on one GPU; fxpipe charges every stage its own weights. So
    PipeDream's own plan, on its own placement, costs more under fxpipe's
    model than PipeDream reports, and fxpipe's optimum lands within 0.5 % of it.
    """
    g = _load("squeezenet1_0")
    h = pipedream_hierarchical(g, [4, 4], [1e10, 1.25e9])
    opts = CostOptions(devices=16, bandwidth=1.25e9, intra_bandwidth=1e10, gpus_per_node=4, cost_model="pipedream")
    placed = evaluate(g, h.assignment, h.replicas, opts, ranks=h.ranks).bottleneck_s
    assert placed > h.time_s * 1.05
    res = _exact(g, 4, 4)
    assert res.bottleneck_s < placed and res.bottleneck_s <= h.time_s * 1.005


def test_reproduction_stops_at_its_deadline():
    """Past its deadline the reproduction raises (``partition`` then gives no comparison) instead of
    finishing tables that grow with the square of the downsets."""
    with pytest.raises(OutOfTime, match="time limit"):
        pipedream_hierarchical(_load("vgg16"), [4, 4], [1e10, 1.25e9], deadline=time.monotonic())


def test_time_limit_holds_with_the_comparison():
    """resnext101 on 4 nodes of 4: the search uses its limit and the reproduction (about 1,000
    downsets, 3.7 s on a slow day) ran after it, past the limit; now it gets what is left of it."""
    start = time.monotonic()
    res = partition(_load("resnext101"), 16, bandwidth=1.25e9, intra_bandwidth=1e10, gpus_per_node=4,
                    cost_model="pipedream", time_limit=2.0)
    assert time.monotonic() - start <= 3.0
    assert res.bound_s <= res.bottleneck_s
