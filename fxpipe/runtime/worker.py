"""Per-rank entry point under ``torchrun``: ``python -m fxpipe.runtime.worker RUN_DIR``.

``fxpipe train`` plans and splits once, saves the split and a ``run.json``
into RUN_DIR, then starts one of these per device. A worker reads its rank
from the environment torchrun sets, joins the process group, loads the split
and the model file (for ``batches()``, ``loss_fn`` and the example targets;
the model's weights come from the split) and trains its stage.

Faults. The process group is created with a timeout, and every receive waits
with it, so a peer that hangs ends the run with a ``TransportError`` naming
the action and the peer; a peer that dies closes its sockets and the others
fail at once. torchrun then stops the remaining workers and ``fxpipe train``
reports the first failure. A worker that raises exits non-zero with one
readable line (the traceback only with FXPIPE_DEBUG=1).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from fxpipe.layout import Layout
from fxpipe.runtime.data import FromBatches, RepeatExample, as_tuple, batch_dim
from fxpipe.runtime.loop import TrainConfig, train
from passes.errors import FxpipeError

RUN_FILE = "run.json"
SPLIT_DIR = "split"


def init(rank: int, world: int, timeout_s: float, init_method: str = "env://") -> torch.device:
    """Join the default process group: NCCL with one GPU per local rank when CUDA is there, else gloo."""
    if torch.cuda.is_available():  # guarded GPU path: one device per local rank
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return device


def make_data(spec: Any, microbatches: int) -> Any:
    """The microbatch source for a loaded model spec (see ``fxpipe.runtime.data``)."""
    inputs = as_tuple(spec.example_inputs)
    batches = getattr(spec, "batches", None)
    if batches is None:
        return RepeatExample(inputs, getattr(spec, "example_targets", None))
    return FromBatches(batches, batch_dim(inputs), microbatches)


def run(run_dir: str, rank: int, world: int) -> int:
    with open(os.path.join(run_dir, RUN_FILE)) as f:
        job: Dict[str, Any] = json.load(f)
    cfg = TrainConfig.from_json(job["config"])
    layout = Layout.of(job["replicas"])
    if layout.world_size != world:
        raise FxpipeError(f"the split needs {layout.world_size} processes, torchrun started {world}; "
                          f"use --nproc-per-node {layout.world_size}")
    device = init(rank, world, cfg.timeout_s)
    try:
        from fxpipe.loader import load_model
        from fxpipe.split_model import SplitModel

        torch.manual_seed(int(job.get("seed", 0)))
        spec = load_model(job["model"], check=False)
        split = SplitModel.load(os.path.join(run_dir, SPLIT_DIR))
        train(rank=rank, layout=layout, split=split, cfg=cfg, data=make_data(spec, cfg.microbatches),
              loss_fn=spec.loss_fn, device=device)
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m fxpipe.runtime.worker RUN_DIR", file=sys.stderr)
        return 2
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        return run(argv[0], rank, world)
    except FxpipeError as exc:
        if os.environ.get("FXPIPE_DEBUG"):
            traceback.print_exc()
        print(f"fxpipe worker rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
