"""Plans for hand-made assignments, for tests that need a real ``Plan`` without solving, and the best
plan of a small chain by enumeration."""
import itertools
import math
from typing import Any, Callable, Mapping, Optional, Sequence

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


def every_chain_plan(g: CostGraph, opts: CostOptions,
                     keep: Optional[Callable[[Mapping[str, int], Sequence[int]], bool]] = None) -> float:
    """The best bottleneck ``evaluate`` gives any split of a chain (input, work nodes, output, in
    ``g.nodes``' order) on exactly K devices, or on up to K with ``opts.fewer_devices``; only the
    (assignment, replicas) that ``keep`` accepts, where given."""
    names = list(g.nodes)
    work = names[1:-1]
    allowed = opts.allowed_replicas()
    fits = (lambda v: sum(v) <= opts.devices) if opts.fewer_devices else (lambda v: sum(v) == opts.devices)
    best = math.inf
    for stages in range(1, min(len(work), opts.devices) + 1):
        vectors = [v for v in itertools.product(allowed, repeat=stages) if fits(v)]
        for cuts in itertools.combinations(range(1, len(work)), stages - 1):
            bounds = [0, *cuts, len(work)]
            stage = {x: j for j in range(stages) for x in work[bounds[j]:bounds[j + 1]]}
            stage[names[0]], stage[names[-1]] = 0, stages - 1
            for reps in vectors:
                if keep is not None and not keep(stage, reps):
                    continue
                best = min(best, evaluate(g, stage, reps, opts).bottleneck_s)
    return best
