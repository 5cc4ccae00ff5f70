"""Benchmark: one-rank ``fxpipe train`` against a plain PyTorch loop on the same device.

    python -m tools.bench.one_device [--device cuda] [--precisions fp32,bf16] [--sizes 64x4,512x8]
                                     [--steps 300] [--warmup 30] [--microbatches 4] [--batch 8]

What a pipeline runtime costs where there is no pipeline: the bundled GPT
(``examples/gpt.py``) at each ``DIMxLAYERS`` size, trained for ``--steps``
steps of ``--microbatches`` microbatches with AdamW, once by the plain loop
(per step: forward, loss and backward of each microbatch under autocast,
then one fused AdamW step; fp16 with ``torch.amp.GradScaler``) in this
process, and once by ``fxpipe.train(..., devices=1)`` (torchrun, one worker,
the schedule's default, the same data and optimizer). Throughput is
samples/s per step, median over the steps after ``--warmup``; the ratio is
fxpipe over the plain loop. On CUDA every step of the plain loop ends with a
synchronize, as fxpipe's step lines do (they read the loss).

It is a benchmark, not a test: the machine may be shared; the load average
is printed with the table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from typing import Any, Dict, List, Sequence

import torch
from tabulate import tabulate

from tools.bench.procmem import load_note

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MODEL_FILE = """\
import runpy
_gpt = runpy.run_path({example!r})
batch = {batch}
model = _gpt["GPT"](dim={dim}, layers={layers}, heads={heads})
loss_fn = _gpt["loss_fn"]
example_inputs, example_targets = next(_gpt["batches"](batch, seed=1234))

def batches():
    return _gpt["batches"](batch)
"""


def model_file(folder: str, dim: int, layers: int, batch: int) -> str:
    """A model file for the bundled GPT at this size (the workers load it, as ``fxpipe train``'s do)."""
    path = os.path.join(folder, f"gpt_{dim}x{layers}.py")
    with open(path, "w") as f:
        f.write(_MODEL_FILE.format(example=os.path.join(ROOT, "examples", "gpt.py"), batch=batch, dim=dim,
                                   layers=layers, heads=max(1, dim // 64)))
    return path


def plain(path: str, device: str, precision: str, steps: int, M: int) -> List[float]:
    """samples/s of each step of the plain loop."""
    from fxpipe.loader import load_model

    spec = load_model(path, check=False)
    model = spec.model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    data = spec.batches()
    rates, last = [], time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        samples = 0
        for _m in range(M):
            (x,), y = next(data)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = spec.loss_fn(model(x), y) / M
            scaler.scale(loss).backward()
            samples += x.shape[0]
        scaler.step(opt)
        scaler.update()
        float(loss.detach())  # the step's loss, read as fxpipe's step line reads it
        now = time.perf_counter()
        rates.append(samples / (now - last))
        last = now
    return rates


def fx(path: str, device: str, precision: str, steps: int, M: int) -> List[float]:
    """samples/s of each step of one-rank fxpipe training."""
    import fxpipe

    out = fxpipe.train(path, devices=1, device=device, steps=steps, microbatches=M, optimizer="adamw",
                       precision=precision, return_state=False, time_limit=10)
    return out.samples_per_s


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--sizes", default="64x4,512x8", help="DIMxLAYERS of the GPT, comma-separated")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="samples per microbatch")
    args = p.parse_args(list(argv) or None)
    before = os.getloadavg()
    rows: List[List[Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes.split(","):
            dim, layers = (int(v) for v in size.split("x"))
            path = model_file(folder, dim, layers, args.batch)
            for precision in args.precisions.split(","):
                got: Dict[str, float] = {}
                for name, run in (("plain", plain), ("fxpipe", fx)):
                    print(f"one_device: {name} {size} {precision} on {args.device} ...", file=sys.stderr, flush=True)
                    rates = run(path, args.device, precision, args.steps, args.microbatches)
                    got[name] = statistics.median(rates[args.warmup:] or rates)
                rows.append([size, precision, round(got["plain"], 1), round(got["fxpipe"], 1),
                             round(got["fxpipe"] / got["plain"], 3)])
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(textwrap.dedent(f"""\
        one device ({device}, torch {torch.__version__}): GPT DIMxLAYERS, {args.microbatches} microbatches of
        {args.batch}, AdamW, median samples/s of steps {args.warmup + 1}-{args.steps}; {load_note(before)}"""))
    print(tabulate(rows, headers=["gpt", "precision", "plain torch", "fxpipe 1 rank", "fxpipe / plain"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
