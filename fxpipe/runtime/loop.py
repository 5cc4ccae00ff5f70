"""One rank's training run: build its stage, optimizer and executor, walk the steps.

``train`` is what a worker calls once the process group is up; tests call it
directly from spawned processes. It reads the split (duck-typed: ``stages``,
``stage_inputs``, ``comm``, ``param_names``, ``tied``, ``links``), so
hand-written stage modules that follow the ``passes.comm`` contract run too.

Steps. ``1f1b-flush``, ``gpipe`` and ``zb-h1`` repeat one step's action list. With
``1f1b-stash`` a "step" is ``M`` minibatches, each with its own update; with
``2bw`` a step is one batch of ``M`` microbatches and its one update. Both
keep the pipeline full between steps: one action list covers the run up to
the next checkpoint (or the end), where it drains so the checkpoint holds
one consistent weight version.

Weight versions (``fxpipe.runtime.stash``): with a stashing schedule and the
built-in ``sgd`` / ``adamw``, the optimizer updates out of place
(``fxpipe.runtime.optim``) and versions cost no copy; ``weight_stash="copy"``
(or an optimizer the out-of-place step does not cover) uses torch's
optimizer and a copy of the weights per version.

Before every optimizer update the rank sets the step's learning rate
(``fxpipe.runtime.lr_schedule``) and, with ``clip_grad_norm``, clips the
gradients by the norm of the whole model's (``fxpipe.runtime.clipping``,
which also says what "whole" means under ``1f1b-stash``).

Reporting: see ``fxpipe.runtime.report``.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from fxpipe.runtime import checkpoint
from fxpipe.runtime.clipping import GradClipper, make_clipper
from fxpipe.runtime.data import batch_dim
from fxpipe.runtime.devices import check_device
from fxpipe.runtime.executor import Executor, LossFn
from fxpipe.runtime.groups import GradReducer, make_groups
from fxpipe.runtime.heap import keep_freed_memory
from fxpipe.runtime.lr_schedule import LRScheduleError, check_lr_schedule, lr_at, set_lr
from fxpipe.runtime.optim import copy_free_optimizer, is_out_of_place
from fxpipe.runtime.precision import LossScaler, check_precision
from fxpipe.runtime.recompute import check_recompute, recomputes
from passes.errors import FxpipeError
from passes.device_move import home_device, to_device
from passes.partition.costmodel import DEFAULT_SCHEDULE
from fxpipe.runtime.report import Reporter, StepStats
from fxpipe.runtime.stash import WeightStash
from fxpipe.runtime.trace import Tracer, rank_path
from fxpipe.runtime.transport import P2P, wires_of

STASHING = ("1f1b-stash", "2bw")  # schedules whose forwards can be overtaken by an update
CONTINUOUS = ("1f1b-stash", "2bw")  # schedules that run several steps per action list
WEIGHT_STASH = ("copy-free", "copy")


@dataclass
class TrainConfig:
    schedule: str = DEFAULT_SCHEDULE
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
    timeout_s: float = 120.0
    log: bool = True
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fxpipe.runtime.precision)
    recompute: str = "none"  # none | all | auto (fxpipe.runtime.recompute)
    recompute_stages: Optional[List[int]] = None  # auto: the stages the planner chose to recompute
    clip_grad_norm: Optional[float] = None  # clip the gradient's 2-norm to this (fxpipe.runtime.clipping)
    lr_schedule: str = "constant"  # constant | cosine | linear (fxpipe.runtime.lr_schedule)
    warmup_steps: int = 0
    min_lr: float = 0.0  # where cosine and linear decay to
    weight_stash: str = "copy-free"  # copy-free | copy: how stashing schedules keep weight versions
    device: str = "auto"  # auto | cpu | cuda (fxpipe.runtime.devices); the parent resolves auto
    log_every: int = 1  # the last stage prints a step line every that many steps (and the last)
    window_steps: int = 32  # stash, 2bw: the run's one action list is made this many steps at a time (windows)

    def __post_init__(self) -> None:
        """Settings with no meaning fail here, in the caller's process, before any worker starts."""
        check_lr_schedule(self.lr_schedule, self.warmup_steps, self.min_lr, self.lr)
        check_precision(self.precision, self.schedule)
        check_recompute(self.recompute)
        check_device(self.device)
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise LRScheduleError(f"--clip-grad-norm must be above 0, got {self.clip_grad_norm}")
        if self.log_every < 1:
            raise FxpipeError(f"--log-every must be at least 1, got {self.log_every}")
        if self.window_steps < 1:
            raise FxpipeError(f"window_steps must be at least 1, got {self.window_steps}")
        if self.weight_stash not in WEIGHT_STASH:
            raise FxpipeError(f"weight_stash {self.weight_stash!r} is not one of {', '.join(WEIGHT_STASH)}")
        if self.schedule == "2bw":
            _check_2bw(self)

    def lr_of(self, step: int) -> float:
        """The learning rate of 0-based ``step``."""
        return lr_at(step, lr=self.lr, steps=self.steps, lr_schedule=self.lr_schedule, warmup=self.warmup_steps,
                     min_lr=self.min_lr)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "TrainConfig":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def _check_2bw(cfg: TrainConfig) -> None:
    """What 2bw does not support, refused before any worker starts."""
    if cfg.clip_grad_norm is not None:
        # the global norm would make every stage wait at its update for the last one to finish the batch
        raise FxpipeError("--clip-grad-norm is not supported with --schedule 2bw; use 1f1b-flush or gpipe "
                          "to clip, or drop --clip-grad-norm")


