"""``fxpipe.train`` from a script: the same training as one process, and what cannot reach the workers.

The runs compare against plain single-process training of the unsplit model
in float64 (``cases.accumulate_model``: per step, the gradient of the mean
microbatch loss): after a few steps every weight is within 1e-9 of its change.
The refusals need no worker: each is one line, before any profiling.
"""
from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from passes.errors import FxpipeError
from tests.fxpipe.runtime import cases

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "train_api.py"
TOL = 1e-9


def assert_close_to_reference(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                              start: Dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        moved = (want[k] - start[k]).norm().item()
        assert moved > 1e-6, k
        assert got[k].dtype == torch.float64
        assert (got[k] - want[k]).norm().item() <= TOL * moved, (k, (got[k] - want[k]).norm().item() / moved)


def _env() -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def test_example_script_trains_like_one_process(tmp_path: Path) -> None:
    """``python examples/train_api.py``: objects of ``__main__`` reach the workers; weights equal the reference."""
    steps, saved = 3, tmp_path / "trained.pt"
    out = subprocess.run([sys.executable, str(EXAMPLE), "--float64", "--steps", str(steps), "--save", str(saved)],
                         capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in out.stdout.split("loss per step:")[1].splitlines()[0].split()]
    assert len(losses) == steps and losses[-1] < losses[0], out.stdout
    assert "stages: 2" in out.stdout

    ex = runpy.run_path(str(EXAMPLE))  # not as __main__: only the definitions
    model = ex["make_model"](torch.float64)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    M = ex["MICROBATCHES"]
    micro: List[Any] = []
    for (x,), y in ex["batches64"]():  # each item is one step: cut it as the runtime does, along dim 0
        micro += [((xc,), yc) for xc, yc in zip(x.chunk(M), y.chunk(M))]
        if len(micro) >= steps * M:
            break
    want = cases.accumulate_model(model, micro.__getitem__, ex["loss_fn"], steps, M, "sgd", 0.2)
    assert_close_to_reference(torch.load(saved, weights_only=True), want, start)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_net() -> Net:
    torch.manual_seed(3)
    return Net().double()


def data_list(n: int) -> List[Any]:
    g = torch.Generator().manual_seed(5)
    return [((torch.randn(4, 6, generator=g, dtype=torch.float64),), torch.randn(4, 3, generator=g,
                                                                                 dtype=torch.float64))
            for _ in range(n)]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


@pytest.mark.parametrize("optimizer", [
    dict(optimizer="adamw"),
    dict(optimizer=torch.optim.AdamW, optimizer_options={"weight_decay": 0.01, "eps": 1e-8}),  # by class
], ids=["adamw", "class"])
def test_train_in_process_objects_adamw_weights_back_in_model(optimizer: Dict[str, Any]) -> None:
    """A list as ``batches``, a test-module loss; AdamW; the trained weights land in ``model``."""
    steps, M, lr = 3, 2, 0.01
    model = make_net()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = fxpipe.train(model, data_list(steps * M), loss_fn=mse, devices=2, microbatches=M, steps=steps,
                       lr=lr, replication="none", time_limit=3, threads=1, timeout=60, **optimizer)
    assert isinstance(out, fxpipe.TrainOutcome) and out.plan.num_stages == 2
    assert len(out.losses) == steps and all(x > 0 for x in out.losses)
    want = cases.accumulate_model(make_net(), data_list(steps * M).__getitem__, mse, steps, M, "adamw", lr)
    assert_close_to_reference(out.state_dict, want, start)
    assert_close_to_reference(model.state_dict(), want, start)


def _local_batches() -> Any:
    def batches() -> Iterator[Any]:
        yield from data_list(2)
    return batches


def _local_optimizer() -> type:
    class Mine(torch.optim.SGD):
        pass
    return Mine


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(loss_fn=lambda out, y: mse(out, y)), r"loss_fn: function <lambda> .*define it with def/class at module level"),
    (dict(batches=_local_batches()), r"batches: function _local_batches.<locals>.batches .*module level"),
    (dict(batches=iter(data_list(2))), r"batches is an iterator .*pass a function"),
    (dict(flush_every=3), r"unknown option 'flush_every'; training options: .*momentum"),
    (dict(optimizer="lion"), r"optimizer must be 'sgd', 'adamw' or a torch.optim.Optimizer class, not 'lion'"),
    (dict(optimizer=_local_optimizer()), r"optimizer: class _local_optimizer.<locals>.Mine .*module level"),
], ids=["lambda", "local-function", "iterator", "unknown-option", "optimizer-name", "optimizer-class"])
def test_what_cannot_reach_the_workers_is_one_line(kwargs: Dict[str, Any], pattern: str, tmp_path: Path) -> None:
    args = dict(batches=data_list(2), loss_fn=mse)
    args.update(kwargs)
    with pytest.raises(FxpipeError) as info:
        fxpipe.train(make_net(), devices=2, steps=1, run_dir=str(tmp_path / "run"), **args)
    line = str(info.value)
    assert "\n" not in line and re.search(pattern, line), line
    assert not (tmp_path / "run" / "split").exists()  # refused before any split


