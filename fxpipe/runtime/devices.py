"""Where the workers run: ``--device auto|cpu|cuda``.

NCCL wants one GPU per rank: two ranks on one GPU fail at the first
collective ("duplicate GPU"), long after the plan was made. So the parent
decides once, before profiling, from the number of workers this machine
starts: ``auto`` means CUDA (NCCL, one GPU per local rank) when every local
worker gets its own GPU, else CPU over gloo, and says which. ``cuda`` with
too few GPUs is an error that names both counts. The workers get the
resolved name in ``run.json``, so every rank of a run agrees.

Multi-node runs (``--launcher none``): the parent cannot see the nodes, so
``run.json`` keeps the device as asked and each worker resolves ``auto`` from
its own node (its GPUs and ``LOCAL_WORLD_SIZE``); every worker on ``cuda``
checks that its local rank has a GPU. Nodes that would resolve differently
(one with a GPU per worker, one without) cannot form one process group: name
``--device`` on such machines.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional, Tuple

from passes.errors import FxpipeError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")  # importable without torch: the CLI lists them in --help


class DeviceError(FxpipeError):
    """A device that cannot run the workers as asked."""


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise DeviceError(f"--device {device!r} is not one of {', '.join(DEVICES)}")


def resolve_device(device: str, local_ranks: Optional[int]) -> str:
    """``device`` made concrete for ``local_ranks`` workers on this machine (None: not known here)."""
    check_device(device)
    gpus = gpu_count()
    if device == "auto":
        return "cuda" if gpus and (local_ranks is None or gpus >= local_ranks) else "cpu"
    if device == "cuda":
        if not gpus:
            raise DeviceError("--device cuda was asked for, but this torch build sees no CUDA device; "
                              "use --device cpu")
        if local_ranks is not None and gpus < local_ranks:
            raise DeviceError(f"--device cuda runs one worker per GPU (NCCL), but {local_ranks} workers were "
                              f"asked for and this machine has {gpus} GPU{'s' if gpus > 1 else ''}; use "
                              f"--devices {gpus} or fewer, more nodes, or --device cpu")
    return device


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_device(device: str, local_rank: int, local_world: Optional[int] = None) -> Tuple["torch.device", str]:
    """This worker's device and process-group backend for a resolved (or ``auto``) ``device``.

    ``auto`` counts the workers on this node from ``LOCAL_WORLD_SIZE`` (torchrun sets it), else
    ``local_world``, else ``local_rank + 1``. Every worker of a node must count the same: with one
    GPU, rank 0 counting itself alone would take NCCL while rank 1 took gloo, and the group fails
    ("No backend type associated with device type cpu"): the CPU benchmarks, whose ranks are spawned
    without torchrun, broke so on a GPU machine before ``init`` passed the world size here."""
    if device == "auto":
        fallback = local_world if local_world is not None else local_rank + 1
        device = resolve_device("auto", int(os.environ.get("LOCAL_WORLD_SIZE", fallback)))
    check_device(device)
    import torch

    if device == "cpu":
        return torch.device("cpu"), "gloo"
    gpus = gpu_count()
    if local_rank >= gpus:
        raise DeviceError(f"local rank {local_rank} has no GPU: this node has {gpus}; start at most {gpus} "
                          "workers on it (--nproc-per-node), or write the run with --device cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank), "nccl"
