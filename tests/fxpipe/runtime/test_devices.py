"""``--device auto|cpu|cuda``: the parent decides once, from the GPUs this machine has and the workers it starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpipe.runtime import devices
from fxpipe.runtime.devices import DeviceError, resolve_device, worker_device
from fxpipe.runtime.loop import TrainConfig

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("gpus,ranks,want", [(0, 2, "cpu"), (1, 1, "cuda"), (1, 2, "cpu"), (4, 4, "cuda"),
                                             (2, None, "cuda"), (0, None, "cpu")])
def test_auto_takes_cuda_only_with_a_gpu_for_every_local_worker(monkeypatch, gpus, ranks, want) -> None:
    monkeypatch.setattr(devices, "gpu_count", lambda: gpus)
    assert resolve_device("auto", ranks) == want
    assert resolve_device("cpu", ranks) == "cpu"


def test_cuda_with_too_few_gpus_names_both_counts(monkeypatch) -> None:
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    assert resolve_device("cuda", 2) == "cuda"
    with pytest.raises(DeviceError, match="4 workers were asked for and this machine has 2 GPUs; use --devices 2"):
        resolve_device("cuda", 4)
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    with pytest.raises(DeviceError, match="sees no CUDA device; use --device cpu"):
        resolve_device("cuda", 1)


def test_a_worker_without_its_gpu_says_so(monkeypatch) -> None:
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    with pytest.raises(DeviceError, match="local rank 1 has no GPU: this node has 1"):
        worker_device("cuda", 1)
    assert worker_device("cpu", 3) == (torch.device("cpu"), "gloo")


def test_a_worker_resolves_auto_from_its_own_node(monkeypatch) -> None:
    """``--launcher none`` leaves ``auto`` in run.json: two workers on a one-GPU node both take the CPU."""
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert worker_device("auto", 0) == (torch.device("cpu"), "gloo")
    assert worker_device("auto", 1) == (torch.device("cpu"), "gloo")


def test_ranks_started_without_torchrun_agree_on_auto(monkeypatch) -> None:
    """No ``LOCAL_WORLD_SIZE`` (ranks spawned by hand, as the benchmarks do): every rank counts the
    whole world, so on a one-GPU machine rank 0 no longer takes NCCL while rank 1 takes gloo."""
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert worker_device("auto", 0, 2) == worker_device("auto", 1, 2) == (torch.device("cpu"), "gloo")


def test_unknown_device_is_refused_in_the_config() -> None:
    with pytest.raises(DeviceError, match="--device 'tpu' is not one of auto, cpu, cuda"):
        TrainConfig(device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_device_cuda_without_a_gpu_is_one_line_before_profiling(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "fxpipe", "train", str(ROOT / "examples" / "gpt.py"),
                          "--devices", "2", "--device", "cuda"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 2
    assert "sees no CUDA device; use --device cpu" in out.stderr
    assert "Traceback" not in out.stderr and "profil" not in out.stderr.lower()
