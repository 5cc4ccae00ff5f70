"""Pipeline partitioning: which nodes go to which stage, with how many replicas.

Exact methods behind one call. First the segment DP (``chain.py`` over the
lattice of ``segments.py``): the graph's downset lattice as a chain of small
per-segment lattices, searched by bisection on the bottleneck with the fewest
replicas per stage in closed form; it proves 96-block transformers on 1024
devices (flat network) optimal in about 2 s (``stage_count`` counts stages instead of
devices for replication ``none`` on exactly K). Where it does not apply (memory
limits, a segment with too many downsets)
or does not prove its plan, the downset DP (``downsets.py``) on small
lattices, else CP-SAT (``model.py``) on a coarsened graph (``coarsen.py``),
warm-started by the best plan so far and bounded by the segment DP's bound.

``partition(graph, devices, **options)`` returns a ``PartitionResult``;
``apply_assignment(gm, result.assignment)`` records the stages on an fx graph.
The cost models live in ``costmodel`` as plain functions, so any assignment can
be scored (``evaluate``) the same way the solver scores it. On nodes of
``gpus_per_node`` devices, ``topology`` places stages on ranks and the costs
follow the links they use (``placed`` runs the segment DP with each stage's
offset within its node in the state); ``hierarchical`` reproduces PipeDream's
level-by-level optimizer for such machines, to compare with.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "CostOptions": "costmodel", "Evaluation": "costmodel", "StagePlan": "costmodel", "data_parallel": "costmodel",
    "evaluate": "costmodel", "InfeasibleError": "result", "PartitionResult": "result",
    "apply_assignment": "driver", "is_convex": "driver", "partition": "driver", "stderr_progress": "driver",
}
__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    """Load the solvers (OR-Tools, networkx) on first use: the cost model alone (``costmodel``: the
    schedule names, in-flight counts) is what the CLI's parser and the runtime import."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
