"""The order DP by bisection on T (``order_bisect``) against the exact table (``heuristic.order_dp``)."""
from __future__ import annotations

import random
import time

import pytest

from passes.costgraph import CostGraph
from passes.partition import driver, heuristic, order_bisect
from passes.partition.coarsen import build_units, model_nodes
from passes.partition.costmodel import CostOptions
from tests.passes.test_partition import random_dag
from tests.profiles import PROFILES


def _units(g: CostGraph, opts: CostOptions):
    return build_units(g, opts, [[n] for n in model_nodes(g, opts)])


def _check(units, opts: CostOptions, order) -> tuple:
    """(exact, bisected) on ``order``; the bisected plan is contiguous on it and uses the devices asked."""
    exact = heuristic.order_dp(units, opts, order)
    found = order_bisect.bisected(units, opts, order)
    assert (exact is None) == (found is None)
    if found is None:
        return exact, found
    stages = [found.stage_of[u] for u in order]
    assert stages == sorted(stages) and set(stages) == set(range(len(found.replicas)))
    assert sum(found.replicas) == opts.devices if not opts.fewer_devices else sum(found.replicas) <= opts.devices
    assert set(found.replicas) <= set(opts.allowed_replicas())
    assert exact.objective * (1 - 1e-9) <= found.objective <= exact.objective * (1 + order_bisect.TOLERANCE)
    return exact, found


@pytest.mark.parametrize("name", ["gnmt", "gnmt_large", "vgg16", "resnet50", "alexnet"])
@pytest.mark.parametrize("replication", ["any", "pow2"])
@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
@pytest.mark.parametrize("K", [3, 16, 96])
def test_matches_the_exact_table_on_pipedream_profiles(name, replication, model, K):
    g = CostGraph.load(PROFILES / f"{name}.txt")
    opts = CostOptions(devices=K, bandwidth=1.25e9, cost_model=model, replication=replication)
    units = _units(g, opts)
    for order in heuristic.topo_orders(units):
        _check(units, opts, order)


@pytest.mark.parametrize("seed", range(12))
def test_matches_the_exact_table_on_random_graphs(seed):
    rng = random.Random(seed)
    g = random_dag(rng.randint(4, 14), seed)
    opts = CostOptions(devices=rng.randint(2, 40), bandwidth=rng.choice([1e8, 1e9, 1e10]),
                       cost_model=rng.choice(["fxpipe", "pipedream"]), replication=rng.choice(["any", "pow2"]),
                       fewer_devices=rng.random() < 0.3)
    units = _units(g, opts)
    for order in heuristic.topo_orders(units):
        _check(units, opts, order)


@pytest.mark.parametrize("name, K, replication", [("gnmt", 16, "any"), ("vgg16", 16, "pow2")])
def test_a_plan_padding_misses_is_found_on_exactly_k(name, K, replication, monkeypatch):
    """Fewest devices at the best T leave devices no stage can take without slowing past T (gnmt: 7
    stages on 7 devices; vgg16 under pow2: 15 devices, and no stage can double): the exact-count rows
    find the plan with more stages."""
    ran = []
    counts = order_bisect._counts
    monkeypatch.setattr(order_bisect, "_counts", lambda *a: ran.append(1) or counts(*a))
    g = CostGraph.load(PROFILES / f"{name}.txt")
    opts = CostOptions(devices=K, bandwidth=1.25e9, replication=replication)
    units = _units(g, opts)
    exact, found = _check(units, opts, heuristic.topo_orders(units)[0])
    assert ran and found is not None


def test_past_the_deadline_it_gives_up():
    g = CostGraph.load(PROFILES / "gnmt_large.txt")
    opts = CostOptions(devices=256)
    units = _units(g, opts)
    assert order_bisect.bisected(units, opts, heuristic.topo_orders(units)[0], time.monotonic() - 1) is None


def test_only_large_tables_are_bisected(monkeypatch):
    calls = []
    monkeypatch.setattr(order_bisect, "bisected", lambda *a: calls.append(a[1].devices) or None)
    g = CostGraph.load(PROFILES / "gnmt.txt")
    for K in (4, 256):
        opts = CostOptions(devices=K)
        assert order_bisect.best_order_dp(_units(g, opts), opts) is not None  # the table's, where bisection fails
    assert calls and set(calls) == {256}


def test_gnmt_large_on_256_devices_is_proven_by_the_order_dp(monkeypatch):
    """The segment DP's restricted plans miss the optimum by 5 % while its bound is tight; the order DP's
    plan meets that bound, so CP-SAT (which took 7 s after 7 s of table DPs here) is not started."""
    monkeypatch.setattr(driver, "_cp_sat", lambda *a, **k: pytest.fail("CP-SAT started"))
    g = CostGraph.load(PROFILES / "gnmt_large.txt")
    res = driver.partition(g, 256, time_limit=10)
    assert res.status == "OPTIMAL" and res.method.startswith("order DP")
    assert res.gap <= 1e-3 and sum(res.replicas) == 256


def test_the_exact_count_rows_give_up_at_the_deadline(monkeypatch):
    """The rows take about a second a call on 300 units and 1,024 devices: each prefix checks the clock."""
    monkeypatch.setattr(order_bisect, "_padded", lambda *a: None)  # padding fails: the rows must answer
    g = CostGraph.load(PROFILES / "gnmt.txt")
    opts = CostOptions(devices=16)
    units = _units(g, opts)
    order = heuristic.topo_orders(units)[0]
    reads = []
    monkeypatch.setattr(order_bisect, "past", lambda deadline: reads.append(1) and False)
    assert order_bisect.bisected(units, opts, order) is not None
    rows = []
    counts = order_bisect._counts
    monkeypatch.setattr(order_bisect, "_counts", lambda *a: rows.append(counts(*a)) or rows[-1])
    clock = iter(range(10**6))  # the clock trips 3 reads before the end: inside the last call's rows
    monkeypatch.setattr(order_bisect, "past", lambda deadline: next(clock) >= len(reads) - 3)
    assert order_bisect.bisected(units, opts, order, deadline=0.0) is None
    assert rows and rows[-1] is None  # the rows gave up themselves