def make_optimizer(cfg: TrainConfig, module: nn.Module, copy_free: bool = False) -> torch.optim.Optimizer:
    """The stage's optimizer; ``copy_free``: the out-of-place ``sgd`` / ``adamw`` where they cover the options."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:  # a stage without parameters still takes STEP actions
        params = [nn.Parameter(torch.zeros(()))]
    wd = {} if cfg.weight_decay is None else {"weight_decay": cfg.weight_decay}
    # the fused kernels update every tensor in one call instead of looping over them in Python: several
    # times faster for a stage of many small tensors, and with stashing the step is paid every microbatch
    fused = {"fused": True} if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) else {}
    more = cfg.optimizer_options
    if copy_free and cfg.optimizer in ("sgd", "adamw"):
        plain = {"lr": cfg.lr, **({"momentum": cfg.momentum} if cfg.optimizer == "sgd" else {}), **wd, **fused,
                 **more}
        opt = copy_free_optimizer(cfg.optimizer, params, plain)
        if opt is not None:
            return opt
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
    lrs: List[float] = field(default_factory=list)  # per step run here, the learning rate used
    grad_norms: List[float] = field(default_factory=list)  # per step, this rank's clip-unit norm before clipping
    # (stash: the largest of the step's updates on this rank)


def step_segments(cfg: TrainConfig, start: int) -> List[tuple]:
    """(first step, steps) runs of one action list each."""
    if cfg.schedule not in CONTINUOUS:
        return [(s, 1) for s in range(start, cfg.steps)]
    every = cfg.checkpoint_every if cfg.checkpoint and cfg.checkpoint_every > 0 else cfg.steps
    out, s = [], start
    while s < cfg.steps:
        end = min(cfg.steps, (s // every + 1) * every)
        out.append((s, end - s))
        s = end
    return out


def segment_schedule(cfg: TrainConfig, layout: Layout, split: Any, n: int, device_type: str = "cpu",
                     ranks: Optional[Sequence[int]] = None) -> Dict[int, list]:
    """The action lists of ``ranks`` (default every rank) for a run of ``n`` steps (``step_segments``). The
    parent asks for none (``ranks=()``): only the checks that refuse a schedule the layout cannot run
    (``launch.prepare``); a worker builds its own list (flush, gpipe, zb-h1: one step) or streams it
    (``segment_actions``)."""
    from fxpipe.schedule import build_schedule

    args, more = _schedule_args(cfg, layout, split, n, device_type)
    return build_schedule(*args, ranks=ranks, **more)


def segment_actions(cfg: TrainConfig, layout: Layout, split: Any, n: int, device_type: str,
                    rank: int) -> Iterator[Action]:
    """``segment_schedule``'s list for ``rank``, one action at a time: a ``1f1b-stash`` or ``2bw`` run without
    checkpoints is one list of every step's microbatches, so it is made as it runs (``windows``)."""
    from fxpipe.schedule import rank_actions

    (schedule, layout, count, links, tied, blocking), more = _schedule_args(cfg, layout, split, n, device_type)
    return rank_actions(schedule, layout, count, links, rank, tied, blocking, **more)


def _schedule_args(cfg: TrainConfig, layout: Layout, split: Any, n: int, device_type: str) -> tuple:
    tied_stages = sorted({s for st in split.tied.values() for s in st})
    # non-tensor values: one bundle per link, posted early on gloo; NCCL completes it in the receive action
    blocking = [] if device_type == "cpu" else \
        sorted({(e.src_stage, e.dst_stage) for e in split.comm if not e.value.is_tensor})
    more = {"steps": n} if cfg.schedule == "2bw" else {}
    count = n * cfg.microbatches if cfg.schedule == "1f1b-stash" else cfg.microbatches
    return (cfg.schedule, layout, count, sorted(split.links), tied_stages, blocking), more


