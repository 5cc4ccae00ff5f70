"""What each spawned rank runs in the runtime tests, and the single-process references.

The references are written here, from the definitions, without the runtime:
- ``accumulate``: plain training of the unsplit model, each step summing the
  gradients of ``loss_m / M`` over its microbatches (what flush and gpipe
  must equal);
- ``pipedream``: PipeDream's weight-stashing semantics, stage by stage: each
  forward runs on a snapshot of its stage's current weights, its backward uses
  that snapshot, and every backward updates the stage's weights (replicas
  average their k-th gradients and update together). The order of forwards
  and backwards on each rank is the schedule's, the only input it takes.
"""
from __future__ import annotations

import copy
import os
import signal
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch.func import functional_call

from fxpipe.actions import Kind
from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig, train
from tests.fxpipe.runtime import fakes


class Faulty:
    """Data that makes one rank raise, die or hang when it reaches microbatch ``at``."""

    def __init__(self, inner: Any, how: str, at: int) -> None:
        self.inner, self.how, self.at = inner, how, at

    def __call__(self, g: int) -> Any:
        if g >= self.at:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":  # alive but silent: only the timeout can end the wait
                time.sleep(6)
            raise RuntimeError(f"injected failure at microbatch {g}")
        return self.inner(g)


def train_case(rank: int, name: str, replicas: Sequence[int], cfg: Dict[str, Any],
               fault: Tuple[int, str, int] = (-1, "", 0)) -> Dict[str, Any]:
    _, split = fakes.MODELS[name]()
    data: Any = fakes.Data(*fakes.DIMS[name])
    if fault[0] == rank:
        data = Faulty(data, fault[1], fault[2])
    res = train(rank=rank, layout=Layout.of(replicas), split=split, cfg=TrainConfig.from_json(cfg),
                data=data, loss_fn=fakes.mse)
    return {"stage": res.stage, "state": res.state, "losses": res.losses, "start": res.start_step}


def merged_state(name: str, results: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """The original model's parameters from every rank's stage; tied copies and replicas must agree."""
    _, split = fakes.MODELS[name]()
    out: Dict[str, torch.Tensor] = {}
    for res in results:
        for local, value in res["state"].items():
            orig = split.param_names[res["stage"]][local]
            if orig in out:
                assert torch.allclose(out[orig], value, rtol=1e-12, atol=1e-12), f"copies of {orig} differ"
            out[orig] = value
    return out


def optimizer(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr) if kind == "sgd" else torch.optim.AdamW(params, lr=lr)


def accumulate(name: str, steps: int, M: int, opt: str, lr: float) -> Dict[str, torch.Tensor]:
    model, _ = fakes.MODELS[name]()
    data = fakes.Data(*fakes.DIMS[name])
    o = optimizer(opt, model.parameters(), lr)
    for s in range(steps):
        o.zero_grad()
        for m in range(M):
            (x,), y = data(s * M + m)
            (fakes.mse(model(x), y) / M).backward()
        o.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


class _Chunk(nn.Module):
    def __init__(self, layers: Sequence[nn.Module], last: bool) -> None:
        super().__init__()
        self.layers, self.last = nn.ModuleList(layers), last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if not self.last or i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def orders_of(schedule: Dict[int, list], layout: Layout) -> Dict[Tuple[int, int], List[Tuple[str, int]]]:
    return {(layout.stage_of(r), layout.replica_of(r)): [(a.kind.value, a.mb) for a in acts
                                                         if a.kind in (Kind.F, Kind.B)]
            for r, acts in schedule.items()}


def pipedream(cuts: Sequence[int], replicas: Sequence[int], orders: Dict[Tuple[int, int], list],
              lr: float) -> Dict[str, torch.Tensor]:
    """Weight stashing on the MLP chain cut at ``cuts``; returns the final weights (original names)."""
    model, _ = fakes.chain(cuts)
    data = fakes.Data(*fakes.DIMS["chain2"])
    bounds = [0, *cuts, len(model.layers)]
    S = len(bounds) - 1
    chunks = [_Chunk([copy.deepcopy(model.layers[i]) for i in range(a, b)], j == S - 1)
              for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    W = {jk: {n: p.detach().clone() for n, p in chunks[jk[0]].named_parameters()} for jk in orders}
    outs: Dict[Tuple[int, int], torch.Tensor] = {}
    saved: Dict[Tuple[int, int], Any] = {}
    grad_to: Dict[Tuple[int, int], torch.Tensor] = {}
    pos = {jk: 0 for jk in orders}
    nb = {jk: 0 for jk in orders}
    updates = [0] * S
    pending: Dict[Tuple[int, int], Dict[int, Dict[str, torch.Tensor]]] = {}
    blocked: Dict[Tuple[int, int], int] = {}
    while any(pos[jk] < len(orders[jk]) for jk in orders):
        progressed = False
        for jk in sorted(orders):
            j, k = jk
            if jk in blocked and updates[j] <= blocked[jk]:
                continue
            blocked.pop(jk, None)
            if pos[jk] == len(orders[jk]):
                continue
            kind, m = orders[jk][pos[jk]]
            if kind == "F":
                if j > 0 and (j - 1, m) not in outs:
                    continue
                Wv = {n: t.clone().requires_grad_() for n, t in W[jk].items()}
                inp = data(m)[0][0] if j == 0 else outs[(j - 1, m)].detach().requires_grad_()
                out = functional_call(chunks[j], Wv, (inp,))
                saved[(j, m)] = (Wv, inp, out)
                outs[(j, m)] = out
            else:
                if j < S - 1 and (j, m) not in grad_to:
                    continue
                Wv, inp, out = saved.pop((j, m))
                root, g = (fakes.mse(out, data(m)[1]), None) if j == S - 1 else (out, grad_to.pop((j, m)))
                wrt = list(Wv.values()) + ([inp] if j > 0 else [])
                grads = torch.autograd.grad(root, wrt, g)
                if j > 0:
                    grad_to[(j - 1, m)] = grads[-1]
                n = nb[jk]
                nb[jk] += 1
                pending.setdefault((j, n), {})[k] = dict(zip(Wv, grads))
                if len(pending[(j, n)]) == replicas[j]:
                    got = pending.pop((j, n))
                    for name in W[jk]:
                        avg = sum(got[kk][name] for kk in got) / replicas[j]
                        for kk in range(replicas[j]):
                            W[(j, kk)][name] = W[(j, kk)][name] - lr * avg
                    updates[j] += 1
                else:
                    blocked[jk] = n
            pos[jk] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"reference deadlocked at {pos}")
    out: Dict[str, torch.Tensor] = {}
    for j, (a, _) in enumerate(zip(bounds[:-1], bounds[1:])):
        for name, t in W[(j, 0)].items():
            _, i, p = name.split(".")
            out[f"layers.{a + int(i)}.{p}"] = t
    return out
