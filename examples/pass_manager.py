"""fxpipe's passes in torch's own PassManager, on a graph fxpipe did not capture.

The graph comes from plain ``torch.fx.symbolic_trace``; torch's ``ShapeProp``
runs first (a pass from torch, writing ``node.meta["tensor_meta"]``), then
fxpipe's profile, partition and split passes. Nothing here imports ``fxpipe``.

Run: ``python examples/pass_manager.py``
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager
from torch.fx.passes.shape_prop import ShapeProp

from passes import comm, meta
from passes.infra import PartitionPass, ProfilePass, SplitPass


class ShapePropPass(PassBase):
    """torch's ShapeProp interpreter wrapped as a PassBase."""

    def __init__(self, example_inputs):
        self.example_inputs = example_inputs

    def call(self, graph_module):
        ShapeProp(graph_module).propagate(*self.example_inputs)
        return PassResult(graph_module, False)


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    return model, (torch.randn(16, 32),)


def run_stages(stages, stage_inputs, inputs):
    """Run the stage modules in order in one process (autograd stays connected)."""
    with comm.bind(comm.ConnectedTransport()):
        out = None
        for stage, needed in zip(stages, stage_inputs):
            out, _tokens = stage(*[inputs[i] for i in needed])
    return out


def main(devices: int = 3):
    model, inputs = build()
    gm = torch.fx.symbolic_trace(model)
    manager = PassManager(passes=[
        ShapePropPass(inputs),
        ProfilePass(inputs, repeats=3),
        PartitionPass(devices, replication="none", time_limit=10),
        SplitPass(inputs),
    ])
    gm = manager(gm).graph_module
    split = meta.get(gm, meta.SplitRecord).result
    for j, stage in enumerate(split.stages):
        ops = [n.name for n in stage.graph.nodes if n.op not in ("placeholder", "output")]
        print(f"stage {j}: {ops}")
    out = run_stages(split.stages, split.stage_inputs, inputs)
    ref = model(*inputs)
    print("max |stages - model| =", (out - ref).abs().max().item())
    return out, ref, split


if __name__ == "__main__":
    main()
