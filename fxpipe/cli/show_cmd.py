"""``fxpipe show PLAN_OR_OUTDIR``: look at a plan, its graph and its schedule.

Writes one self-contained HTML page (no network needed to open it), or with
``--text`` prints the stage table and an ASCII timeline, or with
``--format dot|svg|png`` writes the graph through Graphviz.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from passes.errors import FxpipeError
from passes.partition.costmodel import SCHEDULES
from fxpipe.units import at_least


def register(subparsers) -> None:
    p = subparsers.add_parser("show", help="view a plan: graph by stage, stage table, schedule timeline",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="PLAN_OR_OUTDIR", help="folder written by `fxpipe split`, or a plan.json")
    p.add_argument("-o", "--output", help="output file (default: view.html in the folder, or PLAN.html)")
    p.add_argument("--profile", help="profile.json / PipeDream graph.txt to draw (default: profile.json beside the plan)")
    p.add_argument("--trace", help="Chrome trace from `fxpipe train --trace`: one middle step drawn under the simulation")
    p.add_argument("--text", action="store_true", help="print the stage table and an ASCII timeline instead")
    p.add_argument("--schedule", choices=SCHEDULES,
                   help="schedule to simulate (default: the plan's)")
    p.add_argument("--microbatches", type=at_least(1), help="microbatches per step to simulate (default: the plan's)")
    p.add_argument("--format", choices=("html", "dot", "svg", "png"), default="html",
                   help="html (default, self-contained) or the graph through Graphviz")
    p.add_argument("--width", type=at_least(20), default=100, help="columns of the ASCII timeline (--text)")
    p.set_defaults(func=run)


def run(args) -> int:
    from fxpipe.show.data import load_input
    from fxpipe.show.view import simulate_input
    from passes.partition.costmodel import assignment_of

    data = load_input(args.target, args.profile)
    sim, layout = simulate_input(data, args.schedule, args.microbatches)
    if args.text:
        from fxpipe.show.text import render_text
        print(render_text(data.plan, sim, layout, data.notes, args.width))
        return 0
    out = Path(args.output) if args.output else _default_output(Path(args.target), args.format)
    if args.format != "html":
        if data.graph is None:
            raise FxpipeError("--format dot/svg/png draws the graph, which needs profile.json; pass --profile")
        from fxpipe.show import graphviz
        graphviz.write(data.graph, assignment_of(data.plan.stages), out, args.format)
    else:
        from fxpipe.show.html import render_html
        measured, note = _measured(args.trace, sim)
        title = f"fxpipe plan: {len(data.plan.stages)} stages on {data.plan.devices} devices"
        out.write_text(render_html(data, sim, layout, measured, title=title, measured_note=note))
    for note in data.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {out}")
    return 0


def _measured(trace, sim):
    """The trace cropped to one middle step, like the simulation; the whole run if it has too few steps."""
    from fxpipe.show.data import Window, load_trace, one_step

    if not trace:
        return Window({}, "")
    measured = load_trace(trace)
    steps = sim.microbatches if sim is not None and sim.schedule == "1f1b-stash" else 1
    return one_step(measured, steps) or Window(measured, "whole run")


def _default_output(target: Path, fmt: str) -> Path:
    if target.is_dir():
        return target / f"view.{fmt}"
    return target.with_suffix(f".{fmt}")
