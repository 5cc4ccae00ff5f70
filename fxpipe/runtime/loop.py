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

Reporting: see ``fxpipe.runtime.report``.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from fxpipe.layout import Layout
from fxpipe.runtime import checkpoint
from fxpipe.runtime.data import batch_dim
from fxpipe.runtime.executor import Executor, LossFn
from fxpipe.runtime.groups import GradReducer, make_groups
from fxpipe.runtime.precision import LossScaler, check_precision
from fxpipe.runtime.recompute import recomputes
from fxpipe.runtime.report import Reporter
from fxpipe.runtime.stash import WeightStash
from fxpipe.runtime.trace import Tracer, rank_path
from fxpipe.runtime.transport import P2P, wires_of

SCHEDULES = ("1f1b-stash", "1f1b-flush", "gpipe")


@dataclass
class TrainConfig:
    schedule: str = "1f1b-flush"
    microbatches: int = 4
    steps: int = 10
    optimizer: str = "sgd"  # or "module:Class" of a torch.optim.Optimizer (fxpipe.train(optimizer=Class))
    optimizer_options: Dict[str, Any] = field(default_factory=dict)  # more keyword arguments for it
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
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fxpipe.runtime.precision)
    recompute: str = "none"  # none | all | auto (fxpipe.runtime.recompute)
    recompute_stages: Optional[List[int]] = None  # auto: the stages the planner chose to recompute

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
    # the fused kernels update every tensor in one call: on the bench's GPT stage AdamW's step takes
    # 0.6 ms fused against 4 ms per-tensor, paid once per microbatch with stashing
    fused = {"fused": True} if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) else {}
    more = cfg.optimizer_options
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, **{"lr": cfg.lr, "momentum": cfg.momentum, **wd, **fused, **more})
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **{"lr": cfg.lr, **wd, **fused, **more})
    if ":" in cfg.optimizer:  # each stage builds its own over its parameters
        module, _, name = cfg.optimizer.partition(":")
        return getattr(importlib.import_module(module), name)(params, **{"lr": cfg.lr, **wd, **more})
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


def _on_device(data: Callable[[int], Any], device: torch.device) -> Callable[[int], Any]:
    from torch.utils._pytree import tree_map

    def moved(g: int) -> Any:
        return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, data(g))
    return moved


@dataclass
class _Rank:
    """What one rank trains with."""

    stage: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    ex: Executor
    loss_group: Optional[Any]
    tracer: Tracer


def _setup(rank: int, layout: Layout, split: Any, cfg: TrainConfig, data: Callable[[int], Any],
           loss_fn: Optional[LossFn], device: torch.device) -> _Rank:
    stage = layout.stage_of(rank)
    if device.type != "cpu":  # guarded GPU path: data is loaded on the CPU, stages run on the device
        data = _on_device(data, device)
    module = split.stages[stage].to(device)
    module.train()
    stashing = cfg.schedule == "1f1b-stash"
    stash = WeightStash(module, stash=stashing)
    optimizer = make_optimizer(cfg, module)
    groups = make_groups(layout, split.tied, rank)
    # the name the stage's parameters() keep: a tensor the stage holds under two names is one parameter
    local_of = {orig: local for local, orig in split.param_names[stage].items() if local in stash.master}
    reducer = GradReducer(groups, stash.master, local_of, 1.0 / layout.replicas[stage] if stashing else 1.0)
    tracer = Tracer(rank, enabled=bool(cfg.trace))
    check_precision(cfg.precision, cfg.schedule)
    scaler = LossScaler(device=device) if cfg.precision == "fp16" else None
    p2p = P2P(wires_of(split.comm), device, cfg.timeout_s, tracer.wait_span if cfg.trace else None)
    ex = Executor(rank=rank, layout=layout, stage=stage, module=module, input_indices=split.stage_inputs[stage],
                  is_last=stage == layout.num_stages - 1, stash=stash, optimizer=optimizer, p2p=p2p,
                  reducer=reducer, data=data, loss_fn=loss_fn,
                  loss_scale=1.0 if stashing else 1.0 / cfg.microbatches, tracer=tracer,
                  flatten=getattr(split, "flatten_inputs", list),
                  unflatten=getattr(split, "unflatten_outputs", lambda out: out), precision=cfg.precision,
                  recompute=recomputes(cfg.recompute, cfg.recompute_stages, stage), scaler=scaler)
    return _Rank(stage, module, optimizer, ex, None if stashing else groups.replica, tracer)


def train(*, rank: int, layout: Layout, split: Any, cfg: TrainConfig, data: Callable[[int], Any],
          loss_fn: Optional[LossFn], build: Optional[Callable[..., Dict[int, list]]] = None,
          device: torch.device = torch.device("cpu"),
          observe: Optional[Callable[[Executor], None]] = None) -> TrainResult:
    """Run ``cfg.steps`` steps on this rank; collective over all ranks of ``layout``.

    ``observe`` is called with the executor after every optimizer step (tests
    watch its ``live_counts`` over a long run).
    """
    if build is None:
        from fxpipe.schedule import build_schedule as build
    r = _setup(rank, layout, split, cfg, data, loss_fn, device)
    if observe is not None:
        r.ex.on_step = lambda: observe(r.ex)
    M, stashing = cfg.microbatches, cfg.schedule == "1f1b-stash"
    info = {"schedule": cfg.schedule, "microbatches": M}
    start = checkpoint.restore(cfg.checkpoint, rank, layout, r.module, r.optimizer, info) if cfg.resume else 0
    reporter = None
    if r.stage == layout.num_stages - 1:
        reporter = Reporter(cfg.steps, M, M * batch_dim(data(0)[0]), cfg.log and layout.replica_of(rank) == 0,
                            r.ex.losses, r.loss_group)
        r.ex.on_backward = reporter.backward_done if stashing else None
    tied_stages = sorted({s for st in split.tied.values() for s in st})
    cache: Dict[int, list] = {}
    for first, n in _segments(cfg, start):
        if n not in cache:
            cache[n] = build(cfg.schedule, layout, n * M if stashing else M, sorted(split.links), tied_stages)[rank]
        if reporter is not None and stashing:
            reporter.expect(cache[n], first * M)
        r.ex.run(cache[n], base=first * M)
        if reporter is not None and not stashing:
            reporter.step_done(first)
        done = first + n
        if cfg.checkpoint and (cfg.checkpoint_every > 0 and done % cfg.checkpoint_every == 0 or done == cfg.steps):
            checkpoint.save(cfg.checkpoint, done, rank, layout, r.module, r.optimizer, info)
            if reporter is not None:
                reporter.restart_clock()
    result = TrainResult(rank, r.stage, start)
    if reporter is not None:
        result.losses, result.samples_per_s = reporter.step_losses, reporter.samples_per_s
    return _finish(cfg, result, r.module, layout, rank, r.tracer)


def _finish(cfg: TrainConfig, result: TrainResult, module: nn.Module, layout: Layout, rank: int,
            tracer: Tracer) -> TrainResult:
    result.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if cfg.save_dir and layout.replica_of(rank) == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
        torch.save(result.state, os.path.join(cfg.save_dir, f"stage{result.stage}.pt"))
    if cfg.trace:
        tracer.save(rank_path(cfg.trace, rank))
    return result
