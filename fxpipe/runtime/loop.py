"""One rank's training run: build its stage, optimizer and executor, walk the steps.

``train`` is what a worker calls once the process group is up; tests call it
directly from spawned processes. It reads the split (duck-typed: ``stages``,
``stage_inputs``, ``comm``, ``param_names``, ``tied``, ``links``), so
hand-written stage modules that follow the ``passes.comm`` contract run too.

Steps. ``1f1b-flush`` and ``gpipe`` repeat one step's action list. With
``1f1b-stash`` a "step" is ``M`` minibatches, each with its own update, and
the pipeline does not drain between steps: one action list covers the run
up to the next checkpoint (or the end), where it drains so the checkpoint
holds one consistent weight version.

Reporting. Replica 0 of the last stage prints each step's mean loss over the
microbatches it computed (all of them unless the last stage is replicated)
and samples per second measured between its step ends.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from fxpipe.actions import Kind
from fxpipe.layout import Layout
from fxpipe.runtime import checkpoint
from fxpipe.runtime.data import batch_dim
from fxpipe.runtime.executor import Executor, LossFn
from fxpipe.runtime.groups import GradReducer, make_groups
from fxpipe.runtime.stash import WeightStash
from fxpipe.runtime.trace import Tracer, rank_path
from fxpipe.runtime.transport import P2P, wires_of

SCHEDULES = ("1f1b-stash", "1f1b-flush", "gpipe")


@dataclass
class TrainConfig:
    schedule: str = "1f1b-flush"
    microbatches: int = 4
    steps: int = 10
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: Optional[float] = None  # None: the optimizer's own default (sgd 0, adamw 0.01)
    trace: Optional[str] = None
    checkpoint: Optional[str] = None
    checkpoint_every: int = 0
    resume: bool = False
    save_dir: Optional[str] = None  # replica 0 of each stage writes stage<j>.pt here at the end
    timeout_s: float = 120.0
    log: bool = True

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "TrainConfig":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def make_optimizer(cfg: TrainConfig, module: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:  # a stage without parameters still takes STEP actions
        params = [nn.Parameter(torch.zeros(()))]
    wd = {} if cfg.weight_decay is None else {"weight_decay": cfg.weight_decay}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, **wd)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, **wd)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose sgd or adamw")


@dataclass
class TrainResult:
    rank: int
    stage: int
    start_step: int
    losses: List[float] = field(default_factory=list)       # per step, on replica 0 of the last stage
    samples_per_s: List[float] = field(default_factory=list)
    state: Dict[str, torch.Tensor] = field(default_factory=dict)  # the stage's final state_dict


def _segments(cfg: TrainConfig, start: int) -> List[tuple]:
    """(first step, steps) runs of one action list each."""
    if cfg.schedule != "1f1b-stash":
        return [(s, 1) for s in range(start, cfg.steps)]
    every = cfg.checkpoint_every if cfg.checkpoint and cfg.checkpoint_every > 0 else cfg.steps
    out, s = [], start
    while s < cfg.steps:
        end = min(cfg.steps, (s // every + 1) * every)
        out.append((s, end - s))
        s = end
    return out


def train(*, rank: int, layout: Layout, split: Any, cfg: TrainConfig, data: Callable[[int], Any],
          loss_fn: Optional[LossFn], build: Optional[Callable[..., Dict[int, list]]] = None,
          device: torch.device = torch.device("cpu")) -> TrainResult:
    """Run ``cfg.steps`` steps on this rank; collective over all ranks of ``layout``."""
    if build is None:
        from fxpipe.schedule import build_schedule as build
    stage = layout.stage_of(rank)
    module = split.stages[stage].to(device)
    module.train()
    is_last = stage == layout.num_stages - 1
    stash = WeightStash(module, stash=cfg.schedule == "1f1b-stash")
    optimizer = make_optimizer(cfg, module)
    groups = make_groups(layout, split.tied, rank)
    local_of = {orig: local for local, orig in split.param_names[stage].items()}
    scale = 1.0 / layout.replicas[stage] if cfg.schedule == "1f1b-stash" else 1.0
    reducer = GradReducer(groups, stash.master, local_of, scale)
    tracer = Tracer(rank, enabled=bool(cfg.trace))
    p2p = P2P(wires_of(split.comm), device, cfg.timeout_s, tracer.wait_span if cfg.trace else None)
    M = cfg.microbatches
    ex = Executor(rank=rank, layout=layout, stage=stage, module=module, input_indices=split.stage_inputs[stage],
                  is_last=is_last, stash=stash, optimizer=optimizer, p2p=p2p, reducer=reducer, data=data,
                  loss_fn=loss_fn, loss_scale=1.0 if cfg.schedule == "1f1b-stash" else 1.0 / M, tracer=tracer,
                  flatten=getattr(split, "flatten_inputs", list),
                  unflatten=getattr(split, "unflatten_outputs", lambda out: out))
    info = {"schedule": cfg.schedule, "microbatches": M}
    start = checkpoint.restore(cfg.checkpoint, rank, layout, module, optimizer, info) if cfg.resume else 0
    result = TrainResult(rank, stage, start)
    reporter = _Reporter(cfg, result, M * batch_dim(data(0)[0]), layout, rank, ex.losses) if is_last else None
    tied_stages = sorted({s for st in split.tied.values() for s in st})
    links = sorted(split.links)
    cache: Dict[int, list] = {}
    for first, n in _segments(cfg, start):
        if n not in cache:
            cache[n] = build(cfg.schedule, layout, n * M if cfg.schedule == "1f1b-stash" else M,
                             links, tied_stages)[rank]
        if reporter is not None:
            reporter.expect(cache[n], first * M)
            ex.on_backward = reporter.backward_done
        ex.run(cache[n], base=first * M)
        done = first + n
        if cfg.checkpoint and cfg.checkpoint_every > 0 and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            checkpoint.save(cfg.checkpoint, done, rank, layout, module, optimizer, info)
    return _finish(cfg, result, module, layout, rank, tracer)


def _finish(cfg: TrainConfig, result: TrainResult, module: nn.Module, layout: Layout, rank: int,
            tracer: Tracer) -> TrainResult:
    result.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if cfg.save_dir and layout.replica_of(rank) == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
        torch.save(result.state, os.path.join(cfg.save_dir, f"stage{result.stage}.pt"))
    if cfg.trace:
        tracer.save(rank_path(cfg.trace, rank))
    return result


class _Reporter:
    """Tracks, on a last-stage rank, when each step's microbatches have all run backward."""

    def __init__(self, cfg: TrainConfig, result: TrainResult, samples_per_step: int, layout: Layout,
                 rank: int, losses: List[tuple]) -> None:
        self.cfg, self.result, self.samples = cfg, result, samples_per_step
        self.printing = cfg.log and layout.replica_of(rank) == 0
        self.M = cfg.microbatches
        self.left: Dict[int, int] = {}
        self.losses = losses  # the executor's (global microbatch, loss) list
        self.t_last = time.perf_counter()

    def expect(self, actions: Sequence[Any], base: int) -> None:
        for a in actions:
            if a.kind is Kind.F:
                s = (base + a.mb) // self.M
                self.left[s] = self.left.get(s, 0) + 1

    def backward_done(self, g: int) -> None:
        s = g // self.M
        self.left[s] -= 1
        if self.left[s]:
            return
        del self.left[s]
        now = time.perf_counter()
        sps = self.samples / max(now - self.t_last, 1e-9)
        self.t_last = now
        vals = [l for g, l in self.losses if g // self.M == s]
        loss = sum(vals) / max(len(vals), 1)
        self.result.samples_per_s.append(sps)
        self.result.losses.append(loss)
        if self.printing:
            print(f"step {s + 1}/{self.cfg.steps}  loss {loss:.6f}  samples/s {sps:.1f}", flush=True)
