"""fxpipe's passes as ``torch.fx`` ``PassBase`` objects, for torch's ``PassManager``.

Each pass is usable three ways: as a plain function (``passes.profile.profile``,
``partition_graph`` below, ``passes.split.split_stages``), as one of these
``PassBase`` classes (``requires`` checks the node metadata the pass reads and
names the pass to run first; ``call`` returns a ``PassResult``), and through
fxpipe's own pipeline (``fxpipe.split``), which calls the plain functions.

A ``PassResult`` carries a ``GraphModule``, so passes whose answer is not a
graph (the partition, the stage modules) leave it on the graph module as a
graph-wide record: ``meta.get(gm, meta.PartitionRecord).result`` and
``meta.get(gm, meta.SplitRecord).result``.

All three return ``modified=False``: they write node and graph metadata and
leave the graph's nodes as they were. torch's ``PassManager`` runs its list
again (up to ``steps`` times) while a pass reports a change, which would
profile or partition again for nothing.

Capture is not here: it turns an ``nn.Module`` into the graph the passes run
on, so it comes before a ``PassManager`` (``passes.capture.capture``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from passes import meta
from passes.partition import PartitionResult, apply_assignment, partition
from passes.profile import profile, to_cost_graph
from passes.split import SplitResult, split_stages
from passes.split_check import is_dropped
from passes.values import COMPUTE_OPS


def _not_computing(node: torch.fx.Node) -> bool:
    """Nodes no pass annotates: get_attr, and what the split leaves out."""
    return node.op not in COMPUTE_OPS or is_dropped(node)


def require_costs(gm: torch.fx.GraphModule) -> None:
    meta.require(gm, meta.NodeCost, needed_by="partition", what="costs",
                 made_by="profile (passes.profile.profile or ProfilePass)", exempt=_not_computing)


def require_stages(gm: torch.fx.GraphModule) -> None:
    meta.require(gm, meta.StageAssign, needed_by="split", what="stages",
                 made_by="partition (passes.infra.partition_graph or PartitionPass)", exempt=_not_computing)


def partition_graph(gm: torch.fx.GraphModule, devices: int, **options: Any) -> PartitionResult:
    """Partition a profiled graph module and record each node's stage on it.

    The function form of ``PartitionPass``: checks the costs, builds the
    ``CostGraph``, solves, and writes ``meta.StageAssign`` on every node.
    """
    require_costs(gm)
    result = partition(to_cost_graph(gm), devices, **options)
    apply_assignment(gm, result.assignment)
    meta.put(gm, meta.PartitionRecord(result))
    return result


class ProfilePass(PassBase):
    """Measure every node (``passes.profile.profile``); writes ``cost`` and ``value``."""

    def __init__(self, example_inputs: Sequence[Any], device: str = "cpu", repeats: int = 5, warmup: int = 2) -> None:
        self.example_inputs = tuple(example_inputs)
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        profile(graph_module, self.example_inputs, device=self.device, repeats=self.repeats, warmup=self.warmup)
        return PassResult(graph_module, False)  # metadata only: the graph itself is unchanged

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        require_costs(graph_module)


class PartitionPass(PassBase):
    """Choose stages and replicas with CP-SAT; reads ``cost``, writes ``stage``."""

    def __init__(self, devices: int, **options: Any) -> None:
        self.devices, self.options = devices, options

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        require_costs(graph_module)

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        partition_graph(graph_module, self.devices, **self.options)
        return PassResult(graph_module, False)  # metadata only: the graph itself is unchanged


class SplitPass(PassBase):
    """Cut the graph into stage modules with send/recv nodes; reads ``stage``.

    The stages are in ``meta.get(gm, meta.SplitRecord).result``.
    """

    def __init__(self, example_inputs: Optional[Sequence[Any]] = None) -> None:
        self.example_inputs = None if example_inputs is None else tuple(example_inputs)

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        require_stages(graph_module)

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        result: SplitResult = split_stages(graph_module, self.example_inputs)
        meta.put(graph_module, meta.SplitRecord(result))
        return PassResult(graph_module, False)
