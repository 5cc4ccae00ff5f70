"""One self-contained HTML page: graph, stage table, simulated and measured timelines.

Everything is inline (CSS, the drawing script, the data as JSON), nothing is
fetched, so the file opens offline and can be mailed around. Python decides
the content (tables, numbers, groups); the script only lays out and draws the
SVG, because the graph must re-layout when a group is expanded.
"""
from __future__ import annotations

import html
import json
from typing import Any, Dict, List, Optional

from passes.partition.costmodel import assignment_of

from fxpipe.show.assets import CSS, JS
from fxpipe.show.data import ShowInput, Trace
from fxpipe.show.graph import graph_payload

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#2f4b7c", "#a05195", "#d45087", "#665191", "#ffa600", "#003f5c"]


def fmt_s(x: Optional[float]) -> str:
    if x is None:
        return "–"
    x = float(f"{float(x):.3g}")  # round first: 999.96 µs is "1 ms", not "1e+03 µs"
    if x == 0:
        return "0"
    if abs(x) >= 1:
        return f"{x:.3g} s"
    if abs(x) >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} µs"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "–"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else (f"{n:.3g} {unit}" if n < 100 else f"{n:.0f} {unit}")
        n /= 1024
    return str(n)


def batches_word(schedule: str) -> str:
    """PipeDream calls what flows through a stash pipeline minibatches (one update each)."""
    return "minibatches" if schedule == "1f1b-stash" else "microbatches"


def stage_rows(plan: Any) -> List[Dict[str, Any]]:
    """The stage table's rows (shared by the HTML and the text view)."""
    worst = max((float(s.time_s or 0) for s in plan.stages), default=0.0)
    rows = []
    for s in plan.stages:
        rows.append({"stage": s.index, "nodes": len(s.nodes), "replicas": s.replicas,
                     "ranks": ",".join(map(str, s.ranks or [])), "fwd": fmt_s(s.fwd_s), "bwd": fmt_s(s.bwd_s),
                     "compute/r": fmt_s(s.compute_s), "all-reduce": fmt_s(s.allreduce_s), "comm": fmt_s(s.comm_s),
                     "stage time": fmt_s(s.time_s), "params": fmt_bytes(s.param_bytes),
                     "sends": fmt_bytes(s.send_bytes), "memory": fmt_bytes(s.memory_bytes),
                     "bottleneck": worst > 0 and float(s.time_s or 0) >= worst * (1 - 1e-9)})
    return rows


def _stage_table_html(plan: Any) -> str:
    rows = stage_rows(plan)
    if not rows:
        return "<p>no stages</p>"
    cols = [c for c in rows[0] if c != "bottleneck"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r in rows:
        cls = ' class="bottleneck" title="bottleneck stage"' if r["bottleneck"] else ""
        swatch = f'<span class="sw" style="background:{PALETTE[r["stage"] % len(PALETTE)]}"></span>'
        cells = "".join(f"<td>{swatch if c == 'stage' else ''}{html.escape(str(r[c]))}</td>" for c in cols)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f'<table class="stages"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _summary_html(plan: Any, sim: Any) -> str:
    opts = getattr(plan, "options", {}) or {}
    solver = getattr(plan, "solver", {}) or {}
    items = [("devices", plan.devices), ("batch size", plan.batch_size),
             ("bottleneck", fmt_s(plan.bottleneck_s)),
             ("predicted samples/s", f"{float(plan.samples_per_s or 0):.4g}"),
             ("speedup vs 1 device", f"{float(plan.speedup_vs_one or 0):.3g}×"),
             ("speedup vs data parallel", f"{float(plan.speedup_vs_dp or 0):.3g}×"),
             ("bandwidth", f"{float(opts.get('bandwidth') or 0):.3g} B/s"), ("solver", solver.get("status", "–"))]
    if opts.get("gpus_per_node"):
        items.insert(-1, ("inside a node", f"{float(opts.get('intra_bandwidth') or 0):.3g} B/s, "
                                           f"{opts['gpus_per_node']} devices per node"))
    if sim is not None:
        items += [("simulated schedule", f"{sim.schedule}, {sim.microbatches} {batches_word(sim.schedule)}"),
                  ("simulated step" if sim.steps == 1 else f"simulated {sim.steps} steps", fmt_s(sim.step_s)),
                  ("simulated samples/s", f"{sim.samples_per_s:.4g}"),
                  ("steady-state samples/s", f"{sim.steady_samples_per_s:.4g}"),
                  ("bubble", f"{100 * sim.bubble_fraction:.1f} %")]
    return "".join(f"<div class='kv'><span>{html.escape(k)}</span><b>{html.escape(str(v))}</b></div>"
                   for k, v in items)


def sim_payload(sim: Any, layout: Any) -> Dict[str, Any]:
    ranks = {}
    for rank, evs in sim.events.items():
        rows = []
        for e in evs:
            if e.activity == "recv" or e.end <= e.start and e.activity != "send":
                continue
            activity = e.action.kind.value if e.activity == "compute" else e.activity
            rows.append([e.start, e.end, str(e.action), activity])
        ranks[str(rank)] = rows
    return {"ranks": ranks, "stage_of_rank": {str(r): layout.stage_of(r) for r in sim.events},
            "step_s": sim.step_s, "schedule": sim.schedule, "microbatches": sim.microbatches,
            "bubble": sim.bubble_fraction, "peak_memory": {str(r): m for r, m in sim.peak_memory.items()}}


def render_html(data: ShowInput, sim: Any = None, layout: Any = None,
                measured: Optional[Trace] = None, title: str = "fxpipe plan",
                measured_note: str = "") -> str:
    """The page as one string. ``measured``: a trace from ``data.load_trace`` (or ``one_step``)."""
    plan = data.plan
    stage_of = assignment_of(plan.stages)
    payload = {
        "palette": PALETTE, "stages": len(plan.stages),
        "graph": graph_payload(data.graph, stage_of) if data.graph is not None else None,
        "sim": sim_payload(sim, layout) if sim is not None else None,
        "measured": {"ranks": {str(r): v for r, v in measured.items()}, "note": measured_note} if measured else None,
    }
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in data.notes)
    blob = json.dumps(payload, separators=(",", ":")).replace("</", "<\\/")
    return PAGE.format(title=html.escape(title), source=html.escape(data.source), css=CSS, js=JS,
                       summary=_summary_html(plan, sim), table=_stage_table_html(plan),
                       notes=f"<ul class='notes'>{notes}</ul>" if notes else "", data=blob)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style></head>
<body>
<header><h1>{title}</h1><div class="src">{source}</div></header>
{notes}
<section><div class="summary">{summary}</div></section>
<section><h2>Stages</h2>{table}</section>
<section><h2>Schedule timeline</h2>
<div class="legend" id="tl-legend"></div>
<div class="timelines"><div class="tl" id="tl-sim"></div><div class="tl" id="tl-measured"></div></div></section>
<section id="graph-section"><h2>Graph</h2>
<div class="toolbar"><button id="expand-all">expand all</button><button id="collapse-all">collapse all</button>
<button id="wrap">wrap rows / one row</button><button id="fit">fit width</button><span id="graph-info"></span></div>
<div id="graph-wrap"><svg id="graph"></svg></div>
<div id="details"></div></section>
<script type="application/json" id="fxpipe-data">{data}</script>
<script>{js}</script>
</body></html>
"""
