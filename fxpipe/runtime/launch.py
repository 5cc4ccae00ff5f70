"""The steps of ``fxpipe.train`` (and so of ``fxpipe train``): plan and split once, then ``torch.distributed.run``.

``fxpipe.trainer.train`` calls these in order. The parent process does the
work that needs the whole model exactly once: load the model file (or take
the ``nn.Module`` and objects a script passed, pickled for the workers by
``fxpipe.runtime.payload``), check it (``fxpipe.runtime.preflight``),
capture, profile, partition (or reuse a saved split), split, and save the
split into a run folder with ``run.json`` (the training settings and the
stage replicas). It then starts ``torchrun --standalone`` with one worker per
rank (``python -m fxpipe.runtime.worker RUN_DIR``); each worker loads only
the split and the data and loss (the model file's, or the pickled ones).

Workers' stderr, torchrun's included, goes to ``RUN_DIR/workers.log`` (shown
after a successful run; with ``--debug`` shown live). A failed run ends with
the one line of the rank whose failure started it (``fxpipe.runtime.failure``).
After the workers exit the parent merges the per-rank trace files into one
Chrome trace; ``--save`` is written by rank 0 (``fxpipe.runtime.worker``).

Multi-node: ``launcher="none"`` (``fxpipe train ... --launcher none
--run-dir RUN``) stops after writing RUN and prints the ``torchrun`` command
to run on every node with a copy of RUN.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from fxpipe.layout import Layout
from fxpipe.runtime import checkpoint, failure, payload
from fxpipe.runtime.devices import gpu_count, resolve_device
from fxpipe.runtime.loop import TrainConfig, checkpoint_info, segment_schedule, step_segments
from fxpipe.runtime.preflight import check_config, check_count, check_first_batch, check_split_matches
from fxpipe.runtime.trace import merge, rank_path
from fxpipe.runtime.worker import RUN_FILE, SPLIT_DIR
from passes.errors import FxpipeError


WORKERS_LOG = "workers.log"


class LaunchError(FxpipeError):
    """The workers did not finish: the message says which and where to look."""


@dataclass
class Prepared:
    run_dir: str
    layout: Layout
    split: Any
    spec: Any
    predicted_samples_per_s: Optional[float] = None
    log_every: int = 1  # steps between the workers' step lines (their rates are over those)


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


def worker_threads(threads: Optional[int], world: int) -> int:
    """Torch threads per local worker: ``threads``, else this machine's cores shared out (at least one)."""
    return threads or max(1, (os.cpu_count() or 1) // world)


def prepare(model: Union[str, Any], cfg: TrainConfig, devices: Optional[int], run_dir: str,
            split_dir: Optional[str] = None, plan_options: Optional[Dict[str, Any]] = None,
            save: Optional[str] = None, multi_node: bool = False, threads: Optional[int] = None) -> Prepared:
    """Write RUN_DIR (split + run.json) for ``model``; ``split_dir`` reuses a saved split.

    ``model``: a model file or ``package.module:factory`` (the workers load it
    again for its data and loss), or a ``fxpipe.loader.ModelSpec`` built in
    this process (``fxpipe.train``: its data, loss and example travel in a
    pickle, ``fxpipe.runtime.payload``, checked first, before any profiling).
    Everything the parent can check alone is checked here, before any worker
    starts: the settings, the first batch, the split against the model, and
    the checkpoint to resume from. ``cfg.device`` is resolved here
    (``fxpipe.runtime.devices``) for the workers this machine starts; with
    ``multi_node`` (``--launcher none``) it stays as asked and each worker
    resolves ``auto`` on its own node.
    """
    from fxpipe.loader import load_model

    check_config(cfg)
    if devices is not None:
        check_count("--devices", devices, 1)
    spec = load_model(model) if isinstance(model, str) else model
    os.makedirs(run_dir, exist_ok=True)
    shipped = None if isinstance(model, str) else payload.write(run_dir, {
        "batches": spec.batches, "loss_fn": spec.loss_fn, "example_inputs": spec.example_inputs,
        "example_targets": spec.example_targets}, main=cfg.optimizer.startswith("__main__:"))
    if isinstance(model, str):  # fxpipe.train checked its objects' first batch where it read it
        check_first_batch(spec, cfg.microbatches)
    kept = os.path.join(cfg.checkpoint, SPLIT_DIR) if cfg.checkpoint else None
    if cfg.resume and kept and os.path.exists(kept) and not split_dir:
        split_dir = kept  # resume the very split the checkpoint was taken with (a new plan could differ)
        _log(f"resuming with the split saved in {kept}")
    plan_options = dict(plan_options or {})
    # --recompute auto: the partitioner cannot model recomputation yet, so it plans without the memory
    # limit and each stage over it recomputes (fxpipe.runtime.recompute.auto_stages)
    budget = plan_options.pop("memory", None) if cfg.recompute == "auto" else None
    requested = cfg.device
    if multi_node:  # the nodes may not be this machine: each worker resolves auto on its node
        profile_on = "cuda" if requested != "cpu" and gpu_count() else "cpu"
    else:  # profiling runs where training will
        profile_on = resolve_device(requested, devices) if devices else "cpu"
    split = _split(spec, cfg, devices, split_dir, plan_options, profile_on)
    if cfg.recompute == "auto":
        from fxpipe.runtime.recompute import auto_stages
        cfg.recompute_stages = auto_stages(split, budget, _log)
    replicas = [s.replicas for s in split.plan.stages] if split.plan is not None else [1] * split.num_stages
    layout = Layout.of(replicas)
    if devices and devices != layout.world_size:
        raise FxpipeError(f"the split uses {layout.world_size} devices ({replicas} replicas per stage), "
                          f"not --devices {devices}; drop --devices or split again")
    if not multi_node:
        cfg.device = resolve_device(requested, layout.world_size)
        _say_device(cfg.device, requested, layout.world_size)
    for n in sorted({n for _, n in step_segments(cfg, 0)}):  # a schedule this layout cannot run: one line here
        segment_schedule(cfg, layout, split, n, "cpu" if cfg.device == "auto" else cfg.device, ranks=())
    if cfg.resume:
        step = checkpoint.check(cfg.checkpoint, layout, checkpoint_info(cfg), split.stages)
        _log(f"resuming from the checkpoint of step {step} in {cfg.checkpoint}")
    job: Dict[str, Any] = {"payload": shipped, "source": spec.source} if shipped else _model_file(run_dir, model)
    _write_run_dir(run_dir, job, split, replicas, cfg, save)
    if kept and split_dir != kept:
        split.save(kept)
    if spec.batches is None:
        _log(f"{spec.source} defines no batches(): every microbatch is the example minibatch, repeated")
    on_cpu = (profile_on if cfg.device == "auto" else cfg.device) == "cpu"  # auto stays only multi-node
    # multi-node: each node's workers share its own cores, unknown here; the prediction assumes one thread
    per_worker = 1 if multi_node else worker_threads(threads, layout.world_size)
    return Prepared(run_dir, layout, split, spec,
                    _predict(split, cfg, layout.world_size, on_cpu, spec.example_inputs, per_worker), cfg.log_every)


def _split(spec: Any, cfg: TrainConfig, devices: Optional[int], split_dir: Optional[str],
           plan_options: Optional[Dict[str, Any]], profile_on: str = "cpu") -> Any:
    """The saved split (checked against the model) or a new one."""
    from fxpipe.split_model import SplitModel

    if split_dir:
        split = SplitModel.load(split_dir)
        check_split_matches(split, spec.model, split_dir, spec.source)
        _say_precision(split_dir, cfg.precision)
        return split
    if not devices:
        raise FxpipeError("give --devices N (or --split DIR from `fxpipe split`)")
    # profiled under the autocast training will run in, so the plan sees those times and bytes
    return plan_and_split(spec, devices, cfg.schedule, cfg.microbatches,
                          dict(plan_options or {}, precision=cfg.precision, device=profile_on))


def _say_precision(split_dir: str, precision: str) -> None:
    """A line where the split was planned on times of another precision than training runs in (its
    profile.json says which; the plan still runs, its balance is that precision's)."""
    path = os.path.join(split_dir, "profile.json")
    try:
        with open(path) as f:
            taken = json.load(f).get("info", {}).get("precision", "fp32")
    except (OSError, ValueError):
        return
    if taken != precision:
        _log(f"{split_dir} was planned on {taken} times; training runs in {precision} (split again with "
             f"`fxpipe split ... --precision {precision}` for a plan balanced on those)")


def _say_device(device: str, requested: str, world: int) -> None:
    """One line where a GPU is in play: which device the workers got, and why for ``auto``."""
    gpus = gpu_count()
    if device == "cuda":
        _log(f"{world} worker{'s' if world > 1 else ''} on CUDA (NCCL, one GPU each)")
    elif gpus and requested == "auto":
        _log(f"{world} workers on CPU (gloo): this machine has {gpus} GPU{'s' if gpus > 1 else ''} and NCCL "
             f"needs one per worker; --device cuda with --devices {gpus} or fewer uses them")


def _model_file(run_dir: str, model: str) -> Dict[str, Any]:
    """run.json's entries for a model file, copied into the run folder (for nodes that lack it)."""
    job: Dict[str, Any] = {"model": os.path.abspath(model) if os.path.exists(model) else model}
    if os.path.isfile(model):
        job["model_copy"] = os.path.basename(model)
        if os.path.abspath(os.path.join(run_dir, job["model_copy"])) != os.path.abspath(model):
            shutil.copyfile(model, os.path.join(run_dir, job["model_copy"]))
    return job


def _write_run_dir(run_dir: str, job: Dict[str, Any], split: Any, replicas: List[int], cfg: TrainConfig,
                   save: Optional[str]) -> None:
    """The split and ``run.json``: where the data and loss come from, the layout, the settings."""
    split.save(os.path.join(run_dir, SPLIT_DIR))
    job = dict(job, replicas=replicas, config=cfg.to_json())
    if save:
        job["save"] = os.path.abspath(save)
    with open(os.path.join(run_dir, RUN_FILE), "w") as f:
        json.dump(job, f, indent=1)


def _predict(split: Any, cfg: TrainConfig, world: int, on_cpu: bool, inputs: Any = (),
             threads: int = 1) -> Optional[float]:
    """Samples/s the simulator predicts for this run from the plan's profiled costs.

    Printed before training and again beside the measured rate at the end, so a
    user sees at once how far the cost model is from this machine. On CPU the
    optimizer step of each stage is timed here (``fxpipe.runtime.stepcost``),
    the CPU a message costs each side is measured (``fxpipe.runtime.postcost``),
    ranks beyond the core count share cores (``fxpipe.sharing``: workers
    run one thread each then, ``launch``), and workers given more than one
    thread (``threads``) run compute faster than the one-thread profile by the
    speed-up measured on ``inputs`` (``fxpipe.runtime.threadcost``); on GPUs
    (``on_cpu`` False) all four are left out.
    """
    if split.plan is None:
        return None
    from fxpipe.runtime.postcost import message_cost_s
    from fxpipe.runtime.recompute import recomputes
    from fxpipe.runtime.stepcost import step_costs
    from fxpipe.runtime.threadcost import thread_speedup
    from fxpipe.simulate import simulate_split

    steps = step_costs(split, cfg, threads) if on_cpu else None
    speed = thread_speedup(split, inputs, threads) if on_cpu and threads > 1 and inputs else 1.0
    cores = os.cpu_count() or 1
    extra: Dict[str, Any] = {"cores": cores} if on_cpu else {}
    if on_cpu and world > 1:  # one rank sends nothing
        post_s, post_per_byte_s = message_cost_s()
        extra.update(post_s=post_s, post_per_byte_s=post_per_byte_s)
    again = [recomputes(cfg.recompute, cfg.recompute_stages, j) for j in range(len(split.plan.stages))]
    if any(again):
        from fxpipe.runtime.deferred import qualifies
        extra.update(recompute=again, defers=[qualifies(m) for m in split.stages])
    try:
        sim = simulate_split(split, cfg.schedule, cfg.microbatches, step_s=steps, compute_scale=1.0 / speed,
                             **extra)
    except FxpipeError as exc:  # a plan the simulator cannot replay must not stop training
        _log(f"no prediction: {exc}")
        return None
    with_step = "optimizer step included" if steps else "optimizer step not included"
    if any(again):
        with_step += f", stages {','.join(str(j) for j, a in enumerate(again) if a)} recomputing"
    shared = f"; {world} ranks share {cores} cores" if on_cpu and world > cores else ""
    if speed != 1.0:
        shared += f"; {threads} threads per worker run the model {speed:.2f}x as fast as the profile's one"
    if "post_s" in extra:
        shared += (f"; a message costs each side {extra['post_s'] * 1e6:.0f} us + "
                   f"{extra['post_per_byte_s'] * 1e9:.2f} ns/byte of CPU")
    _log(f"predicted {sim.samples_per_s:.1f} samples/s ({cfg.schedule}, {sim.microbatches} microbatches, "
         f"simulated from the profile, {with_step}{shared}; bubble {sim.bubble_fraction:.0%})")
    return sim.samples_per_s


_STEP_LINE = re.compile(r"^step (\d+)/\d+ .*samples/s ([\d.]+)")


def _compare(predicted: Optional[float], rates: List[float], every: int = 1) -> None:
    """Measured median (the first line left out: warm-up) next to the prediction; ``every``: the steps
    between printed lines (``--log-every``), each line's rate is over those."""
    steady = rates[1:] or rates
    if not steady:
        return
    measured = statistics.median(steady)
    counted = f"{len(steady)} steps" if every == 1 else f"{len(steady)} lines of up to {every} steps"
    line = f"measured {measured:.1f} samples/s (median of {counted})"
    if predicted:
        line += f"; predicted {predicted:.1f}; measured / predicted = {measured / predicted:.2f}"
    _log(line)


def launch(prep: Prepared, threads: Optional[int] = None, debug: bool = False) -> int:
    """Run the workers under torchrun; returns their exit code.

    Their stderr goes to ``workers.log`` (torchrun's report of a failure is a
    page of tracebacks; the parent prints the failing rank's one line instead).
    torchrun's log folder is the null device: the workers write their own
    error files into the run folder, and torchrun's default would leave an
    empty ``torchelastic_*`` folder in the temp directory on every run.
    """
    world = prep.layout.world_size
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(worker_threads(threads, world))
    env["PYTHONUNBUFFERED"] = "1"
    if debug:
        env["FXPIPE_DEBUG"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "--max-restarts=0", f"--log-dir={os.devnull}", "-m", "fxpipe.runtime.worker", prep.run_dir]
    _log(f"starting {world} workers: {' '.join(cmd[2:])}")
    failure.clear(prep.run_dir)
    rates: List[float] = []
    log_path = os.path.join(prep.run_dir, WORKERS_LOG)
    with open(log_path, "w") as log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1,
                                                      stderr=None if debug else log) as proc:
        for line in proc.stdout or ():  # echo the workers' output, keep the step rates
            sys.stdout.write(line)
            sys.stdout.flush()
            m = _STEP_LINE.match(line)
            if m:
                rates.append(float(m.group(2)))
    if proc.returncode == 0:
        with open(log_path) as log:
            sys.stderr.write(log.read())  # warnings the workers printed
        _compare(prep.predicted_samples_per_s, rates, prep.log_every)
    return proc.returncode


