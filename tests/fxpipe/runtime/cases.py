"""What each spawned rank runs in the runtime tests, and the single-process references.

The references are written here, from the definitions, without the runtime:
- ``accumulate``: plain training of the unsplit model, each step summing the
  gradients of ``loss_m / M`` over its microbatches (what flush and gpipe
  must equal);
- ``pipedream``: PipeDream's weight-stashing semantics, stage by stage: each
  forward runs on a snapshot of its stage's current weights, its backward uses
  that snapshot, and every backward updates the stage's weights (replicas
  average their k-th gradients and update together). The order of forwards
  and backwards on each rank is the schedule's, the only input it takes;
- ``two_bw_model``: PipeDream-2BW's semantics on the unsplit model: step
  ``t``'s gradient (of the mean loss over its ``M`` microbatches) is computed
  on the weights before the previous update, ``W(t - 1)`` (``W(-1) = W(0)``),
  and the optimizer applies it to ``W(t)``.
"""
from __future__ import annotations

import copy
import os
import signal
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.func import functional_call

from fxpipe.actions import Kind
from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig, train

LrOf = Callable[[int], float]  # a learning rate per minibatch
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
    return merge_states(fakes.MODELS[name]()[1].param_names, results)


def merge_states(param_names: List[Dict[str, str]], results: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Every rank's ``{"stage", "state"}`` under the original names; tied copies and replicas must agree."""
    out: Dict[str, torch.Tensor] = {}
    for res in results:
        for local, value in res["state"].items():
            orig = param_names[res["stage"]][local]
            if orig in out:
                assert torch.allclose(out[orig], value, rtol=1e-12, atol=1e-12), f"copies of {orig} differ"
            out[orig] = value
    return out


def optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr) if name == "sgd" else torch.optim.AdamW(params, lr=lr)


def accumulate(name: str, steps: int, M: int, opt: str, lr: float) -> Dict[str, torch.Tensor]:
    model, _ = fakes.MODELS[name]()
    return accumulate_model(model, fakes.Data(*fakes.DIMS[name]), fakes.mse, steps, M, opt, lr)


def two_bw_model(model: nn.Module, data: Any, loss_fn: Any, steps: int, M: int, opt: str,
                 lr: float, momentum: float = 0.0) -> Dict[str, torch.Tensor]:
    """``model`` trained in place with 2BW's ``W(t + 1) = W(t) - lr * grad f(W(t - 1))`` (torch's optimizer)."""
    o = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum) if opt == "sgd" else \
        optimizer(opt, model.parameters(), lr)
    before = copy.deepcopy(model)  # W(t - 1); ties survive deepcopy, so parameters() pair up with model's
    for s in range(steps):
        for m in range(M):
            (x,), y = data(s * M + m)
            (loss_fn(before(x), y) / M).backward()
        now = copy.deepcopy(model)  # W(t): the next step's gradient is computed on it
        for p, q in zip(model.parameters(), before.parameters()):
            p.grad = q.grad
        o.step()
        o.zero_grad()
        before = now
    return {k: v.detach() for k, v in model.state_dict().items()}


