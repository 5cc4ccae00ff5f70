"""``fxpipe train --devices 1`` on examples/gpt.py (tied embedding and head) equals one process.

With one device the whole model is one stage, so the embedding and the tied
output head sit in the same stage file; ``fxpipe train`` always saves the
split and the worker loads it. The model runs in float64 (a wrapper model
file converts gpt.py's model) so the comparison can be tight: after 3 SGD
steps of 2 microbatches every weight is within 1e-9 of its change of plain
single-process training on the mean microbatch loss. Before stage files
re-tied shared weights the tied table was 0.82 of its change away.
"""
from __future__ import annotations

import itertools
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch

from tests.fxpipe.runtime import cases

GPT = Path(__file__).resolve().parents[3] / "examples" / "gpt.py"
TOL, STEPS, M, LR = 1e-9, 3, 2, 0.05

WRAPPER = '''
import runpy
_gpt = runpy.run_path({path!r})
model = _gpt["model"].double()
example_inputs, example_targets = _gpt["example_inputs"], _gpt["example_targets"]
loss_fn, batches = _gpt["loss_fn"], _gpt["batches"]
'''


def test_train_one_device_gpt_equals_single_process(tmp_path: Path) -> None:
    model_file, saved = tmp_path / "gpt64.py", tmp_path / "trained.pt"
    model_file.write_text(WRAPPER.format(path=str(GPT)))
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "-m", "fxpipe", "train", str(model_file), "--devices", "1", "--steps", str(STEPS),
           "--microbatches", str(M), "--lr", str(LR), "--save", str(saved), "--time-limit", "3",
           "--threads", "1", "--timeout", "60"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = torch.load(saved, weights_only=False)

    ns = runpy.run_path(str(model_file))
    model = ns["model"]
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    micro = list(itertools.islice(ns["batches"](), STEPS * M))  # each item of gpt.py's batches() is one microbatch
    want = cases.accumulate_model(model, micro.__getitem__, ns["loss_fn"], STEPS, M, "sgd", LR)
    assert set(got) == set(want) and got["head.weight"].dtype == torch.float64
    for k in want:
        moved = (want[k] - start[k]).norm().item()
        assert moved > 1e-6, k
        assert (got[k] - want[k]).norm().item() <= TOL * moved, (k, (got[k] - want[k]).norm().item() / moved)