def test_a_model_file_brings_its_own_data() -> None:
    with pytest.raises(FxpipeError, match=r"drop batches= or pass an nn.Module"):
        fxpipe.train("examples/cnn.py", data_list(2), devices=2)


UNGUARDED = '''
import torch, torch.nn as nn, torch.nn.functional as F
import fxpipe

def loss_fn(out, y):
    return F.mse_loss(out, y)

def batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        yield (torch.randn(4, 8, generator=g),), torch.randn(4, 2, generator=g)

torch.manual_seed(0)
fxpipe.train(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), batches, loss_fn=loss_fn, devices=2,
             steps=1, replication="none", time_limit=3, threads=1, timeout=60)
'''


def test_script_without_main_guard_fails_with_the_fix(tmp_path: Path) -> None:
    """Each worker runs the script for its functions; an unguarded call would start workers again."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode != 0
    assert 'put the training call under if __name__ == "__main__":' in out.stderr, out.stderr[-3000:]
    log = re.search(r"all worker output: (\S+workers\.log)", out.stderr)
    assert log and os.path.exists(log.group(1)), out.stderr[-2000:]  # the failed run's folder is kept
    shutil.rmtree(os.path.dirname(log.group(1)))


def test_launcher_none_run_folder_trains_under_own_torchrun(tmp_path: Path) -> None:
    """Multi-node shape: the run folder carries the pickled objects and this process's import path.

    The hand-started torchrun runs from another folder with no PYTHONPATH;
    the workers still find this test module (by the carried ``sys.path``),
    and rank 0 writes ``save`` and the losses.
    """
    import json

    steps, M = 2, 2
    run, saved = tmp_path / "run", tmp_path / "w.pt"
    out = fxpipe.train(make_net(), data_list(steps * M), loss_fn=mse, devices=2, microbatches=M, steps=steps,
                       lr=0.05, replication="none", time_limit=3, save=str(saved), launcher="none",
                       run_dir=str(run))
    assert out.command and "-m fxpipe.runtime.worker" in out.command and out.state_dict is None
    job = json.loads((run / "run.json").read_text())
    assert (run / "payload.pkl").exists() and job["payload"]
    assert job["config"]["device"] == "auto"  # each node's workers decide: the parent cannot see them
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "0", "-m", "fxpipe.runtime.worker", str(run)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads((run / "result.json").read_text())["losses"]) == steps
    want = cases.accumulate_model(make_net(), data_list(steps * M).__getitem__, mse, steps, M, "sgd", 0.05)
    assert_close_to_reference(torch.load(saved, weights_only=True), want,
                              {k: v.detach().clone() for k, v in make_net().state_dict().items()})


STARTS: List[int] = []


def counted_batches() -> Iterator[Any]:
    """``data_list(4)``, noting each start in this process (the workers' starts are in theirs)."""
    STARTS.append(1)
    yield from data_list(4)


@pytest.mark.parametrize("examples", [{}, dict(example_inputs=data_list(1)[0][0])])
def test_the_parent_starts_batches_once(examples: Dict[str, Any], tmp_path: Path) -> None:
    """The example (or microbatch 0's check and targets) and the preflight read one start of ``batches()``."""
    STARTS.clear()
    fxpipe.train(make_net(), counted_batches, loss_fn=mse, devices=2, microbatches=2, steps=1,
                 replication="none", time_limit=3, launcher="none", run_dir=str(tmp_path / "run"), **examples)
    assert len(STARTS) == 1
