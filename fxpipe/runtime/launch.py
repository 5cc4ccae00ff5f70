"""``fxpipe train`` on one machine: plan and split once, then ``torch.distributed.run``.

The parent process does the work that needs the whole model exactly once:
load the model file, capture, profile, partition (or reuse a saved split),
split, and save the split into a run folder with ``run.json`` (the training
settings and the stage replicas). It then starts ``torchrun --standalone``
with one worker per rank (``python -m fxpipe.runtime.worker RUN_DIR``); each
worker loads only the split and the model file's data and loss.

After the workers exit the parent merges the per-rank trace files into one
Chrome trace and, for ``--save``, turns the per-stage final weights back into
a ``state_dict`` under the original model's parameter names.

Multi-node: run ``torchrun ... -m fxpipe.runtime.worker RUN_DIR`` yourself on
every node with a shared RUN_DIR written by ``prepare``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig
from fxpipe.runtime.trace import merge, rank_path
from fxpipe.runtime.worker import RUN_FILE, SPLIT_DIR
from passes.errors import FxpipeError


class LaunchError(FxpipeError):
    """The workers did not finish: the message says which and where to look."""


@dataclass
class Prepared:
    run_dir: str
    layout: Layout
    split: Any
    spec: Any
    predicted_samples_per_s: Optional[float] = None


def _log(msg: str) -> None:
    print(f"fxpipe train: {msg}", file=sys.stderr, flush=True)


def plan_and_split(spec: Any, devices: int, schedule: str, microbatches: int,
                   plan_options: Optional[Dict[str, Any]] = None) -> Any:
    """``fxpipe.split`` of ``spec``'s model for this schedule; returns a ``SplitModel`` with its plan."""
    from fxpipe.api import split
    from passes.capture_check import restore_buffers, save_buffers

    opts = dict(plan_options or {})
    saved = save_buffers(spec.model)  # profiling runs the model: keep BatchNorm statistics as given
    result = split(spec.model, spec.example_inputs, devices, leaf_modules=spec.leaf_modules,
                   concrete_args=spec.concrete_args, time_limit=opts.pop("time_limit", 20.0),
                   microbatches=microbatches, schedule=schedule, **opts)
    restore_buffers(saved)
    print(result.plan.table(), file=sys.stderr, flush=True)
    return result


def prepare(model: str, cfg: TrainConfig, devices: Optional[int], run_dir: str, split_dir: Optional[str] = None,
            plan_options: Optional[Dict[str, Any]] = None) -> Prepared:
    """Write RUN_DIR (split + run.json) for ``model``; ``split_dir`` reuses a saved split."""
    from fxpipe.loader import load_model
    from fxpipe.split_model import SplitModel

    spec = load_model(model)
    kept = os.path.join(cfg.checkpoint, SPLIT_DIR) if cfg.checkpoint else None
    if cfg.resume and kept and os.path.exists(kept) and not split_dir:
        split_dir = kept  # resume the very split the checkpoint was taken with (a new plan could differ)
        _log(f"resuming with the split saved in {kept}")
    if split_dir:
        split = SplitModel.load(split_dir)
    else:
        if not devices:
            raise FxpipeError("fxpipe train: give --devices N (or --split DIR from `fxpipe split`)")
        split = plan_and_split(spec, devices, cfg.schedule, cfg.microbatches, plan_options)
    replicas = [s.replicas for s in split.plan.stages] if split.plan is not None else [1] * split.num_stages
    layout = Layout.of(replicas)
    if devices and devices != layout.world_size:
        raise FxpipeError(f"the split uses {layout.world_size} devices ({replicas} replicas per stage), "
                          f"not --devices {devices}; drop --devices or split again")
    os.makedirs(run_dir, exist_ok=True)
    split.save(os.path.join(run_dir, SPLIT_DIR))
    if kept and split_dir != kept:
        split.save(kept)
    job = {"model": os.path.abspath(model) if os.path.exists(model) else model,
           "replicas": replicas, "config": cfg.to_json()}
    with open(os.path.join(run_dir, RUN_FILE), "w") as f:
        json.dump(job, f, indent=1)
    if spec.batches is None:
        _log(f"{model} defines no batches(): every microbatch is the example minibatch, repeated")
    return Prepared(run_dir, layout, split, spec, _predict(split, cfg, layout.world_size))