_EXITED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")  # the first exit torchrun saw
_LISTED = re.compile(r"local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")  # its table of every failed rank
_STOPPED = -15  # SIGTERM: how torchrun stops the others after a failure, so named only when nothing else is


def failed(run_dir: str, code: int, checkpoint_dir: Optional[str] = None,
           trace: Optional[Tuple[str, int]] = None) -> LaunchError:
    """The error for a failed run: the root cause's line, the checkpoint left, the trace up to the failure
    (``trace``: path and world size), and where the rest is."""
    log = os.path.join(run_dir, WORKERS_LOG)
    records = failure.read(run_dir)
    first = failure.root_cause(records)
    cause = str(first["line"]) if first else ""
    if first is None or first.get("lost_peer"):  # maybe a rank died without a word: torchrun logged its exit
        silent = _silent_exit(log, {int(r.get("rank", -1)) for r in records})
        cause = "; ".join(c for c in (silent, cause) if c) or f"the workers exited with code {code}"
    record = None
    if checkpoint_dir:
        try:
            record = checkpoint.latest(checkpoint_dir)
        except FxpipeError:
            record = None
    kept = f"; the last complete checkpoint is step {record['step']} in {checkpoint_dir} (--resume)" if record else ""
    if trace is not None:
        kept += _partial_trace(*trace)
    return LaunchError(f"{cause}{kept} (all worker output: {log})")


