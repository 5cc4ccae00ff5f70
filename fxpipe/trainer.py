"""``fxpipe.train``: pipeline-parallel training from one's own script, as ``fxpipe train`` does it.

``fxpipe train`` (the CLI) parses its options and calls this function, so
the two share every behaviour: the parent process checks the settings and
the first batch, captures, profiles, partitions and splits once, writes a run
folder, starts one torchrun worker per rank and reports the failing rank's
one line if the run fails (``fxpipe.runtime.launch``).

How the model, data and loss reach the workers. The workers are separate
processes. The model's weights never need to: they travel in the split
(stage files and weights). The data source, loss function and example
tensors do:

- ``model`` a file path or ``package.module:factory`` string: every worker
  loads that file again for its ``batches()``, ``loss_fn`` and examples;
- ``model`` an ``nn.Module``: ``batches``, ``loss_fn``, ``example_inputs``
  and ``example_targets`` are pickled into the run folder
  (``fxpipe.runtime.payload``). Functions and classes go by name, so define
  them at module level (of an importable module, or of your script with the
  call under ``if __name__ == "__main__":``, the script is run again in each
  worker to find them); a lambda or a nested function is refused at once with
  one line naming it.

Every rank calls ``batches()`` itself and must see the same data, so make it
deterministic (each worker seeds torch with 0 before training; shuffle with
a seeded generator). ``batches`` may also be a list or another re-iterable
(a DataLoader): it is pickled by value and iterated anew at each epoch.
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from passes.errors import FxpipeError
from passes.partition.costmodel import DEFAULT_SCHEDULE

_CALLED_HERE = ("model", "batches", "loss_fn", "example_inputs", "example_targets", "leaf_modules",
                "concrete_args")


@dataclass
class TrainOutcome:
    """What ``fxpipe.train`` hands back.

    ``losses``: each step's loss (the mean over its microbatches) from the
    step after ``start_step`` (0, or the checkpoint resumed) to the last;
    ``state_dict``: the trained weights under the original model's names
    (None with ``return_state=False`` or ``launcher="none"``); ``saved``: the
    ``save`` path; ``plan`` and ``split``: the plan and the ``SplitModel`` the
    run used; ``command``: with ``launcher="none"``, the torchrun line to run
    on every node.
    """

    losses: List[float] = field(default_factory=list)
    samples_per_s: List[float] = field(default_factory=list)
    start_step: int = 0
    state_dict: Optional[Dict[str, Any]] = None
    saved: Optional[str] = None
    plan: Any = None
    split: Any = None
    run_dir: Optional[str] = None
    command: Optional[str] = None


def train(model: Any, batches: Any = None, *, devices: Optional[int] = None, steps: int = 10,
          schedule: str = DEFAULT_SCHEDULE, microbatches: Optional[int] = None, optimizer: Union[str, type] = "sgd",
          lr: Optional[float] = None, loss_fn: Any = None, example_inputs: Any = None,
          example_targets: Any = None, leaf_modules: Iterable[Any] = (), concrete_args: Optional[dict] = None,
          save: Optional[str] = None, checkpoint: Optional[str] = None,
          resume: bool = False, split: Optional[str] = None, run_dir: Optional[str] = None,
          launcher: str = "torchrun", threads: Optional[int] = None, timeout: float = 300.0,
          time_limit: float = 20.0, return_state: bool = True, debug: bool = False,
          **options: Any) -> TrainOutcome:
    """Train ``model`` on ``devices`` local workers; the settings and semantics of ``fxpipe train``.

    ``model``: an ``nn.Module`` (then give ``batches`` and ``loss_fn``; see
    the module docstring for how they reach the workers), or a model file /
    ``package.module:factory`` string, which brings its own. ``batches``: a
    zero-argument function returning an iterator of ``(inputs, targets)``,
    each one microbatch or one step of ``microbatches`` microbatches (cut
    along dim 0), or a list of them. ``example_inputs``: one microbatch;
    default the inputs of ``batches``' first item. ``loss_fn(outputs,
    targets)``: default the sum of the outputs' means (a smoke test, ignores
    targets). ``microbatches`` defaults to what ``fxpipe plan`` plans with
    (``4 x devices``, see ``costmodel.default_microbatches``), or to the
    microbatches a reused ``split`` was planned for.

    ``optimizer``: ``"sgd"``, ``"adamw"`` or a ``torch.optim.Optimizer``
    class defined at module level (each stage builds its own over its
    parameters, so the class goes by name, not an instance);
    ``optimizer_options={...}`` adds keyword arguments (JSON values: they
    travel in ``run.json``). ``lr`` defaults to 0.01 for ``"sgd"``, else 0.001.

    ``options``: any other field of ``fxpipe.runtime.loop.TrainConfig``
    (``momentum``, ``weight_decay``, ``trace``, ``checkpoint_every``, ...), or
    of the planner (``bandwidth``, ``memory``, ``replication``, ... as
    ``fxpipe.split``). ``split``: a folder from ``fxpipe split`` to reuse.
    ``launcher="none"`` only writes ``run_dir`` (multi-node; the outcome's
    ``command`` says what to run). With ``return_state`` the trained weights
    come back in the outcome and, for an ``nn.Module``, are loaded into
    ``model`` (as training in this process would leave it). A failure raises
    an ``FxpipeError`` with the failing rank's line.
    """
    from fxpipe.runtime import payload
    from fxpipe.runtime.launch import failed, finish, launch, prepare, worker_command
    from fxpipe.runtime.loop import TrainConfig
    from fxpipe.runtime.preflight import PreflightError

    payload.guard_reentry()
    if launcher not in ("torchrun", "none"):
        raise PreflightError(f"launcher must be 'torchrun' or 'none', not {launcher!r}")
    if launcher == "none" and not run_dir:
        raise PreflightError("--launcher none writes the run folder for your own torchrun: give --run-dir DIR")
    cfg_options, plan_options = _sort_options(options, TrainConfig)
    M = microbatches or _default_microbatches(devices, schedule, split, plan_options.get("memory"))
    cfg = TrainConfig(schedule=schedule, microbatches=M, steps=steps,
                      optimizer=_optimizer_name(optimizer, isinstance(model, str)),
                      lr=lr if lr is not None else (0.01 if optimizer == "sgd" else 0.001),
                      checkpoint=checkpoint, resume=resume, timeout_s=timeout, **cfg_options)
    source = _source(model, batches, loss_fn, (example_inputs, example_targets), tuple(leaf_modules), concrete_args,
                     cfg.microbatches)
    own = run_dir is None
    run_dir = run_dir or tempfile.mkdtemp(prefix="fxpipe-train-")
    weights = save or (os.path.join(run_dir, "trained.pt") if return_state and launcher == "torchrun" else None)
    try:
        prep = prepare(source, cfg, devices, run_dir, split, dict(plan_options, time_limit=time_limit), weights,
                       multi_node=launcher == "none", threads=threads)
    except BaseException:
        if own:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    outcome = TrainOutcome(plan=prep.split.plan, split=prep.split, saved=save, run_dir=None if own else run_dir)
    if launcher == "none":
        outcome.command = worker_command(run_dir, prep.layout.world_size)
        print(f"fxpipe train: wrote {run_dir}; copy it to every node and run there:\n  {outcome.command}",
              file=sys.stderr, flush=True)
        return outcome
    code = launch(prep, threads, debug)
    if code != 0:  # the run folder stays: the error names its workers.log
        raise failed(run_dir, code, cfg.checkpoint, (cfg.trace, prep.layout.world_size) if cfg.trace else None)
    finish(prep, cfg, save)
    _collect(outcome, run_dir, weights if return_state else None, model)
    if own:
        shutil.rmtree(run_dir, ignore_errors=True)
    return outcome


def _default_microbatches(devices: Optional[int], schedule: str, split: Optional[str],
                          memory: Optional[int]) -> int:
    """Microbatches per step when none are asked for: the planner's default, so the
    pipeline that trains is the one the plan and its prediction were made for.

    With ``M = devices`` the 1F1B bubble ``(S-1)/(M+S-1)`` is near half the step
    on many stages; the planner's ``4 x devices`` keeps it under 20 % and costs
    1F1B no memory (it holds a pipeline's depth of microbatches whatever M is).
    A reused split keeps the count it was planned (and simulated) for.
    """
    from passes.partition.costmodel import default_microbatches

    if devices:
        return default_microbatches(devices, schedule, memory)
    plan_file = os.path.join(split, "plan.json") if split else None
    if plan_file and os.path.exists(plan_file):
        from fxpipe.plan import Plan

        plan = Plan.load(plan_file)
        saved = (plan.options or {}).get("microbatches")
        if saved:
            return int(saved)
        return default_microbatches(sum(s.replicas for s in plan.stages), schedule, memory)
    return 4


def _optimizer_name(optimizer: Any, model_file: bool) -> str:
    """``"sgd"``, ``"adamw"``, or ``"module:Class"`` of an optimizer class the workers can import."""
    import torch

    from fxpipe.runtime import payload
    from fxpipe.runtime.preflight import PreflightError

    if optimizer in ("sgd", "adamw"):
        return optimizer
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise PreflightError(f"optimizer must be 'sgd', 'adamw' or a torch.optim.Optimizer class, not {optimizer!r}")
    if payload.check_class(optimizer, "optimizer") and model_file:
        raise PreflightError(f"optimizer: class {optimizer.__qualname__} is defined in your script, which the "
                             "workers of a model file do not run; define it in an importable module")
    return f"{optimizer.__module__}:{optimizer.__qualname__}"


def _sort_options(options: Dict[str, Any], config: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``options`` split into TrainConfig fields and planner keywords; anything else is a mistake."""
    from passes.partition import CostOptions, partition

    train_names = {f.name for f in fields(config)} - {"schedule", "microbatches", "steps", "optimizer", "lr",
                                                      "checkpoint", "resume", "timeout_s"}
    plan_names = ({"capture_method", "repeats", "batch_size"}  # fxpipe.split's own ("device" is TrainConfig's)
                  | set(inspect.signature(partition).parameters) | {f.name for f in fields(CostOptions)})
    plan_names -= {"graph", "devices", "time_limit", "progress", "microbatches", "schedule", "options"}
    unknown = sorted(set(options) - train_names - plan_names)
    if unknown:
        raise FxpipeError(f"fxpipe.train got an unknown option {unknown[0]!r}; training options: "
                          f"{', '.join(sorted(train_names))}; planner options: {', '.join(sorted(plan_names))}")
    return ({k: v for k, v in options.items() if k in train_names},
            {k: v for k, v in options.items() if k not in train_names})


def _source(model: Any, batches: Any, loss_fn: Any, examples: Tuple[Any, Any], leaves: Tuple[Any, ...],
            concrete: Optional[dict], microbatches: int) -> Any:
    """A model file string as given, or a checked ``ModelSpec`` of an ``nn.Module`` and its objects."""
    import torch.nn as nn

    from fxpipe.loader import ModelSpec, check_runs, default_loss
    from fxpipe.runtime import payload
    from fxpipe.runtime.data import as_tuple, first_pair
    from fxpipe.runtime.preflight import check_first_batch

    example_inputs, example_targets = examples
    if isinstance(model, str):
        given = [n for n, v in zip(_CALLED_HERE[1:], (batches, loss_fn, example_inputs, example_targets,
                                                      leaves or None, concrete)) if v is not None]
        if given:
            raise FxpipeError(f"model {model!r} is a file or module:factory, which defines its own data and loss; "
                              f"drop {given[0]}= or pass an nn.Module")
        return model
    if not isinstance(model, nn.Module):
        raise FxpipeError(f"model must be an nn.Module or a model file / package.module:factory string, "
                          f"not {type(model).__name__}")
    batches = payload.as_batches(batches)
    from_batches = example_inputs is None
    if from_batches:
        if batches is None:
            raise FxpipeError("give batches= (a function returning (inputs, targets) pairs) or example_inputs=")
        example_inputs, first_targets = first_pair(batches)
        example_targets = first_targets if example_targets is None else example_targets
    spec = ModelSpec(model=model, example_inputs=as_tuple(example_inputs), loss_fn=loss_fn or default_loss,
                     example_targets=example_targets, leaf_modules=tuple(leaves), concrete_args=concrete,
                     batches=batches, source=f"fxpipe.train({type(model).__name__})", has_loss_fn=loss_fn is not None)
    if not from_batches:  # microbatch 0 against the example, read once; the loss is checked on its targets
        first = check_first_batch(spec, microbatches)
        if first is not None and spec.example_targets is None:
            spec.example_targets = first[1]
    if loss_fn is None:
        print("fxpipe train: no loss_fn given: training on the sum of the outputs' means (targets ignored)",
              file=sys.stderr, flush=True)
    check_runs(spec)
    return spec


def _collect(outcome: TrainOutcome, run_dir: str, weights: Optional[str], model: Any) -> None:
    """The losses rank 0 wrote, and the trained weights (loaded into ``model`` when it is an object)."""
    import torch

    from fxpipe.runtime.worker import RESULT_FILE

    with open(os.path.join(run_dir, RESULT_FILE)) as f:
        got = json.load(f)
    outcome.losses, outcome.samples_per_s, outcome.start_step = got["losses"], got["samples_per_s"], got["start_step"]
    if weights:
        outcome.state_dict = torch.load(weights, weights_only=True)
        if isinstance(model, torch.nn.Module):
            model.load_state_dict(outcome.state_dict)
