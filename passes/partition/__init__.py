"""Pipeline partitioning: which nodes go to which stage, with how many replicas.

Two exact methods behind one call: the downset dynamic program
(``downsets.py``) when the graph has few downsets (chains, residual networks),
otherwise the CP-SAT model (``model.py``) on a coarsened graph (``coarsen.py``)
with a warm start from a DP over topological orders (``heuristic.py``).

``partition(graph, devices, **options)`` returns a ``PartitionResult``;
``apply_assignment(gm, result.assignment)`` records the stages on an fx graph.
The cost models live in ``costmodel`` as plain functions, so any assignment can
be scored (``evaluate``) the same way the solver scores it. On nodes of
``gpus_per_node`` devices, ``topology`` places stages on ranks and the costs
follow the links they use; ``hierarchical`` reproduces PipeDream's
level-by-level optimizer for such machines, to compare with.
"""
from passes.partition.costmodel import CostOptions, Evaluation, StageCost, data_parallel, evaluate
from passes.partition.driver import (
    InfeasibleError,
    PartitionResult,
    apply_assignment,
    is_convex,
    partition,
    stderr_progress,
)

__all__ = [
    "CostOptions", "Evaluation", "StageCost", "data_parallel", "evaluate",
    "InfeasibleError", "PartitionResult", "apply_assignment", "is_convex", "partition", "stderr_progress",
]