def accumulate_model(model: nn.Module, data: Any, loss_fn: Any, steps: int, M: int, opt: str,
                     lr: float, clip: Optional[float] = None, lr_of: Optional[Callable[[int], float]] = None,
                     norms: Optional[List[float]] = None) -> Dict[str, torch.Tensor]:
    """``model`` trained in place: per step, the gradient of the mean loss over ``M`` microbatches.

    ``clip``: ``torch.nn.utils.clip_grad_norm_`` on that gradient (its norms
    appended to ``norms``); ``lr_of(step)``: the step's learning rate.
    """
    o = optimizer(opt, model.parameters(), lr)
    for s in range(steps):
        o.zero_grad()
        for m in range(M):
            (x,), y = data(s * M + m)
            (loss_fn(model(x), y) / M).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        if lr_of is not None:
            for group in o.param_groups:
                group["lr"] = lr_of(s)
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
              lr: float, losses: Optional[Dict[int, float]] = None) -> Dict[str, torch.Tensor]:
    """Weight stashing on the MLP chain cut at ``cuts``; returns the final weights (original names) and
    fills ``losses`` (microbatch -> its loss, on the weights its forward used) if given."""
    model, _ = fakes.chain(cuts)
    data = fakes.Data(*fakes.DIMS["chain2"])
    bounds = [0, *cuts, len(model.layers)]
    S = len(bounds) - 1
    chunks = [_Chunk([copy.deepcopy(model.layers[i]) for i in range(a, b)], j == S - 1)
              for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    outs: Dict[Tuple[int, int], torch.Tensor] = {}
    saved: Dict[Tuple[int, int], Any] = {}
    grad_to: Dict[Tuple[int, int], torch.Tensor] = {}

    def forward(j: int, m: int, Wv: Dict[str, torch.Tensor]) -> bool:
        if j > 0 and (j - 1, m) not in outs:
            return False
        inp = data(m)[0][0] if j == 0 else outs[(j - 1, m)].detach().requires_grad_()
        out = functional_call(chunks[j], Wv, (inp,))
        saved[(j, m)] = (Wv, inp, out)
        outs[(j, m)] = out
        return True

    def backward(j: int, m: int) -> Optional[Dict[str, torch.Tensor]]:
        if j < S - 1 and (j, m) not in grad_to:
            return None
        Wv, inp, out = saved.pop((j, m))
        root, g = (fakes.mse(out, data(m)[1]), None) if j == S - 1 else (out, grad_to.pop((j, m)))
        if losses is not None and j == S - 1:
            losses[m] = root.item()
        grads = torch.autograd.grad(root, list(Wv.values()) + ([inp] if j > 0 else []), g)
        if j > 0:
            grad_to[(j - 1, m)] = grads[-1]
        return dict(zip(Wv, grads))

    start = [{n: p.detach().clone() for n, p in c.named_parameters()} for c in chunks]
    final = pipedream_walk(orders, replicas, start, forward, backward, lr, [{} for _ in chunks])
    out: Dict[str, torch.Tensor] = {}
    for j, a in enumerate(bounds[:-1]):
        for name, t in final[j].items():
            _, i, p = name.split(".")
            out[f"layers.{a + int(i)}.{p}"] = t
    return out


def pipedream_walk(orders: Dict[Tuple[int, int], list], replicas: Sequence[int],
                   start: List[Dict[str, torch.Tensor]], forward: Callable[..., bool],
                   backward: Callable[[int, int], Optional[Dict[str, torch.Tensor]]], lr: "float | LrOf",
                   shared: List[Dict[str, str]], clip: Optional[float] = None) -> List[Dict[str, torch.Tensor]]:
    """PipeDream's weight stashing with SGD; returns replica 0's final weights per stage.

    ``orders``: each (stage, replica)'s forwards and backwards in order.
    ``forward(j, m, weights)`` runs stage ``j`` on microbatch ``m`` with that
    weight version (False: its inputs have not arrived yet);
    ``backward(j, m)`` returns the gradients of the version it ran on (None:
    not ready). The ``n``-th backward of a stage updates its weights with the
    average of its replicas' ``n``-th gradients. ``shared[j]`` (local name ->
    key) marks parameters several stages hold (tied): those stages update
    together, each copy by the sum over the stages of their replica averages.
    ``lr``: a rate, or a function of the minibatch whose backward completes
    the update. ``clip``: each update's step (the stages updating together)
    is scaled as ``clip_grad_norm_`` would scale it, a tied weight once.
    """
    tied = tuple(j for j in range(len(start)) if shared[j])
    group_of = {j: tied if j in tied and len(tied) > 1 else (j,) for j in range(len(start))}
    W = {jk: dict(start[jk[0]]) for jk in orders}
    pos = {jk: 0 for jk in orders}
    nb = {jk: 0 for jk in orders}
    updates = [0] * len(start)
    pending: Dict[Tuple[Tuple[int, ...], int], Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {}
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
                if not forward(j, m, {n: t.clone().requires_grad_() for n, t in W[jk].items()}):
                    continue
            else:
                grads = backward(j, m)
                if grads is None:
                    continue
                key = (group_of[j], nb[jk])
                nb[jk] += 1
                pending.setdefault(key, {})[jk] = grads
                if len(pending[key]) == sum(replicas[s] for s in key[0]):
                    rate = lr(m) if callable(lr) else lr
                    _update(W, pending.pop(key), key[0], replicas, shared, rate, clip)
                    for s in key[0]:
                        updates[s] += 1
                else:
                    blocked[jk] = key[1]
            pos[jk] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"reference deadlocked at {pos}")
    return [W[(j, 0)] for j in range(len(start))]


def _update(W: Dict[Tuple[int, int], Dict[str, torch.Tensor]], got: Dict[Tuple[int, int], Dict[str, torch.Tensor]],
            group: Tuple[int, ...], replicas: Sequence[int], shared: List[Dict[str, str]], lr: float,
            clip: Optional[float] = None) -> None:
    """One SGD update of every replica of the stages in ``group`` from their gradients ``got``."""
    mean = {s: {n: sum(got[(s, k)][n] for k in range(replicas[s])) / replicas[s] for n in W[(s, 0)]}
            for s in group}
    delta, unique = {}, {}
    for s in group:
        for name in W[(s, 0)]:
            key = shared[s].get(name)
            delta[(s, name)] = mean[s][name] if key is None else sum(
                mean[t][n] for t in group for n, kt in shared[t].items() if kt == key)
            unique[(s, name) if key is None else key] = delta[(s, name)]
    if clip is not None:  # clip_grad_norm_ itself, on the update's gradients (a tied weight once)
        params = [torch.zeros_like(d).requires_grad_() for d in unique.values()]
        for p, d in zip(params, unique.values()):
            p.grad = d.clone()
        torch.nn.utils.clip_grad_norm_(params, clip)
        unique = {k: p.grad for k, p in zip(unique, params)}
    for s, name in delta:
        key = shared[s].get(name)
        step = unique[(s, name) if key is None else key]
        for k in range(replicas[s]):
            W[(s, k)][name] = W[(s, k)][name] - lr * step


class _Messages:
    """``passes.comm`` transport of the split reference: values and gradients by (tag, microbatch)."""

    def __init__(self) -> None:
        self.values: Dict[Tuple[str, int], Any] = {}
        self.grads: Dict[Tuple[str, int], torch.Tensor] = {}
        self.m = -1
        self.got: List[Tuple[str, torch.Tensor]] = []
        self.sent: List[Tuple[str, Any]] = []

    def send(self, tag: str, value: Any, dst: int) -> None:
        self.values[(tag, self.m)] = value
        self.sent.append((tag, value))

    def recv(self, tag: str, src: int, shape: Any, dtype: Any, requires_grad: bool) -> Any:
        value = self.values[(tag, self.m)]
        if isinstance(value, torch.Tensor):
            value = value.detach().requires_grad_(requires_grad)
            self.got.append((tag, value))
        return value


def pipedream_split(split: Any, replicas: Sequence[int], orders: Dict[Tuple[int, int], list], lr: "float | LrOf",
                    data: Callable[[int], Any], loss_fn: Callable[..., torch.Tensor],
                    clip: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """``pipedream_walk`` on a split's stage modules (in memory, as ``split_stages`` made them).

    Each stage runs through ``functional_call`` on its weight version, its
    received values stand in for the sender's (detached), and its backward
    takes the gradients its receivers computed. Returns the final weights
    under the original names. ``lr`` and ``clip``: as ``pipedream_walk``.
    """
    from passes import comm

    box = _Messages()
    saved: Dict[Tuple[int, int], Any] = {}
    needs = [[e.tag for e in split.comm if e.dst_stage == j] for j in range(split.num_stages)]
    last = split.num_stages - 1

    def forward(j: int, m: int, Wv: Dict[str, torch.Tensor]) -> bool:
        if any((tag, m) not in box.values for tag in needs[j]):
            return False
        box.m, box.got, box.sent = m, [], []
        inputs = split.flatten_inputs(data(m)[0])
        with comm.bind(box):
            out, _ = functional_call(split.stages[j], Wv, tuple(inputs[i] for i in split.stage_inputs[j]))
        saved[(j, m)] = (Wv, box.got, [(t, v) for t, v in box.sent if isinstance(v, torch.Tensor)
                                       and v.requires_grad], out)
        return True

    def backward(j: int, m: int) -> Optional[Dict[str, torch.Tensor]]:
        Wv, got, sent, out = saved[(j, m)]
        if any((tag, m) not in box.grads for tag, _ in sent):
            return None
        del saved[(j, m)]
        roots = [v for _, v in sent] + ([loss_fn(out, data(m)[1])] if j == last else [])
        outer = [box.grads.pop((tag, m)) for tag, _ in sent] + ([None] if j == last else [])
        wrt = list(Wv.values()) + [x for _, x in got if x.requires_grad]
        grads = torch.autograd.grad(roots, wrt, outer, allow_unused=True)
        grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]
        for (tag, _), g in zip([(t, x) for t, x in got if x.requires_grad], grads[len(Wv):]):
            box.grads[(tag, m)] = g
        return dict(zip(Wv, grads[:len(Wv)]))

    start = [{n: p.detach().clone() for n, p in st.named_parameters()} for st in split.stages]
    shared = [{n: split.param_names[j][n] for n in start[j] if split.param_names[j][n] in split.tied}
              for j in range(split.num_stages)]
    final = pipedream_walk(orders, replicas, start, forward, backward, lr, shared, clip)
    return {split.param_names[j][n]: t for j in range(split.num_stages) for n, t in final[j].items()}
