"""Plans under a memory limit on many devices: the CP-SAT model's size, and no answer over the limit."""
from __future__ import annotations

from passes.costgraph import CostGraph
from passes.partition import driver
from passes.partition.coarsen import build_units, model_nodes
from passes.partition.costmodel import CostOptions
from passes.partition.model import PartitionModel
from tests.profiles import PROFILES


def _terms(K: int, memory) -> int:
    g = CostGraph.load(PROFILES / "gnmt_large.txt")
    opts = CostOptions(devices=K, memory=memory)
    units = build_units(g, opts, [[n] for n in model_nodes(g, opts)])
    return sum(len(c.linear.vars) for c in PartitionModel(units, opts).m.Proto().constraints)


def test_memory_model_grows_with_the_counts_not_their_product():
    """Each replica choice bounds the slot's in-flight count by a variable, not by a copy of its one-hot
    sum over up to 2K counts: that copy made the model O(slots · K · 2K) terms (gnmt_large on 256
    devices: 10 s and 700 MB to build, past a 10-s limit). On 64 devices it was 12x the model without
    memory; now the memory constraints add less than that model again."""
    assert _terms(64, 4e9) <= 2.5 * _terms(64, None)


def test_an_unsearched_plan_over_the_memory_limit_is_not_the_answer(monkeypatch):
    """Where CP-SAT has no time to start, the answer was the order DP's plan, which ignores memory:
    12 GiB a device on stage 1 under --memory 4e9. Now the plan is checked; the uniform layout within
    the limit answers instead."""
    monkeypatch.setattr(driver, "_time_for_cpsat", lambda *a: False)
    g = CostGraph.load(PROFILES / "gnmt_large.txt")
    res = driver.partition(g, 256, memory=4e9, time_limit=10)
    assert all(s.memory_bytes <= 4e9 for s in res.stages)
    assert sum(res.replicas) == 256

