"""Plans for ``1f1b-stash`` give the stages that share a tied weight equal replicas (the runtime's rule:
their ranks all-reduce the weight after every backward, so each must run as many backwards).

On the tied chains of ``test_partition_tied`` the unconstrained optimum puts the embedding's stage
and the heavy head's stage at different counts; the stash plan must be the best runnable plan that
enumeration finds, on exactly K devices, proven: CP-SAT searches under the rule (its model states
it) and its bound, of the problem the runtime can run, closes the gap the looser bounds leave.
"""
from __future__ import annotations

import time

import pytest

from passes.partition import CostOptions, evaluate, is_convex, partition
from passes.partition.stash_ties import runnable, tied_stages
from tests.passes.test_partition_tied import tied_chain
from tests.plans import every_chain_plan

CASES = [(seed, rep, K) for seed in range(4) for rep, K in (("any", 6), ("any", 8), ("pow2", 8))]


@pytest.mark.parametrize("seed,replication,K", CASES)
def test_stash_plan_is_the_best_runnable_plan(seed, replication, K):
    g = tied_chain(seed)
    opts = CostOptions(devices=K, schedule="1f1b-stash", replication=replication)
    flush = partition(g, K, time_limit=5, schedule="1f1b-flush", replication=replication)
    assert not runnable(g, flush.assignment, flush.replicas)  # the case: the unconstrained plan is not runnable

    res = partition(g, K, time_limit=5, schedule="1f1b-stash", replication=replication)
    best = every_chain_plan(g, opts, keep=lambda a, reps: runnable(g, a, reps))
    assert len(tied_stages(g, res.assignment)) == 2 and runnable(g, res.assignment, res.replicas)
    assert sum(res.replicas) == K and is_convex(g, res.assignment)
    assert set(res.replicas) <= set(opts.allowed_replicas())
    assert res.bottleneck_s == pytest.approx(evaluate(g, res.assignment, res.replicas, opts).bottleneck_s, rel=1e-12)
    assert res.bottleneck_s == pytest.approx(best, rel=1e-9)
    assert res.bound_s <= best * (1 + 1e-9)
    # proven: by the segment DP per common count of the tied stages, or CP-SAT under the rule, on the segment
    # DP's evened plan or as the search itself
    assert res.status == "OPTIMAL" and res.gap <= 1e-3, res.method
    assert "common tied count" in res.method or "stash rule" in res.method or res.method == "CP-SAT", res.method


@pytest.mark.parametrize("seed,replication,K", CASES[::2])
def test_cp_sat_plans_under_the_rule_itself(seed, replication, K):
    """The rule is in the CP-SAT model (``PartitionModel._stash_rule``): its plan needs no evening."""
    g = tied_chain(seed)
    opts = CostOptions(devices=K, schedule="1f1b-stash", replication=replication)
    res = partition(g, K, time_limit=5, schedule="1f1b-stash", replication=replication, solver="cpsat")
    best = every_chain_plan(g, opts, keep=lambda a, reps: runnable(g, a, reps))
    assert runnable(g, res.assignment, res.replicas) and "evened" not in res.method
    assert res.status == "OPTIMAL" and res.bottleneck_s == pytest.approx(best, rel=1e-3)


def test_other_schedules_and_untied_plans_are_left_alone():
    g = tied_chain(0)
    for schedule in ("1f1b-flush", "gpipe", "zb-h1", "2bw"):
        res = partition(g, 8, time_limit=5, schedule=schedule)
        assert "evened" not in res.method
    res = partition(g, 6, time_limit=5, schedule="1f1b-stash", replication="none")  # one replica each: runnable
    assert "evened" not in res.method and runnable(g, res.assignment, res.replicas)


def test_evening_keeps_to_the_time_limit():
    g = tied_chain(0, blocks=40)
    start = time.monotonic()
    res = partition(g, 256, time_limit=2, schedule="1f1b-stash")
    assert time.monotonic() - start < 3.0
    assert runnable(g, res.assignment, res.replicas) and sum(res.replicas) == 256


@pytest.mark.parametrize("seed,share", [(1, 0.8), (3, 0.5)])
def test_under_a_memory_limit_the_plan_is_runnable_fits_and_is_proven(seed, share):
    """With a memory limit CP-SAT plans alone (the segment DP does not model memory): the rule in its
    model gives a runnable plan within the limit, the best such plan, with no evening."""
    g = tied_chain(seed)
    free = partition(g, 8, time_limit=5, schedule="1f1b-stash")
    opts = CostOptions(devices=8, schedule="1f1b-stash")
    memory = int(evaluate(g, free.assignment, free.replicas, opts).peak_memory_bytes * share)
    opts = CostOptions(devices=8, schedule="1f1b-stash", memory=memory)
    res = partition(g, 8, time_limit=5, schedule="1f1b-stash", memory=memory)
    best = every_chain_plan(g, opts, keep=lambda a, reps: runnable(g, a, reps)
                            and evaluate(g, a, reps, opts).peak_memory_bytes <= memory)
    assert runnable(g, res.assignment, res.replicas) and "evened" not in res.method
    assert evaluate(g, res.assignment, res.replicas, opts).peak_memory_bytes <= memory
    assert res.status == "OPTIMAL" and res.bottleneck_s == pytest.approx(best, rel=1e-3)