def _partial_trace(path: str, world: int) -> str:
    """Merge what the ranks traced before a failure (each saves its events as it fails; a killed rank's
    file ends where it stopped) and name the file; nothing where no rank wrote one."""
    parts = [rank_path(path, r) for r in range(world)]
    if not any(os.path.exists(p) for p in parts):
        return ""
    try:
        n = merge(parts, path, partial=True)
    except OSError as exc:
        return f"; the ranks' trace files {rank_path(path, 0)}... could not be merged ({exc})"
    return f"; what the ranks did up to the failure: {path} ({n} events)"


def _silent_exit(log: str, reported: set) -> str:
    """The first worker torchrun saw fail that wrote no error line (single node: local rank = rank): from
    its "failed (exitcode ...)" line or, when that names a rank that reported, its table of failures,
    a rank stopped by SIGTERM (torchrun stopping the others) named last."""
    if not os.path.exists(log):
        return ""
    with open(log, errors="replace") as f:
        text = f.read()
    exits = [(int(m.group(2)), int(m.group(1))) for m in _EXITED.finditer(text)]
    exits += [(int(m.group(1)), int(m.group(2))) for m in _LISTED.finditer(text)]
    for rank, code in sorted(exits, key=lambda e: e[1] == _STOPPED):  # stable: torchrun's order otherwise
        if rank not in reported:
            return f"rank {rank} exited with code {code} without an error line (killed? out of memory?)"
    return ""


def finish(prep: Prepared, cfg: TrainConfig, save: Optional[str]) -> None:
    """Merge traces; say where the trained weights are."""
    if cfg.trace:
        n = merge([rank_path(cfg.trace, r) for r in range(prep.layout.world_size)], cfg.trace)
        _log(f"wrote {cfg.trace} ({n} events; open in chrome://tracing or ui.perfetto.dev)")
    if save:
        _log(f"wrote {save} (the original model's state_dict: model.load_state_dict(torch.load(...)))")


def worker_command(run_dir: str, world: int) -> str:
    """The ``torchrun`` line a user runs on every node for ``run_dir``."""
    return (f"torchrun --nnodes NODES --node-rank I --nproc-per-node PER_NODE --master-addr HOST "
            f"--master-port PORT -m fxpipe.runtime.worker {run_dir}   (NODES x PER_NODE = {world}; "
            "I = 0 on HOST, 1..NODES-1 elsewhere)")
