"""Hand-written stage modules that follow the passes.comm stage contract.

They stand in for the split's output so the runtime is tested on its own:
each stage calls ``passes.comm.send/recv`` itself and returns
``(outputs, tokens)``. Every model here also exists unsplit (``original``), so
the tests compare the pipeline with plain single-process training.

- ``chain``: tests.models.MLP cut into stage chunks (a chain of links);
  ``chain2-dropout`` adds dropout after every hidden activation (random
  numbers drawn on every rank, for the resume test);
- ``tied``: the input layer's weight reused, transposed, as the output
  projection in the last stage (a parameter tied across stages);
- ``skip``: three stages where stage 0 also sends to stage 2 (a link that skips
  a stage) and a Python int (the batch size) crosses as a non-tensor value.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from passes import comm
from passes.meta import TensorMeta, ValueMeta
from tests.models import MLP

MICRO = 4  # samples per microbatch


@dataclass(frozen=True)
class Edge:
    tag: str
    src_stage: int
    dst_stage: int
    value: ValueMeta


@dataclass
class FakeSplit:
    stages: List[nn.Module]
    stage_inputs: List[List[int]]
    comm: List[Edge]
    param_names: List[Dict[str, str]]
    tied: Dict[str, List[int]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def links(self) -> List[Tuple[int, int]]:
        return sorted({(e.src_stage, e.dst_stage) for e in self.comm})


def _tmeta(shape: Sequence[int]) -> ValueMeta:
    return ValueMeta(TensorMeta(tuple(shape), "torch.float64", True))


class ChainStage(nn.Module):
    def __init__(self, layers: Sequence[nn.Module], index: int, last: bool, width_in: int, act_last: bool,
                 drop: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.index, self.last, self.width_in, self.act_last, self.drop = index, last, width_in, act_last, drop

    def forward(self, *inputs: torch.Tensor) -> Tuple[Any, Tuple[Any, ...]]:
        if self.index == 0:
            x = inputs[0]
        else:
            x = comm.recv(f"h{self.index - 1}", self.index - 1, (MICRO, self.width_in), torch.float64, True)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if not self.last or i < len(self.layers) - 1:
                x = torch.tanh(x)
                if self.drop:
                    x = F.dropout(x, self.drop, self.training)
        if self.last:
            return x, ()
        return None, (comm.send(x, f"h{self.index}", self.index + 1),)


def chain(cuts: Sequence[int], drop: float = 0.0) -> Tuple[nn.Module, FakeSplit]:
    """MLP split before the layer indices in ``cuts`` (e.g. (2,) -> 2 stages); ``drop``: dropout's probability
    (the unsplit model has none: it is for runs compared with runs)."""
    torch.manual_seed(0)
    model = MLP().double()
    bounds = [0, *cuts, len(model.layers)]
    stages, names, edges = [], [], []
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        last = j == len(bounds) - 2
        layers = [_copy(model.layers[i]) for i in range(a, b)]
        stages.append(ChainStage(layers, j, last, model.layers[a].in_features, not last, drop))
        names.append({f"layers.{i - a}.{p}": f"layers.{i}.{p}" for i in range(a, b) for p in ("weight", "bias")})
        if not last:
            edges.append(Edge(f"h{j}", j, j + 1, _tmeta((MICRO, model.layers[b - 1].out_features))))
    return model, FakeSplit(stages, [[0]] + [[] for _ in stages[1:]], edges, names)


def _copy(m: nn.Module) -> nn.Module:
    return copy.deepcopy(m)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 12)
        self.mid = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return F.linear(h, self.inp.weight.t())


class TiedFirst(nn.Module):
    def __init__(self, inp: nn.Linear) -> None:
        super().__init__()
        self.inp = inp

    def forward(self, x: torch.Tensor) -> Tuple[Any, Tuple[Any, ...]]:
        return None, (comm.send(torch.tanh(self.inp(x)), "h", 1),)


class TiedLast(nn.Module):
    def __init__(self, mid: nn.Linear, w: torch.Tensor) -> None:
        super().__init__()
        self.mid = mid
        self.w = nn.Parameter(w.detach().clone())

    def forward(self) -> Tuple[Any, Tuple[Any, ...]]:
        h = comm.recv("h", 0, (MICRO, 12), torch.float64, True)
        return F.linear(torch.tanh(self.mid(h)), self.w.t()), ()


def tied() -> Tuple[nn.Module, FakeSplit]:
    torch.manual_seed(0)
    model = Tied().double()
    s0, s1 = TiedFirst(_copy(model.inp)), TiedLast(_copy(model.mid), model.inp.weight)
    names = [{"inp.weight": "inp.weight", "inp.bias": "inp.bias"},
             {"mid.weight": "mid.weight", "mid.bias": "mid.bias", "w": "inp.weight"}]
    return model, FakeSplit([s0, s1], [[0], []], [Edge("h", 0, 1, _tmeta((MICRO, 12)))], names,
                            {"inp.weight": [0, 1]})


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 12), nn.Linear(12, 12), nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        h1 = torch.tanh(self.l1(x))
        h2 = torch.tanh(self.l2(h1))
        return self.l3(h2 + h1).reshape(n, -1)


class SkipS0(nn.Module):
    def __init__(self, l1: nn.Module) -> None:
        super().__init__()
        self.l1 = l1

    def forward(self, x: torch.Tensor) -> Tuple[Any, Tuple[Any, ...]]:
        h1 = torch.tanh(self.l1(x))
        comm.send(x.size(0), "n", 2)
        return None, (comm.send(h1, "h1_1", 1), comm.send(h1, "h1_2", 2))


class SkipS1(nn.Module):
    def __init__(self, l2: nn.Module) -> None:
        super().__init__()
        self.l2 = l2

    def forward(self) -> Tuple[Any, Tuple[Any, ...]]:
        h1 = comm.recv("h1_1", 0, (MICRO, 12), torch.float64, True)
        return None, (comm.send(torch.tanh(self.l2(h1)), "h2", 2),)


class SkipS2(nn.Module):
    def __init__(self, l3: nn.Module) -> None:
        super().__init__()
        self.l3 = l3

    def forward(self) -> Tuple[Any, Tuple[Any, ...]]:
        h2 = comm.recv("h2", 1, (MICRO, 12), torch.float64, True)
        h1 = comm.recv("h1_2", 0, (MICRO, 12), torch.float64, True)
        n = comm.recv("n", 0)
        return self.l3(h2 + h1).reshape(n, -1), ()


def skip() -> Tuple[nn.Module, FakeSplit]:
    torch.manual_seed(0)
    model = Skip().double()
    stages = [SkipS0(_copy(model.l1)), SkipS1(_copy(model.l2)), SkipS2(_copy(model.l3))]
    names = [{f"{l}.{p}": f"{l}.{p}" for p in ("weight", "bias")} for l in ("l1", "l2", "l3")]
    edges = [Edge("h1_1", 0, 1, _tmeta((MICRO, 12))), Edge("h1_2", 0, 2, _tmeta((MICRO, 12))),
             Edge("n", 0, 2, ValueMeta(MICRO)), Edge("h2", 1, 2, _tmeta((MICRO, 12)))]
    return model, FakeSplit(stages, [[0], [], []], edges, names)


MODELS = {"chain2": lambda: chain((2,)), "chain4": lambda: chain((1, 3, 4)), "tied": tied, "skip": skip,
          "chain2-dropout": lambda: chain((2,), drop=0.3)}


class Data:
    """Deterministic microbatch ``g``: inputs and regression targets, float64."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        self.in_dim, self.out_dim = in_dim, out_dim

    def __call__(self, g: int) -> Tuple[Tuple[torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + g)
        x = torch.randn(MICRO, self.in_dim, generator=gen, dtype=torch.float64)
        return (x,), torch.randn(MICRO, self.out_dim, generator=gen, dtype=torch.float64)


DIMS = {"chain2": (16, 8), "chain4": (16, 8), "tied": (16, 16), "skip": (16, 6), "chain2-dropout": (16, 8)}


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)
