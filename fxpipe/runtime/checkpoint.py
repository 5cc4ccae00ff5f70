"""Checkpoints: per-stage weights and optimizer state at a step boundary; resume.

A checkpoint is taken where the pipeline is empty (after a flush/gpipe step;
with ``1f1b-stash`` the pipeline drains at checkpoint steps for that reason),
so no weight version other than the current one exists and nothing is in
flight. Replica 0 of each stage writes ``step-NNNNNNNN/stage<j>.pt`` (replicas
hold identical weights and optimizer state); after a barrier rank 0 records
the step in ``latest.json`` and removes older step folders, so a run killed
mid-write resumes from the previous complete checkpoint. Every rank also
writes its random-number state (``rng<rank>.pt``: the CPU generator's, and
its GPU's on CUDA), which dropout draws from.

Resuming restores weights, buffers, optimizer state and each rank's random
numbers and starts at the next step; the data stream continues at that
step's first microbatch, so a resumed run computes what the uninterrupted run
would have, dropout included. (A checkpoint written before the random-number
files existed resumes with a warning: its dropout masks differ from the
uninterrupted run's.)
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.layout import Layout
from fxpipe.runtime.transport import peer_guard
from passes.errors import FxpipeError


class CheckpointError(FxpipeError):
    """A checkpoint is missing, incomplete, or from a different pipeline."""


def _step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:08d}")


def _rng_path(where: str, rank: int) -> str:
    return os.path.join(where, f"rng{rank}.pt")


def _rng_state(device: torch.device) -> Dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save(folder: str, step: int, rank: int, layout: Layout, module: nn.Module,
         optimizer: torch.optim.Optimizer, info: Dict[str, Any], device: torch.device = torch.device("cpu"),
         older: Optional[Dict[str, Any]] = None) -> None:
    """Collective: every rank calls it after ``step`` steps completed. ``older``: 2bw's previous weight
    version (``WeightStash.older_state``), which the next batch runs on."""
    stage = layout.stage_of(rank)
    where = _step_dir(folder, step)
    os.makedirs(where, exist_ok=True)
    tmp = _rng_path(where, rank) + ".tmp"
    torch.save(_rng_state(device), tmp)
    os.replace(tmp, _rng_path(where, rank))
    if layout.replica_of(rank) == 0:
        state = {"step": step, "stage": stage, "module": module.state_dict(), "optimizer": optimizer.state_dict()}
        if older is not None:
            state["older"] = older
        tmp = os.path.join(where, f".stage{stage}.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(where, f"stage{stage}.pt"))
    with peer_guard(f"checkpoint barrier at step {step}"):
        dist.barrier()
    if rank == 0:
        record = dict(info, step=step, replicas=list(layout.replicas))
        tmp = os.path.join(folder, ".latest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, os.path.join(folder, "latest.json"))
        for name in os.listdir(folder):
            if name.startswith("step-") and name != os.path.basename(where):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    with peer_guard(f"checkpoint barrier at step {step}"):
        dist.barrier()


def latest(folder: str) -> Optional[Dict[str, Any]]:
    """The record of the newest complete checkpoint in ``folder``, or None."""
    path = os.path.join(folder, "latest.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--resume: cannot read {path} ({type(exc).__name__}: {exc}); it is damaged: "
                              "restore it, or train again without --resume") from exc
    if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] < 0:
        raise CheckpointError(f"--resume: {path} has no step number (is it fxpipe's?); restore it, "
                              "or train again without --resume")
    return record


def check(folder: str, layout: Layout, info: Dict[str, Any], stages: List[nn.Module]) -> int:
    """What ``restore`` will find, checked once in the parent: returns the step to resume at.

    The newest checkpoint must be readable, for these stage replicas and
    settings, and hold, for every stage, the tensors of that stage under the
    same names and shapes (so a checkpoint of another split or model fails here,
    not as a ``load_state_dict`` traceback in every worker).
    """
    if not os.path.isdir(folder):
        raise CheckpointError(f"--resume: checkpoint folder {folder} does not exist; "
                              "train with --checkpoint DIR first, or drop --resume")
    record = _record(folder, layout, info)
    for j, module in enumerate(stages):
        path = os.path.join(_step_dir(folder, record["step"]), f"stage{j}.pt")
        state = _load(path, mmap=True)
        saved = state.get("module") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            raise CheckpointError(f"--resume: {path} holds no stage weights; it is not an fxpipe checkpoint")
        want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        have = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
        if want != have:
            key = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))[0]
            there, here = (list(d[key]) if key in d else "missing" for d in (have, want))
            raise CheckpointError(f"--resume: {path} does not belong to this split (stage {j} tensor {key}: "
                                  f"{there} there, {here} here); resume with the split the checkpoint was "
                                  f"taken with (it is kept in {os.path.join(folder, 'split')}), "
                                  "or use a new --checkpoint")
    return int(record["step"])


def _record(folder: str, layout: Layout, info: Dict[str, Any]) -> Dict[str, Any]:
    record = latest(folder)
    if record is None:
        raise CheckpointError(f"--resume: no checkpoint in {folder} (no latest.json); "
                              "train with --checkpoint DIR --checkpoint-every N first, or drop --resume")
    if record.get("replicas") != list(layout.replicas):
        raise CheckpointError(f"checkpoint in {folder} is for stage replicas {record.get('replicas')}, "
                              f"this run has {list(layout.replicas)}; resume with the same plan and --devices")
    for key, value in info.items():
        if key in record and record[key] != value:
            raise CheckpointError(f"checkpoint in {folder} was taken with {key}={record[key]!r}, "
                                  f"this run has {value!r}; resume with the same settings")
    return record


def _load(path: str, mmap: bool = False) -> Any:
    """The file's contents; ``mmap`` for a look at names and shapes without reading every byte."""
    if not os.path.exists(path):
        raise CheckpointError(f"--resume: the checkpoint lacks {path}; it is incomplete: "
                              "restore it, or train again without --resume")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same advice
        raise CheckpointError(f"--resume: cannot read {path} ({type(exc).__name__}); it is damaged: "
                              "restore it, or train again without --resume") from exc


def restore(folder: str, rank: int, layout: Layout, module: nn.Module, optimizer: torch.optim.Optimizer,
            info: Dict[str, Any], device: torch.device = torch.device("cpu"),
            older: Optional[Callable[[Dict[str, Any]], None]] = None) -> int:
    """Load this rank's stage and random-number state from the newest checkpoint; returns the step to start at.

    ``older``: takes 2bw's previous weight version back (``WeightStash.load_older_state``); a 2bw
    checkpoint at a step past the first holds it."""
    record = _record(folder, layout, info)
    stage = layout.stage_of(rank)
    where = _step_dir(folder, record["step"])
    state = _load(os.path.join(where, f"stage{stage}.pt"))
    with torch.no_grad():
        module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    if older is not None and int(record["step"]) > 0:
        if "older" not in state:
            raise CheckpointError(f"--resume: {where} holds no earlier weight version for stage {stage}, which "
                                  "2bw's next batch runs on (written by another schedule or an older fxpipe); "
                                  "resume with the schedule it was taken with")
        older(state["older"])
    if os.path.exists(_rng_path(where, rank)):
        rng = _load(_rng_path(where, rank))
        torch.set_rng_state(rng["cpu"])
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    else:
        warnings.warn(f"--resume: {where} holds no random-number state for rank {rank} (written by an older "
                      "fxpipe): dropout draws differ from the uninterrupted run's from here on")
    return int(record["step"])
