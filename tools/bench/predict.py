"""Predicted against measured: the simulator's step time next to `fxpipe train`'s, on CPU gloo.

    python -m tools.bench.predict [--steps 8] [--cases mlp-2-flush,gpt-2-stash,...]

For each case it runs `fxpipe split` (profile + plan), `fxpipe train --split
... --trace` (measured samples/s, median after warm-up), and prints three
rates:

- *predicted*: what `fxpipe train` prints before training: the plan's
  profiled costs (node times calibrated to the whole model) through
  ``fxpipe.simulate``, plus each stage's optimizer step timed by
  ``fxpipe.runtime.stepcost``, the measured CPU each side of a message
  (``fxpipe.runtime.postcost``), with more ranks than cores, ranks
  sharing the cores (``fxpipe.sharing``), and with fewer, the speed-up of
  the threads each worker then runs (``fxpipe.runtime.threadcost``);
- *replay*: the same simulation with each stage's forward, backward and step
  times replaced by their medians in the measured trace (waits inside them
  removed) and each send blocking its rank for the median measured send
  time (the runtime's sends return once the bytes are handed over), cores
  shared as in *predicted*. It isolates the
  schedule and communication model from profiling error: when *replay* is
  close and *predicted* is not, the per-node profile is what missed
  (another load on the machine, per-action overhead the node timings do not
  see, thread contention);
- *measured*.

A fourth column, *compute CPU ÷ profile*, divides the CPU time the ranks'
threads spent in their forwards and backwards (the trace's ``cpu_us``,
medians per stage, summed) by the profile's compute for the same stages:
above 1.00 the model's own work cost more CPU inside the pipeline than the
profile measured alone, below it less (on a machine whose speed drifts
between the profile and the run, either happens; the prediction's error
follows it). Workers that run several threads leave it out (``–``): the
trace counts the calling thread only.

The ratio columns are predicted (or replayed) step time divided by measured
step time: 1.00 is a perfect prediction; the target is within 15 %.
This is a benchmark, not a test: it prints a table, nothing asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from tabulate import tabulate

from fxpipe.layout import Layout
from fxpipe.runtime.launch import worker_threads
from fxpipe.schedule import build_schedule
from fxpipe.show.data import Trace, TraceEvent, load_input, load_trace
from fxpipe.show.view import simulate_input
from fxpipe.simulate import costs_from_plan, plan_bandwidth, simulate
from tools.bench.models import TinyGPT

FXPIPE = [sys.executable, "-m", "fxpipe"]


# ------------------------------------------------------------ models (fxpipe's `package.module:factory`)

def mlp():
    """A deep MLP: 12 equal tanh layers of width 512, 64 samples per microbatch."""
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(512, 512), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(512, 16))
    return model, (torch.randn(64, 512),), _mse, torch.randn(64, 16)


def gpt():
    """A GPT-style stack (``models.TinyGPT``, wider): embedding tied to the output head."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, dim=128, heads=4, layers=6, ctx=64)
    return model, (torch.randint(0, 256, (8, 64)),)


def _mse(out, y):
    return ((out - y) ** 2).mean()


CASES = {  # name -> (factory, devices, schedule, microbatches)
    "mlp-1-flush": ("tools.bench.predict:mlp", 1, "1f1b-flush", 4),  # fewer ranks than cores: 2 threads each
    "mlp-2-flush": ("tools.bench.predict:mlp", 2, "1f1b-flush", 4),
    "mlp-2-gpipe": ("tools.bench.predict:mlp", 2, "gpipe", 4),
    "mlp-2-stash": ("tools.bench.predict:mlp", 2, "1f1b-stash", 4),
    "gpt-2-flush": ("tools.bench.predict:gpt", 2, "1f1b-flush", 4),
    "mlp-2-zb": ("tools.bench.predict:mlp", 2, "zb-h1", 4),
    "mlp-4-flush": ("tools.bench.predict:mlp", 4, "1f1b-flush", 8),  # more ranks than this machine's 2 cores
    "gpt-4-flush": ("tools.bench.predict:gpt", 4, "1f1b-flush", 8),
}


# ------------------------------------------------------------ running

