"""Plans for hand-made assignments, for tests that need a real ``Plan`` without solving."""
from typing import Any, Mapping, Sequence

from fxpipe.plan import Plan, plan_from_result
from passes.costgraph import CostGraph
from passes.partition import CostOptions, PartitionResult, evaluate
from passes.partition.costmodel import DEFAULT_SCHEDULE


def synthetic_plan(graph: CostGraph, assignment: Mapping[str, int], replicas: Sequence[int], batch_size: int = 1,
                   bandwidth: float = 1.25e9, microbatches: int = 4, schedule: str = DEFAULT_SCHEDULE,
                   **options: Any) -> Plan:
    """A real ``Plan`` for a hand-made assignment, scored by the partitioner's cost model;
    ``options``: more ``CostOptions`` (``gpus_per_node``, ``intra_bandwidth``...)."""
    opts = CostOptions(devices=sum(replicas), bandwidth=bandwidth, microbatches=microbatches, schedule=schedule,
                       **options)
    ev = evaluate(graph, assignment, list(replicas), opts)
    result = PartitionResult(assignment=dict(assignment), replicas=list(replicas), stages=ev.stages,
                             bottleneck_s=ev.bottleneck_s, options=opts, status="HAND (not solved)",
                             objective_s=ev.bottleneck_s, bound_s=0.0, wall_s=0.0, units=len(graph.nodes))
    return plan_from_result(result, graph, batch_size)
