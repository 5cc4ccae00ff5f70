"""Two torchrun agents (``--nnodes 2``, one rank each) train like ``fxpipe train --devices 2`` on one node.

As a user on two machines would: split once, ``fxpipe train --launcher none``
writes the run folder, each "node" gets its own copy of it and runs
``torchrun ... -m fxpipe.runtime.worker RUN``; rank 0 writes ``--save``.
Both nodes here are processes on 127.0.0.1 with the static rendezvous.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.fxpipe.runtime.harness import free_port
from tests.fxpipe.runtime.test_train_cli import MODEL as TINY

MODEL = TINY + textwrap.dedent('''
    def batches():
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            yield (torch.randn(4, 16, generator=g),), torch.randn(4, 4, generator=g)
''')


def _fxpipe(*args: str, env: dict) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "fxpipe", *args], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_two_nodes_train_like_one(tmp_path: Path) -> None:
    model = tmp_path / "tiny.py"
    model.write_text(MODEL)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    split = tmp_path / "split"
    _fxpipe("split", str(model), "--devices", "2", "--replication", "none", "--time-limit", "3", "--repeats", "1",
            "-o", str(split), env=env)
    train = ["train", str(model), "--split", str(split), "--steps", "4", "--microbatches", "2", "--lr", "0.05",
             "--threads", "1", "--timeout", "60"]
    _fxpipe(*train, "--save", str(tmp_path / "one_node.pt"), env=env)

    run = tmp_path / "run"
    printed = _fxpipe(*train, "--save", str(tmp_path / "two_nodes.pt"), "--launcher", "none", "--run-dir", str(run),
                      env=env)
    assert "-m fxpipe.runtime.worker" in printed.stderr and "--nnodes" in printed.stderr
    shutil.copytree(run, tmp_path / "run_copy")  # the second machine's copy; it has no tiny.py at that path:
    job = json.loads((tmp_path / "run_copy" / "run.json").read_text())
    job["model"] = str(tmp_path / "elsewhere" / "tiny.py")  # the worker falls back to the copy in the run folder
    (tmp_path / "run_copy" / "run.json").write_text(json.dumps(job))
    port = free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                                "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                "--max-restarts", "0", "-m", "fxpipe.runtime.worker", str(folder)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for i, folder in enumerate((run, tmp_path / "run_copy"))]
    try:
        logs = [a.communicate(timeout=180)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)[-4000:]
    assert "step 4/4" in logs[1]  # the last stage (rank 1, node 1) prints the losses

    one = torch.load(tmp_path / "one_node.pt", weights_only=False)
    two = torch.load(tmp_path / "two_nodes.pt", weights_only=False)
    ns: dict = {}
    exec(MODEL, ns)
    assert list(one) == list(two) == list(ns["model"].state_dict())
    for k in one:
        assert torch.equal(one[k], two[k]), k  # same ranks, data, order of reductions: bit for bit
    assert any(not torch.equal(one[k], v) for k, v in ns["model"].state_dict().items())  # it trained


def test_worker_process_status_and_line_reach_the_caller(tmp_path: Path) -> None:
    """A finished worker leaves without the interpreter's teardown (``worker._exit``; the run above
    checks its status 0 and its output under torchrun); a failing one exits the usual way, with its
    usage or error line on stderr and status 2 or 1."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), RANK="0", WORLD_SIZE="1")
    usage = subprocess.run([sys.executable, "-m", "fxpipe.runtime.worker"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert usage.returncode == 2 and "usage: torchrun" in usage.stderr
    missing = subprocess.run([sys.executable, "-m", "fxpipe.runtime.worker", str(tmp_path / "nowhere")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 1 and "cannot read" in missing.stderr and "run.json" in missing.stderr
