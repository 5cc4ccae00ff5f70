"""``fxpipe train`` end to end: plan, split, torchrun workers, trace, checkpoint, --save."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import textwrap

import torch

MODEL = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    example_inputs = (torch.randn(4, 16),)
    example_targets = torch.randn(4, 4)
    def loss_fn(out, y):
        return F.mse_loss(out, y)
''')


def test_train_cli_saves_original_state_dict_and_trace(tmp_path) -> None:
    path = tmp_path / "tiny.py"
    path.write_text(MODEL)
    trace, saved, ckpt = tmp_path / "t.json", tmp_path / "trained.pt", tmp_path / "ck"
    temp = tmp_path / "temp"  # the temp folder of the run: nothing is left in it
    temp.mkdir()
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TMPDIR=str(temp))
    cmd = [sys.executable, "-m", "fxpipe", "train", str(path), "--devices", "2", "--steps", "3",
           "--microbatches", "2", "--lr", "0.05", "--trace", str(trace), "--save", str(saved),
           "--checkpoint", str(ckpt), "--time-limit", "3", "--threads", "1", "--timeout", "60", "--log-every", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 3/3" in out.stdout and "samples/s" in out.stdout, out.stdout
    assert "step 2/3" in out.stdout and "step 1/3" not in out.stdout  # --log-every 2, and the last
    assert "defines no batches()" in out.stderr
    predicted = re.search(r"predicted ([\d.]+) samples/s", out.stderr)
    compared = re.search(r"measured ([\d.]+) samples/s \(median of 1 lines of up to 2 steps\); predicted ([\d.]+)",
                         out.stderr)
    assert predicted and compared, out.stderr[-2000:]
    assert float(predicted.group(1)) > 0 and compared.group(2) == predicted.group(1)
    ns: dict = {}
    exec(MODEL, ns)
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    state = torch.load(saved, weights_only=False)
    ns["model"].load_state_dict(state)  # strict: the original names, nothing missing
    assert any((state[k] - before[k]).abs().max() > 1e-4 for k in before)
    events = json.load(open(trace))["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert {"F0", "B0", "STEP"} <= names
    assert json.load(open(ckpt / "latest.json"))["step"] == 3
    left = [p.name for p in temp.iterdir() if p.name.startswith(("fxpipe-train-", "torchelastic_"))]
    assert not left, left  # the run folder is removed, and torchrun left no log folder (torch's caches may stay)
