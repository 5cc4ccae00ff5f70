"""Replication none on exactly K devices through the segment DP (passes/partition/stage_count.py):
against brute force over every convex plan of K one-device stages, and at scale where it used to
fall back to CP-SAT."""
from __future__ import annotations

import math
import time

import pytest

from passes.partition import CostOptions, evaluate, is_convex, partition
from passes.partition.segment_plan import chain_plan
from tests.passes.test_partition import B, BAR, brute_force, random_dag, reference_cost
from tests.passes.test_partition_scale import transformer_graph


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
@pytest.mark.parametrize("seed,n,K", [(1, 6, 3), (2, 7, 3), (3, 7, 2), (4, 8, 4), (5, 7, 5), (6, 8, 3), (7, 7, 4)])
def test_exactly_k_stages_matches_brute_force(model, seed, n, K):
    g = random_dag(n, seed, output=seed % 2 == 1)
    opts = CostOptions(devices=K, bandwidth=B, allreduce_bandwidth=BAR, cost_model=model, replication="none")
    res = chain_plan(g, opts, time.monotonic(), math.inf)
    assert res is not None and res.method == "segment DP"
    best = brute_force(g, K, model, [1])
    assert res.replicas == [1] * K and is_convex(g, res.assignment)
    assert res.bottleneck_s == pytest.approx(reference_cost(g, res.assignment, res.replicas, model), rel=1e-9)
    assert best * (1 - 1e-9) <= res.bottleneck_s <= best * 1.001
    assert res.bound_s <= best * (1 + 1e-9)


def test_more_stages_than_the_fewest_on_a_transformer():
    """16 blocks on 32 one-device stages: the segment DP answers and proves it, on exactly 32 stages."""
    g = transformer_graph(16, seed=1)
    res = partition(g, 32, replication="none", time_limit=20)
    assert res.method == "segment DP" and res.status == "OPTIMAL"
    assert res.replicas == [1] * 32 and is_convex(g, res.assignment)
    assert res.bottleneck_s == pytest.approx(evaluate(g, res.assignment, res.replicas, res.options).bottleneck_s,
                                             rel=1e-12)
    fewest = partition(g, 32, replication="none", fewer_devices=True, time_limit=20)
    assert res.bottleneck_s >= fewest.bound_s * (1 - 1e-9)  # at most K stages is the looser question