def windows(actions: Iterable[Action], microbatches: int, steps: int) -> Iterator[Tuple[List[Action], bool]]:
    """A continuous run's actions in pieces of about ``steps`` steps: (piece, whether it is the last).

    A piece ends right after the update (``STEP g``) that closes a step on
    this rank, so it holds every update of the steps it closes (the last stage
    counts them per step, ``Reporter.expect``) and every forward before such
    an update sees it in the same piece (``executor._updated_in_flight``).
    """
    piece: List[Action] = []
    since: List[Action] = []  # after the piece's last update
    limit = steps
    for a in actions:
        if a.kind is Kind.STEP and a.mb >= 0:
            if a.mb // microbatches >= limit and piece:
                yield piece, False
                piece, limit = [], (a.mb // microbatches // steps + 1) * steps
            piece += since
            piece.append(a)
            since = []
        else:
            since.append(a)
    yield piece + since, True


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
    replica_group: Optional[Any]  # this stage's replicas (None: one)
    tracer: Tracer
    clipper: Optional[GradClipper]


def _setup(rank: int, layout: Layout, split: Any, cfg: TrainConfig, data: Callable[[int], Any],
           loss_fn: Optional[LossFn], device: torch.device) -> _Rank:
    stage = layout.stage_of(rank)
    if device.type != "cpu":  # guarded GPU path: data is loaded on the CPU, stages run on the device
        data = _on_device(data, device)
    # stages are loaded on the CPU; an export graph's device constants move with the parameters
    module = to_device(split.stages[stage], device, home_device(split.stages[stage]) or torch.device("cpu"))
    module.train()
    update_per_mb = cfg.schedule == "1f1b-stash"  # an update per minibatch (2bw: per batch, as flush)
    optimizer = make_optimizer(cfg, module, copy_free=cfg.schedule in STASHING and cfg.weight_stash == "copy-free")
    stash = WeightStash(module, stash=cfg.schedule in STASHING, copy_free=is_out_of_place(optimizer),
                        batch=cfg.microbatches if cfg.schedule == "2bw" else None)
    groups = make_groups(layout, split.tied, rank)
    # the name the stage's parameters() keep: a tensor the stage holds under two names is one parameter
    local_of = {orig: local for local, orig in split.param_names[stage].items() if local in stash.master}
    reducer = GradReducer(groups, stash.master, local_of, 1.0 / layout.replicas[stage] if update_per_mb else 1.0)
    clipper = None
    if cfg.clip_grad_norm is not None:  # after make_groups: every rank creates groups in one order
        clipper = make_clipper(cfg.clip_grad_norm, layout, rank, stash.master, split.param_names[stage],
                               split.tied, update_per_mb, device)
    tracer = Tracer(rank, enabled=bool(cfg.trace), spill=rank_path(cfg.trace, rank) if cfg.trace else None)
    scaler = LossScaler(device=device) if cfg.precision == "fp16" else None
    p2p = P2P(wires_of(split.comm), device, cfg.timeout_s, tracer.wait_span if cfg.trace else None)
    ex = Executor(rank=rank, layout=layout, stage=stage, module=module, input_indices=split.stage_inputs[stage],
                  is_last=stage == layout.num_stages - 1, stash=stash, optimizer=optimizer, p2p=p2p,
                  reducer=reducer, data=data, loss_fn=loss_fn,
                  loss_scale=1.0 if update_per_mb else 1.0 / cfg.microbatches, tracer=tracer,
                  flatten=getattr(split, "flatten_inputs", list),
                  unflatten=getattr(split, "unflatten_outputs", lambda out: out), precision=cfg.precision,
                  recompute=recomputes(cfg.recompute, cfg.recompute_stages, stage), scaler=scaler)
    return _Rank(stage, module, optimizer, ex, groups.replica, tracer, clipper)


def train(*, rank: int, layout: Layout, split: Any, cfg: TrainConfig, data: Callable[[int], Any],
          loss_fn: Optional[LossFn], device: torch.device = torch.device("cpu"),
          observe: Optional[Callable[[Executor], None]] = None) -> TrainResult:
    """Run ``cfg.steps`` steps on this rank; collective over all ranks of ``layout``.

    ``observe`` is called with the executor after every optimizer step (tests
    watch its ``live_counts`` over a long run).
    """
    keep_freed_memory()  # every step allocates the same again (fxpipe.runtime.heap)
    r = _setup(rank, layout, split, cfg, data, loss_fn, device)
    try:
        return _steps(r, rank, layout, split, cfg, data, device, observe)
    except BaseException:
        if cfg.trace:  # what this rank did up to the failure: the parent merges it and names the file
            with contextlib.suppress(Exception):
                r.tracer.save(rank_path(cfg.trace, rank))
        raise


def _steps(r: _Rank, rank: int, layout: Layout, split: Any, cfg: TrainConfig, data: Callable[[int], Any],
           device: torch.device, observe: Optional[Callable[[Executor], None]]) -> TrainResult:
    """``train``'s steps on the rank ``_setup`` made: schedules built, run, reported, checkpointed."""
    if observe is not None:
        r.ex.on_step = lambda: observe(r.ex)
    M, continuous = cfg.microbatches, cfg.schedule in CONTINUOUS
    info = checkpoint_info(cfg)
    two_bw = cfg.schedule == "2bw"
    start = checkpoint.restore(cfg.checkpoint, rank, layout, r.module, r.optimizer, info, device,
                               older=r.ex.stash.load_older_state if two_bw else None) if cfg.resume else 0
    stats = StepStats(clipping=r.clipper is not None)
    reporter = None
    if r.stage == layout.num_stages - 1:
        # flush/gpipe sum the loss over the replicas every step; stash/2bw once, after the run (report.py)
        each, after = (None, r.replica_group) if continuous else (r.replica_group, None)
        reporter = Reporter(cfg.steps, M, M * batch_dim(data(0)[0]), cfg.log and layout.replica_of(rank) == 0,
                            r.ex.losses, each, notes=stats.note, settle=r.ex.settle_losses, final_group=after,
                            device=device, every=cfg.log_every)
    current = [start]  # the flush/gpipe step running now
    r.ex.before_step = _before_step(cfg, r, stats, reporter if continuous else None, current)
    cache: Dict[int, list] = {}
    for first, n in step_segments(cfg, start):
        current[0] = first
        if continuous:  # the n steps are one list, made and run a window at a time
            pieces = windows(segment_actions(cfg, layout, split, n, device.type, rank), M, cfg.window_steps)
            for piece, last in pieces:
                if reporter is not None:
                    reporter.expect(piece, first * M)
                r.ex.run(piece, base=first * M, final=last)
        else:
            if n not in cache:
                cache[n] = segment_schedule(cfg, layout, split, n, device.type, ranks=(rank,))[rank]
            r.ex.run(cache[n], base=first * M)
            if reporter is not None:
                reporter.step_done(first)
        done = first + n
        if cfg.checkpoint and (cfg.checkpoint_every > 0 and done % cfg.checkpoint_every == 0 or done == cfg.steps):
            checkpoint.save(cfg.checkpoint, done, rank, layout, r.module, r.optimizer, info, device,
                            older=r.ex.stash.older_state() if two_bw else None)
            if reporter is not None:
                reporter.restart_clock()
    lrs, norms = stats.done()
    result = TrainResult(rank, r.stage, start, lrs=lrs, grad_norms=norms)
    if reporter is not None:
        reporter.finish()
        result.losses, result.samples_per_s = reporter.step_losses, reporter.samples_per_s
    return _finish(cfg, result, r.module, layout, rank, r.tracer)


def checkpoint_info(cfg: TrainConfig) -> Dict[str, Any]:
    """The settings a checkpoint records and ``--resume`` must match (the schedule's shape included)."""
    return {"schedule": cfg.schedule, "microbatches": cfg.microbatches, "lr_schedule": cfg.lr_schedule,
            "warmup_steps": cfg.warmup_steps, "min_lr": cfg.min_lr}


def _before_step(cfg: TrainConfig, r: _Rank, stats: StepStats, stash_reporter: Optional[Reporter],
                 current: List[int]) -> Callable[[int], None]:
    """What runs right before every optimizer update: the step's learning rate, then clipping.

    ``g`` is the global minibatch whose backward the update follows (stash,
    2bw: its step is ``g // M``) or -1 (flush, gpipe: the step in
    ``current``). With stash and 2bw the step line is printed from here too,
    once the step's last update on the last stage is clipped, so its norm
    counts in the line.
    """
    def hook(g: int) -> None:
        step = g // cfg.microbatches if g >= 0 else current[0]
        lr = cfg.lr_of(step)
        set_lr(r.optimizer, lr)
        stats.record(step, lr, r.clipper() if r.clipper is not None else None)
        if stash_reporter is not None:
            stash_reporter.backward_done(g)
    return hook


def _finish(cfg: TrainConfig, result: TrainResult, module: nn.Module, layout: Layout, rank: int,
            tracer: Tracer) -> TrainResult:
    result.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if cfg.trace:
        tracer.save(rank_path(cfg.trace, rank))
    return result
