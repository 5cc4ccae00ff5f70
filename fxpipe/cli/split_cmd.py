"""``fxpipe split MODEL --devices K``: trace, profile, partition and split a model; write the stages.

MODEL is a model file (``examples/gpt.py``) or ``package.module:factory``. The
output folder (``-o``, default ``fxpipe-out/<model name>``) gets:

- ``stage_<j>.py``: stage j as readable Python (an ``nn.Module`` whose
  ``forward`` is the stage graph, with its ``passes.comm`` send/recv calls);
  ``stage_<j>.pt`` its weights; ``split.json`` the wiring (load the whole
  folder with ``fxpipe.SplitModel.load``);
- ``plan.json`` (the plan, as ``fxpipe plan -o`` writes it), ``profile.json``
  (the profiled cost graph, input of ``fxpipe plan``);
- ``report.md``: the stage table, the plan's cost table, tied parameters and
  every value that crosses a stage boundary.

The partitioner options are ``fxpipe plan``'s.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, List

from fxpipe.cli.plan_cmd import add_plan_options, add_precision_option, partition_kwargs
from fxpipe.runtime.devices import DEVICES
from fxpipe.units import at_least


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("split", help="split a model into pipeline stage modules (trace, profile, plan, split)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="model .py file or package.module:factory")
    add_plan_options(p)
    p.add_argument("--method", choices=("auto", "fx", "export"), default="auto",
                   help="capture: symbolic tracing, torch.export, or fx then export (default auto)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="device to profile on: cpu (default), cuda, or auto (cuda where this machine has a GPU)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed repetitions per node (default 3)")
    add_precision_option(p)
    p.add_argument("-o", "--output", metavar="OUTDIR", default=None,
                   help="folder to write (default fxpipe-out/<model name>)")
    p.set_defaults(func=run)


def default_outdir(model: str) -> Path:
    """``fxpipe-out/gpt`` for ``examples/gpt.py``, ``fxpipe-out/pkg.mod-factory`` for ``pkg.mod:factory``."""
    name = Path(model).stem if model.endswith(".py") or "/" in model else model.replace(":", "-")
    return Path("fxpipe-out") / (re.sub(r"[^\w.-]+", "_", name) or "model")


def stage_table(split: Any) -> str:
    """One row per stage: what it runs, holds, takes, receives and sends."""
    from tabulate import tabulate

    rows: List[list] = []
    for j, stage in enumerate(split.stages):
        plan = split.plan.stages[j] if split.plan is not None else None
        params = list(stage.parameters())
        recv = sorted({e.src_stage for e in split.comm if e.dst_stage == j})
        send = sorted({e.dst_stage for e in split.comm if e.src_stage == j})
        sent_bytes = sum(t.nbytes for e in split.comm if e.src_stage == j for t in e.value.tensors())
        rows.append([j, len(plan.nodes) if plan else "", plan.replicas if plan else 1,
                     ",".join(map(str, plan.ranks)) if plan else "",
                     f"{sum(p.numel() for p in params):,}", ", ".join(split.input_names[i] for i in split.stage_inputs[j]),
                     ", ".join(map(str, recv)), ", ".join(map(str, send)), f"{sent_bytes:,}", f"stage_{j}.py"])
    head = ["stage", "nodes", "replicas", "ranks", "params", "model inputs", "recv from", "send to", "sends bytes",
            "file"]
    return tabulate(rows, head, tablefmt="github", disable_numparse=True)


def report(split: Any, model: str) -> str:
    """``report.md``: stage table, plan costs, tied parameters, boundary values."""
    lines = [f"# fxpipe split of `{model}`", "", f"{split.num_stages} stages, links {split.links}.", "",
             "## Stages", "", stage_table(split), ""]
    if split.plan is not None:
        lines += ["## Plan (predicted costs per microbatch)", "", "```", split.plan.table(), "```", ""]
    if split.tied:
        lines += ["## Tied parameters (gradients summed over the stages holding them)", ""]
        lines += [f"- `{name}`: stages {stages}" for name, stages in sorted(split.tied.items())] + [""]
    lines += ["## Values crossing stage boundaries", "", "| tag | from | to | value |", "|---|---|---|---|"]
    for e in split.comm:
        spec = e.value.spec
        what = f"{spec.dtype} {list(spec.shape)}" if e.value.is_tensor else f"{type(spec).__name__} {spec!r}"
        lines.append(f"| `{e.tag}` | {e.src_stage} | {e.dst_stage} | {what} |")
    return "\n".join(lines) + "\n"


def check_outdir(outdir: Path) -> None:
    """The output folder can be created (or is a folder already)."""
    from passes.errors import FxpipeError

    for parent in [outdir, *outdir.parents]:
        if parent.exists() and not parent.is_dir():
            raise FxpipeError(f"-o {outdir}: {parent} exists and is a file, not a folder; "
                              "name a new or existing folder for the split")
        if parent.exists():
            break


def run(args: argparse.Namespace) -> int:
    from fxpipe.api import split
    from fxpipe.loader import load_model
    from fxpipe.runtime.devices import resolve_device

    from fxpipe.runtime.heap import keep_freed_memory

    outdir = Path(args.output) if args.output else default_outdir(args.model)
    check_outdir(outdir)  # before the minutes of profiling and planning, not after
    keep_freed_memory()  # as training does; the planner's passes reuse what they freed (fxpipe.runtime.heap)
    spec = load_model(args.model)
    kwargs = partition_kwargs(args)
    result = split(spec.model, spec.example_inputs, args.devices, capture_method=args.method,
                   leaf_modules=spec.leaf_modules, concrete_args=spec.concrete_args,
                   device=resolve_device(args.device, None),
                   repeats=args.repeats, batch_size=args.batch_size, precision=args.precision, **kwargs)
    result.save(outdir)
    result.plan.save(outdir / "plan.json")
    result.profile.save(outdir / "profile.json")
    (outdir / "report.md").write_text(report(result, args.model))
    print(stage_table(result))
    print(f"\nbottleneck {result.plan.bottleneck_s * 1e3:.3f} ms per microbatch, "
          f"{result.plan.samples_per_s:.1f} samples/s, {result.plan.speedup_vs_one:.2f}x vs one device; "
          f"{result.plan.options.get('microbatches')} microbatches per step ({result.plan.options.get('schedule')})")
    print(f"wrote {outdir}/: stage_0.py..stage_{result.num_stages - 1}.py (+ .pt weights), split.json, "
          "plan.json, profile.json, report.md", file=sys.stderr)
    return 0
