"""fxpipe's pass library: torch.fx passes for pipeline parallelism.

Works on any ``torch.fx.GraphModule`` and imports nothing from ``fxpipe``, so
another compiler can take this package alone. Each public name below is loaded
on first use (``from passes import capture``), so importing ``passes`` is cheap.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

# name -> (module, one-line description)
PUBLIC: Dict[str, Tuple[str, str]] = {
    # capture
    "capture": ("passes.capture", "Trace a model into a GraphModule: symbolic_trace, torch.export fallback, checked."),
    "CaptureError": ("passes.capture", "Neither tracer could capture the model; names module, line and remedy."),
    "LeafTracer": ("passes.capture", "fx Tracer that keeps user-declared modules as single calls."),
    # profile
    "profile": ("passes.profile", "Measure forward/backward time, bytes and parameters of every node."),
    "to_cost_graph": ("passes.profile", "Turn a profiled GraphModule into the partitioner's CostGraph."),
    "ProfileError": ("passes.profile", "The graph cannot be profiled as asked (device missing, a node fails)."),
    "CostGraph": ("passes.costgraph", "Profiled DAG as plain data; JSON and PipeDream graph.txt I/O."),
    "CostNode": ("passes.costgraph", "One node's measured cost in a CostGraph."),
    "load_pipedream": ("passes.costgraph", "Read a PipeDream profiler graph.txt into a CostGraph."),
    # partition
    "partition": ("passes.partition", "Best pipeline (stages, replicas) of a CostGraph on K devices, CP-SAT."),
    "PartitionResult": ("passes.partition", "Assignment, replicas, per-stage costs and solver statistics."),
    "CostOptions": ("passes.partition", "Devices, bandwidths, memory, schedule and cost model of a partition."),
    "evaluate": ("passes.partition", "Score any stage assignment with the partitioner's cost model."),
    "apply_assignment": ("passes.partition", "Write a partition's stages onto an fx graph's nodes."),
    "InfeasibleError": ("passes.partition", "No plan fits; says the smallest memory or largest K that would."),
    # split and communication
    "split_stages": ("passes.split", "Cut a stage-assigned graph into one GraphModule per stage with send/recv."),
    "SplitResult": ("passes.split", "The stage modules, their inputs, comm edges and parameter names."),
    "CommEdge": ("passes.split", "One value sent from a stage to a later one under a stable tag."),
    "SplitError": ("passes.split_check", "The assignment or an in-place op cannot be split; names the node."),
    "send": ("passes.comm", "Communication op the split writes: hand a value to the bound transport."),
    "recv": ("passes.comm", "Communication op the split writes: take a value from the bound transport."),
    "bind": ("passes.comm", "Run stage modules against a transport (context manager)."),
    "ConnectedTransport": ("passes.comm", "In-process transport keeping autograd connected across stages."),
    "MailboxTransport": ("passes.comm", "Transport that detaches at the boundary; gradients travel explicitly."),
    # pass infrastructure and metadata
    "ProfilePass": ("passes.infra", "profile as a torch.fx PassBase for torch's PassManager."),
    "PartitionPass": ("passes.infra", "partition as a PassBase: reads costs, writes each node's stage."),
    "SplitPass": ("passes.infra", "split as a PassBase: reads stages, leaves the stages on gm.meta."),
    "partition_graph": ("passes.infra", "Partition a profiled GraphModule and record the stages on it."),
    "meta": ("passes.meta", "The node.meta['fxpipe'] records and their accessor (get/put/has/require)."),
    "FxpipeError": ("passes.errors", "Base of every error a user can act on."),
    "Progress": ("passes.progress", "Progress line on stderr for long passes."),
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module 'passes' has no attribute {name!r}")
    module = importlib.import_module(PUBLIC[name][0])
    value = module if module.__name__.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(PUBLIC))
