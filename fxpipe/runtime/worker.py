"""Per-rank entry point under ``torchrun``: ``python -m fxpipe.runtime.worker RUN_DIR``.

``fxpipe train`` plans and splits once, saves the split and a ``run.json``
into RUN_DIR, then starts one of these per device. A worker reads its rank
from the environment torchrun sets, joins the process group, loads the split
and the model file (for ``batches()``, ``loss_fn`` and the example targets;
the model's weights come from the split), or for ``fxpipe.train`` called
with an ``nn.Module`` the pickled objects (``fxpipe.runtime.payload``), and
trains its stage. At the end rank 0 gathers the losses into
``RUN_DIR/result.json`` (``fxpipe.train`` returns them) and, with ``--save``
in ``run.json``, every stage's final weights, written as the original model's
``state_dict``, so a multi-node run needs no shared folder for it.

Multi-node: ``fxpipe train MODEL --devices N --launcher none --run-dir RUN``
writes RUN and exits; copy RUN to every node and start this module there
under your own ``torchrun --nnodes ...``. If the model file is not at the
same path on a node, the copy in RUN is used.

Faults. The process group is created with a timeout, and every receive waits
with it, so a peer that hangs ends the run with a ``TransportError`` naming
the action and the peer; a peer that dies closes its sockets and the others
fail at once. torchrun then stops the remaining workers. A worker that fails
prints one line (rank, stage, action, message) and records it for the parent
(``fxpipe.runtime.failure``); the traceback only with FXPIPE_DEBUG=1.
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
from fxpipe.runtime.devices import worker_device
from fxpipe.runtime.failure import describe, record
from fxpipe.runtime.poster import stop_poster
from fxpipe.runtime import payload
from fxpipe.runtime.loop import TrainConfig, TrainResult, train
from passes.errors import FxpipeError

RUN_FILE = "run.json"
RESULT_FILE = "result.json"  # rank 0 writes the losses here for the parent
SPLIT_DIR = "split"


def init(rank: int, world: int, timeout_s: float, init_method: str = "env://", device: str = "auto") -> torch.device:
    """Join the default process group on ``device`` (``fxpipe.runtime.devices``): NCCL with one GPU per
    local rank, or gloo on CPU."""
    # without torchrun's LOCAL_* variables every rank runs on this machine: all of them count the world
    dev, backend = worker_device(device, int(os.environ.get("LOCAL_RANK", rank)),
                                 None if "LOCAL_RANK" in os.environ else world)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return dev


def make_data(spec: Any, microbatches: int) -> Any:
    """The microbatch source for a loaded model spec (see ``fxpipe.runtime.data``)."""
    inputs = as_tuple(spec.example_inputs)
    batches = getattr(spec, "batches", None)
    if batches is None:
        return RepeatExample(inputs, getattr(spec, "example_targets", None))
    return FromBatches(batches, batch_dim(inputs), microbatches)


def _model_path(run_dir: str, job: Dict[str, Any]) -> str:
    """The model file as the parent saw it, or the copy in the run folder on a node that lacks it."""
    model, copy = job["model"], job.get("model_copy")
    if copy and not os.path.exists(model):
        return os.path.join(run_dir, copy)
    return model


def run(run_dir: str, rank: int, world: int, seen: Dict[str, Any]) -> int:
    """Train this rank's stage as ``run_dir/run.json`` says; ``seen`` gets the stage and M for error lines."""
    path = os.path.join(run_dir, RUN_FILE)
    try:
        with open(path) as f:
            job: Dict[str, Any] = json.load(f)
    except (OSError, ValueError) as exc:
        raise FxpipeError(f"cannot read {path} ({exc}); write the run folder with "
                          "`fxpipe train MODEL --launcher none --run-dir DIR`") from exc
    cfg = TrainConfig.from_json(job["config"])
    layout = Layout.of(job["replicas"])
    if layout.world_size != world:
        raise FxpipeError(f"the split needs {layout.world_size} processes, torchrun started {world}; "
                          f"start {layout.world_size} in all (--nnodes x --nproc-per-node)")
    seen.update(stage=layout.stage_of(rank), microbatches=cfg.microbatches)
    device = init(rank, world, cfg.timeout_s, device=cfg.device)
    try:
        from fxpipe.loader import load_model
        from fxpipe.split_model import SplitModel

        torch.manual_seed(int(job.get("seed", 0)))
        if job.get("payload"):  # fxpipe.train: the script's objects (run before the split loads its classes)
            spec = payload.spec_from(payload.read(run_dir, job["payload"]), job.get("source", "fxpipe.train"))
        else:
            spec = load_model(_model_path(run_dir, job), check=False)
        split = SplitModel.load(os.path.join(run_dir, SPLIT_DIR))
        result = train(rank=rank, layout=layout, split=split, cfg=cfg, data=make_data(spec, cfg.microbatches),
                       loss_fn=spec.loss_fn, device=device)
        report(run_dir, job.get("save"), split, layout, rank, result)
    finally:
        stop_poster()
        dist.destroy_process_group()
    return 0


def report(run_dir: str, save: Optional[str], split: Any, layout: Layout, rank: int, result: TrainResult) -> None:
    """Collective: rank 0 writes ``RUN_DIR/result.json`` (the losses) and ``save`` (the trained weights).

    The losses live on the last stage and the weights on every stage; rank 0
    gathers both, so a multi-node run needs no shared folder. ``save`` is the
    original model's ``state_dict`` (its own names, tied weights once).
    """
    keep = save and layout.replica_of(rank) == 0
    mine = (layout.stage_of(rank), {k: v.cpu() for k, v in result.state.items()} if keep else None,
            result.losses, result.samples_per_s, result.start_step)
    gathered: Optional[List[Any]] = [None] * layout.world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return
    items = list(gathered or ())
    _, _, losses, rates, start = items[layout.ranks(layout.num_stages - 1)[0]]  # replica 0 of the last stage
    with open(os.path.join(run_dir, RESULT_FILE), "w") as f:
        json.dump({"losses": losses, "samples_per_s": rates, "start_step": start}, f)
    if save:
        by_stage = {stage: sd for stage, sd, *_ in items if sd is not None}
        merged = split.original_state_dict([by_stage[j] for j in range(split.num_stages)])
        os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
        torch.save(merged, save)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m fxpipe.runtime.worker RUN_DIR", file=sys.stderr)
        return 2
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    seen: Dict[str, Any] = {}
    try:
        return run(argv[0], rank, world, seen)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line for the parent
        if os.environ.get("FXPIPE_DEBUG"):
            traceback.print_exc()
        line = describe(exc, rank, seen.get("stage"), seen.get("microbatches", 1))
        record(argv[0], rank, line)
        print(f"fxpipe worker {line}", file=sys.stderr, flush=True)
        return 1


def _exit(code: int) -> None:
    """After a finished run, leave without the interpreter's teardown.

    Rarely (about one run in 25 here, never reproduced on purpose), a gloo rank that had
    trained, reported and destroyed its process groups died in that teardown with
    "terminate called without an active exception" (SIGABRT: a C++ thread object destroyed while
    still joinable), and ``fxpipe train`` then called a finished run failed. Everything this worker
    writes is closed before ``main`` returns, so it flushes Python's streams and ends the process
    at once. A failed rank exits the usual way: its peers' exits then reach torchrun in the order
    the parent's report expects (the rank that died first is named), and the run failed anyway."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
