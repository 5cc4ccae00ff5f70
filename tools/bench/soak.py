"""Soak benchmark: does a long run keep its memory and its speed?

    python -m tools.bench.soak [--steps 500] [--models examples/gpt.py,examples/cnn.py]
                               [--schedules 1f1b-stash,1f1b-flush,gpipe] [--microbatches 8] [--devices 2]

For every model file and schedule, the parent plans and splits the model
once (as ``fxpipe train`` does, ``--devices`` workers) and saves the split;
``--devices`` fresh processes (CPU gloo, one thread each) load it and train
for ``--steps`` steps. Every rank reads its resident set size (``VmRSS``)
after each optimizer step; the last stage records each step's samples/s.

The table gives, at the start, the middle and the end of the run, the
largest RSS over the ranks and the median samples/s over a window of steps
there (the first window starts after a few warm-up steps), and the ratios
end / start. A leak shows as an RSS ratio above 1 that grows with
``--steps``, usually with a falling samples/s ratio. It is a benchmark, not a
test: the machine may be shared, so the load average is printed with the
table; samples/s ratios are only as steady as the machine's load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from passes.partition.costmodel import SCHEDULES
from tools.bench.procmem import free_port, status_mib

WARMUP = 5  # steps before the start window (imports, first allocations)


def _steps_per_call(layout: Any, rank: int, schedule: str, M: int) -> int:
    """Optimizer steps this rank takes per training step (stash: one per minibatch it computes)."""
    if schedule != "1f1b-stash":
        return 1
    return len(range(layout.replica_of(rank), M, layout.replicas[layout.stage_of(rank)]))


def _entry(rank: int, world: int, port: int, args: Tuple[str, str, int, int, str], out: str) -> None:
    from fxpipe.layout import Layout
    from fxpipe.loader import load_model
    from fxpipe.runtime.loop import TrainConfig, train
    from fxpipe.runtime.worker import init, make_data
    from fxpipe.split_model import SplitModel

    model, schedule, M, steps, split_dir = args
    torch.set_num_threads(1)
    init(rank, world, 300.0, init_method=f"tcp://127.0.0.1:{port}", device="cpu")
    try:
        torch.manual_seed(0)
        spec = load_model(model, check=False)
        split = SplitModel.load(split_dir)
        layout = Layout.of([s.replicas for s in split.plan.stages] if split.plan is not None
                           else [1] * split.num_stages)
        per_step, calls, rss = _steps_per_call(layout, rank, schedule, M), [0], []

        def observe(_: Any) -> None:  # RSS at the end of every step
            calls[0] += 1
            if calls[0] % per_step == 0:
                rss.append(status_mib("VmRSS"))

        cfg = TrainConfig(schedule=schedule, microbatches=M, steps=steps, lr=1e-3, log=False)
        res = train(rank=rank, layout=layout, split=split, cfg=cfg, data=make_data(spec, M),
                    loss_fn=spec.loss_fn, observe=observe)
        torch.save({"rss": rss, "sps": res.samples_per_s},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _split(model: str, devices: int, schedule: str, M: int, split_dir: str) -> List[int]:
    """Plan and split ``model`` once, in this process; returns the replicas per stage."""
    import contextlib
    import io

    from fxpipe.loader import load_model
    from fxpipe.runtime.launch import plan_and_split

    with contextlib.redirect_stderr(io.StringIO()):  # the plan's table and progress bars
        split = plan_and_split(load_model(model), devices, schedule, M)
    split.save(split_dir)
    return [s.replicas for s in split.plan.stages]


def run_config(model: str, schedule: str, devices: int, M: int, steps: int) -> Dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        split_dir = os.path.join(out, "split")
        replicas = _split(model, devices, schedule, M, split_dir)
        mp.start_processes(_entry, args=(devices, port, (model, schedule, M, steps, split_dir), out),
                           nprocs=devices, join=True, start_method="spawn")
        res = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(devices)]
    sps = next(r["sps"] for r in res if r["sps"])
    rss = [max(r["rss"][i] for r in res) for i in range(min(len(r["rss"]) for r in res))]
    return {"replicas": replicas, "sps": sps, "rss": rss}


def windows(steps: int) -> List[Tuple[int, int]]:
    """(first, end) step ranges for start, middle and end."""
    w = max(3, min(20, steps // 20))
    first = min(WARMUP, max(0, steps - 3 * w))
    mid = max(first + w, steps // 2 - w // 2)
    return [(first, first + w), (mid, mid + w), (steps - w, steps)]


def summarize(r: Dict[str, Any], steps: int) -> List[float]:
    """RSS (MiB, at each window's last step) and median samples/s per window, then the two ratios."""
    rss = [r["rss"][min(b, len(r["rss"])) - 1] for _, b in windows(steps)]
    sps = [statistics.median(r["sps"][a:b]) for a, b in windows(steps)]
    return rss + sps + [rss[2] / rss[0], sps[2] / sps[0]]


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--models", default="examples/gpt.py,examples/cnn.py", help="model files, comma-separated")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--devices", type=int, default=2)
    args = p.parse_args(list(argv) or None)
    if args.steps < 20:
        p.error("--steps must be at least 20 (start, middle and end windows)")
    from tabulate import tabulate

    load0 = os.getloadavg()
    rows = []
    for model in args.models.split(","):
        for schedule in args.schedules.split(","):
            r = run_config(model, schedule, args.devices, args.microbatches, args.steps)
            s = summarize(r, args.steps)
            print(f"  {model} {schedule}: RSS {s[0]:.0f} -> {s[2]:.0f} MiB, {s[3]:.1f} -> {s[5]:.1f} samples/s",
                  file=sys.stderr, flush=True)
            rows.append([os.path.basename(model), schedule, "x".join(map(str, r["replicas"])), args.steps,
                         *[f"{v:.0f}" for v in s[:3]], *[f"{v:.1f}" for v in s[3:6]], f"{s[6]:.2f}", f"{s[7]:.2f}"])
    print(tabulate(rows, headers=["model", "schedule", "replicas", "steps", "RSS start", "RSS mid", "RSS end",
                                  "sps start", "sps mid", "sps end", "RSS end/start", "sps end/start"],
                   disable_numparse=True))
    load1 = os.getloadavg()
    spans = ", ".join(f"{a}-{b}" for a, b in windows(args.steps))
    print(f"CPU gloo, 1 thread per rank, {os.cpu_count()} cores; load average {load0[0]:.1f} before, "
          f"{load1[0]:.1f} after; RSS: largest rank's, MiB, after steps {spans} (last of each); "
          f"samples/s: median over those steps, {args.microbatches} microbatches per step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