def _run(cmd: List[str], what: str) -> Tuple[str, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout, proc.stderr


def measure(model: str, devices: int, schedule: str, M: int, steps: int, folder: Path) -> Tuple[float, float]:
    """(measured, predicted) samples/s that `fxpipe train` prints: median after two warm-up steps, and
    its prediction (the simulator on the plan's costs plus each stage's optimizer step timed on CPU)."""
    common = ["--devices", str(devices), "--schedule", schedule, "--microbatches", str(M)]
    _run(FXPIPE + ["split", model, "-o", str(folder), "--time-limit", "10"] + common, "fxpipe split")
    out, err = _run(FXPIPE + ["train", model, "--split", str(folder), "--steps", str(steps),
                         "--trace", str(folder / "trace.json")] + common, "fxpipe train")
    rates = [float(x) for x in re.findall(r"samples/s\s+([\d.]+)", out)]
    if not rates:
        raise SystemExit(f"no samples/s in fxpipe train's output:\n{out[-1000:]}")
    predicted = re.search(r"predicted ([\d.]+) samples/s", err)
    if predicted is None:
        raise SystemExit(f"no prediction in fxpipe train's output:\n{err[-1000:]}")
    return statistics.median(rates[2:] or rates), float(predicted.group(1))


def busy(event: TraceEvent, waits: List[TraceEvent]) -> float:
    """An action's time minus the waits inside it (the runtime receives lazily, within F/B)."""
    inside = sum(max(0.0, min(event.end_s, w.end_s) - max(event.start_s, w.start_s)) for w in waits)
    return max(0.0, event.end_s - event.start_s - inside)


def measured_costs(trace: Trace, layout: Layout) -> Dict[int, Tuple[float, float, float, float]]:
    """Per stage: median forward, backward, optimizer-step and weight-gradient (``W``, zb-h1) seconds
    in the trace, waits excluded."""
    out = {}
    for j in range(layout.num_stages):
        times: Dict[str, List[float]] = {"F": [], "B": [], "W": [], "step": []}
        for r in layout.ranks(j):
            evs = trace.get(r, [])
            waits = [e for e in evs if e.activity == "wait"]
            for e in evs:
                if e.activity in times:
                    times[e.activity].append(busy(e, waits))
        med = {k: statistics.median(v or [0.0]) for k, v in times.items()}
        out[j] = (med["F"], med["B"], med["step"], med["W"])
    return out


def _setup(folder: Path, schedule: str, M: int):
    """(the split's saved inputs, their simulation, its layout, the plan's costs and links) for ``folder``."""
    data = load_input(str(folder))
    sim, layout = simulate_input(data, schedule, M)
    costs, links = costs_from_plan(data.plan, data.graph)
    return data, sim, layout, costs, links


def compute_cpu_ratio(folder: Path, schedule: str, M: int) -> float:
    """Σ over stages of the median forward + backward (+ ``W``) CPU seconds in the trace, over the profile's."""
    _data, _sim, layout, costs, _links = _setup(folder, schedule, M)
    events = [e for e in json.loads((folder / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    measured = 0.0
    for j in range(layout.num_stages):
        ranks = set(layout.ranks(j))
        for kind in ("F", "B", "W"):
            cpu = [e["args"]["cpu_us"] / 1e6 for e in events if e["pid"] in ranks
                   and re.fullmatch(kind + r"\d+", e["name"]) and "cpu_us" in e.get("args", {})]
            measured += statistics.median(cpu) if cpu else 0.0
    profiled = sum(c.fwd_s + c.bwd_s for c in costs)
    return measured / profiled if profiled > 0 else float("nan")


def replay_rate(folder: Path, schedule: str, M: int) -> float:
    """Samples/s of the simulation replayed on the costs measured in the trace."""
    data, sim, layout, costs, links = _setup(folder, schedule, M)
    pick = (lambda r: r.steady_samples_per_s) if schedule == "1f1b-stash" else (lambda r: r.samples_per_s)
    trace = load_trace(str(folder / "trace.json"))
    med = measured_costs(trace, layout)  # compute, waits excluded
    costs = [replace(c, fwd_s=med[j][0], bwd_s=med[j][1] + med[j][3], step_s=med[j][2],
                     wgrad_s=med[j][3] if schedule == "zb-h1" else None) for j, c in enumerate(costs)]
    sched = build_schedule(schedule, layout, sim.microbatches, data.links or links, data.tied_stages)
    sends = [e.end_s - e.start_s for evs in trace.values() for e in evs if e.name.startswith("SEND")]
    replay = simulate(sched, costs, layout, bandwidth=plan_bandwidth(data.plan),
                      samples_per_microbatch=int(data.plan.batch_size or 1), overlap_comm=False,
                      latency_s=statistics.median(sends) if sends else 0.0, cores=os.cpu_count() or 1)
    return pick(replay)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fxpipe-predict-") as tmp:
        for name in args.cases.split(","):
            model, devices, schedule, M = CASES[name]
            print(f"{name}: split + train ...", file=sys.stderr, flush=True)
            folder = Path(tmp) / name
            measured, predicted = measure(model, devices, schedule, M, args.steps, folder)
            replay = replay_rate(folder, schedule, M)
            one_thread = worker_threads(None, devices) == 1  # fewer workers than cores run several threads
            cpu = f"{compute_cpu_ratio(folder, schedule, M):.2f}" if one_thread else "–"
            rows.append([name, f"{predicted:.1f}", f"{replay:.1f}", f"{measured:.1f}",
                         f"{measured / predicted:.2f}", f"{measured / replay:.2f}", cpu])
    print(tabulate(rows, headers=["case", "predicted samples/s", "replay samples/s", "measured samples/s",
                                  "predicted ÷ measured step", "replay ÷ measured step",
                                  "compute CPU ÷ profile"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
