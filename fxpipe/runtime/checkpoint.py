"""Checkpoints: per-stage weights and optimizer state at a step boundary; resume.

A checkpoint is taken where the pipeline is empty (after a flush/gpipe step;
with ``1f1b-stash`` the pipeline drains at checkpoint steps for that reason),
so no weight version other than the current one exists and nothing is in
flight. Replica 0 of each stage writes ``step-NNNNNNNN/stage<j>.pt`` (replicas
hold identical weights and optimizer state); after a barrier rank 0 records
the step in ``latest.json`` and removes older step folders, so a run killed
mid-write resumes from the previous complete checkpoint.

Resuming restores weights, buffers and optimizer state and starts at the
next step; the data stream continues at that step's first microbatch, so a
resumed run computes what the uninterrupted run would have.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Optional

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


def save(folder: str, step: int, rank: int, layout: Layout, module: nn.Module,
         optimizer: torch.optim.Optimizer, info: Dict[str, Any]) -> None:
    """Collective: every rank calls it after ``step`` steps completed."""
    stage = layout.stage_of(rank)
    where = _step_dir(folder, step)
    if layout.replica_of(rank) == 0:
        os.makedirs(where, exist_ok=True)
        state = {"step": step, "stage": stage, "module": module.state_dict(), "optimizer": optimizer.state_dict()}
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
    with open(path) as f:
        return json.load(f)


def restore(folder: str, rank: int, layout: Layout, module: nn.Module, optimizer: torch.optim.Optimizer,
            info: Dict[str, Any]) -> int:
    """Load this rank's stage from the newest checkpoint; returns the step to start at."""
    record = latest(folder)
    if record is None:
        raise CheckpointError(f"--resume: no checkpoint in {folder} (no latest.json); "
                              "train with --checkpoint DIR --checkpoint-every N first")
    if record.get("replicas") != list(layout.replicas):
        raise CheckpointError(f"checkpoint in {folder} is for stage replicas {record.get('replicas')}, "
                              f"this run has {list(layout.replicas)}; resume with the same plan and --devices")
    for key, value in info.items():
        if key in record and record[key] != value:
            raise CheckpointError(f"checkpoint in {folder} was taken with {key}={record[key]!r}, "
                                  f"this run has {value!r}; resume with the same settings")
    stage = layout.stage_of(rank)
    path = os.path.join(_step_dir(folder, record["step"]), f"stage{stage}.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint step {record['step']} lacks {path}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    with torch.no_grad():
        module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    return int(record["step"])
