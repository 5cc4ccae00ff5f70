"""A ``torch.compile`` backend that pipelines what Dynamo hands it.

Dynamo traces the model and calls the backend with an FX graph and example
inputs. The backend profiles the graph, partitions it with CP-SAT, splits it
into stages with send/recv nodes, and returns a callable that runs the stages
in order in this process (``run_local`` semantics: the reference a pipeline
runtime is checked against). Only ``passes`` is used, as another compiler would.

Run: ``python examples/compile_backend.py``
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch
import torch.nn as nn

from passes import comm
from passes.infra import partition_graph
from passes.profile import profile
from passes.split import split_stages


def pipeline_backend(devices: int = 2, **plan_options: Any) -> Callable:
    """Make a backend for ``torch.compile(model, backend=...)``."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
        real = [x for x in example_inputs]
        profile(gm, real, repeats=2, warmup=1)
        options = {"replication": "none", "time_limit": 10, **plan_options}
        result = partition_graph(gm, devices, **options)
        split = split_stages(gm, real)
        backend.stages = split.stages
        backend.replicas = result.replicas

        def run(*args: torch.Tensor) -> Any:
            with comm.bind(comm.ConnectedTransport()):
                out = None
                for stage, needed in zip(split.stages, split.stage_inputs):
                    out, _tokens = stage(*[args[i] for i in needed])
            return out

        return run

    backend.stages: List[torch.fx.GraphModule] = []
    return backend


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 48)
        self.b = nn.Linear(48, 48)
        self.c = nn.Linear(48, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b(h)) + h)


def main() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 24)
    backend = pipeline_backend(devices=2)
    compiled = torch.compile(model, backend=backend)
    out = compiled(x)
    ref = model(x)
    print(f"{len(backend.stages)} stages; max |compiled - eager| = {(out - ref).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