def _predict(split: Any, cfg: TrainConfig, world: int) -> Optional[float]:
    """Samples/s the simulator predicts for this run from the plan's profiled costs.

    Printed before training and again beside the measured rate at the end, so a
    user sees at once how far the cost model is from this machine. On CPU the
    optimizer step of each stage is timed here (``fxpipe.runtime.stepcost``);
    on GPUs it is left out (timing it would need the workers' devices).
    """
    if split.plan is None:
        return None
    from fxpipe.runtime.stepcost import step_costs
    from fxpipe.simulate import simulate_split

    steps = None if torch.cuda.is_available() else step_costs(split, cfg)
    try:
        sim = simulate_split(split, cfg.schedule, cfg.microbatches, step_s=steps)
    except FxpipeError as exc:  # a plan the simulator cannot replay must not stop training
        _log(f"no prediction: {exc}")
        return None
    with_step = "optimizer step included" if steps else "optimizer step not included"
    _log(f"predicted {sim.samples_per_s:.1f} samples/s ({cfg.schedule}, {sim.microbatches} microbatches, "
         f"simulated from the profile, {with_step}; bubble {sim.bubble_fraction:.0%})")
    cores = os.cpu_count() or 1
    if steps is not None and world > cores:
        _log(f"note: {world} ranks share {cores} CPU cores here; the prediction gives every rank its own "
             "core, so expect a lower measured rate")
    return sim.samples_per_s


_STEP_LINE = re.compile(r"^step (\d+)/\d+ .*samples/s ([\d.]+)")


def _compare(predicted: Optional[float], rates: List[float]) -> None:
    """Measured median (first step left out: warm-up) next to the prediction."""
    steady = rates[1:] or rates
    if not steady:
        return
    measured = statistics.median(steady)
    line = f"measured {measured:.1f} samples/s (median of {len(steady)} steps)"
    if predicted:
        line += f"; predicted {predicted:.1f}; measured / predicted = {measured / predicted:.2f}"
    _log(line)


def launch(prep: Prepared, threads: Optional[int] = None) -> int:
    """Run the workers under torchrun; returns their exit code."""
    world = prep.layout.world_size
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads or max(1, (os.cpu_count() or 1) // world))
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "--max-restarts=0", "-m", "fxpipe.runtime.worker", prep.run_dir]
    _log(f"starting {world} workers: {' '.join(cmd[2:])}")
    rates: List[float] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        for line in proc.stdout or ():  # echo the workers' output, keep the step rates
            sys.stdout.write(line)
            sys.stdout.flush()
            m = _STEP_LINE.match(line)
            if m:
                rates.append(float(m.group(2)))
    if proc.returncode == 0:
        _compare(prep.predicted_samples_per_s, rates)
    return proc.returncode


def finish(prep: Prepared, cfg: TrainConfig, save: Optional[str]) -> None:
    """Merge traces; write the trained weights under the original parameter names."""
    if cfg.trace:
        n = merge([rank_path(cfg.trace, r) for r in range(prep.layout.world_size)], cfg.trace)
        _log(f"wrote {cfg.trace} ({n} events; open in chrome://tracing or ui.perfetto.dev)")
    if save and cfg.save_dir:
        states = [torch.load(os.path.join(cfg.save_dir, f"stage{j}.pt"), weights_only=False)
                  for j in range(prep.split.num_stages)]
        state = prep.split.original_state_dict(states)
        torch.save(state, save)
        _log(f"wrote {save} ({len(state)} tensors; load with model.load_state_dict(torch.load(...)))")


def train(model: str, cfg: TrainConfig, devices: Optional[int], save: Optional[str] = None,
          split_dir: Optional[str] = None, run_dir: Optional[str] = None, threads: Optional[int] = None,
          plan_options: Optional[Dict[str, Any]] = None) -> int:
    """The whole of ``fxpipe train``; returns the process exit code."""
    own = run_dir is None
    run_dir = run_dir or tempfile.mkdtemp(prefix="fxpipe-train-")
    if save:
        cfg.save_dir = os.path.join(run_dir, "final")
    prep = prepare(model, cfg, devices, run_dir, split_dir, plan_options)
    code = launch(prep, threads)
    if code != 0:
        raise LaunchError(f"training failed (workers exited with code {code}); the first worker error is "
                          f"printed above. Run folder kept: {run_dir}")
    finish(prep, cfg, save)
    if own:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0
