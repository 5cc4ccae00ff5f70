"""What ``fxpipe show`` looks at: a plan, its profiled graph if known, a trace.

``fxpipe split`` writes an output folder with ``plan.json`` (``Plan.to_json``)
and ``profile.json`` (``CostGraph.to_json``). A bare plan file works too; the
view then has no graph and says so. The plan is read with ``Plan.from_json``,
the same reader the runtime uses.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

from passes.costgraph import CostGraph
from passes.errors import FxpipeError
from fxpipe.plan import Plan

@dataclass
class ShowInput:
    plan: Any
    graph: Optional[CostGraph]
    source: str
    notes: List[str] = field(default_factory=list)
    tied_stages: tuple = ()
    links: Optional[List[tuple]] = None  # from split.json when the split is there


def load_input(target: str, profile: Optional[str] = None) -> ShowInput:
    """Resolve ``PLAN_OR_OUTDIR`` (and an explicit ``--profile``) into a ``ShowInput``."""
    path = Path(target)
    if not path.exists():
        raise FxpipeError(f"{target} does not exist; pass the folder `fxpipe split` wrote or its plan.json")
    plan_path = path / "plan.json" if path.is_dir() else path
    if not plan_path.exists():
        raise FxpipeError(f"{path} has no plan.json; run `fxpipe split MODEL -o {path}` first")
    notes: List[str] = []
    plan = Plan.load(plan_path)
    prof = Path(profile) if profile else plan_path.parent / "profile.json"
    graph = None
    if prof.exists() or profile:  # a --profile that does not exist: CostGraph.load says so
        graph = CostGraph.load(prof)
        missing = [n for s in plan.stages for n in s.nodes if n not in graph.nodes]
        if missing:
            notes.append(f"{len(missing)} plan nodes are not in {prof.name} (first: {missing[0]}); graph may be partial")
    else:
        notes.append(f"no profile.json next to {plan_path.name}: graph view unavailable "
                     "(show the folder `fxpipe split` wrote, or pass --profile)")
    data = ShowInput(plan=plan, graph=graph, source=str(plan_path), notes=notes)
    _read_split(plan_path.parent, data)
    return data


def _read_split(folder: Path, data: ShowInput) -> None:
    """Tied stages and the exact links from the split manifest, when ``fxpipe split`` left one."""
    for path in (folder / "split.json", folder / "split" / "split.json"):
        if path.exists():
            try:
                manifest = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                data.notes.append(f"{path} is not readable JSON; links and tied stages guessed from the plan")
                return
            data.tied_stages = tuple(sorted({int(s) for st in (manifest.get("tied") or {}).values() for s in st}))
            data.links = sorted({(int(e["src"]), int(e["dst"])) for e in manifest.get("comm", [])})
            return


class TraceEvent(NamedTuple):
    """One measured action: seconds from the trace's start, its name (``F3``, ``SEND_F2>r1``), and
    ``activity``, the timeline row it is drawn in (``trace_activity``). A tuple, so the page gets it as an array."""

    start_s: float
    end_s: float
    name: str
    activity: str


Trace = Dict[int, List[TraceEvent]]  # rank -> its events in time order


class Window(NamedTuple):
    """Part of a trace, shifted to start at 0, and what it covers (``step 2 of 3``)."""

    trace: Trace
    note: str


def load_trace(path: str) -> Trace:
    """Chrome trace (``fxpipe train --trace``) -> every rank's events.

    Complete events (``ph: "X"``) only; ``pid`` is the rank; times start at 0.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FxpipeError(f"cannot read trace {path}: {exc}") from exc
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    xs = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    if not xs:
        raise FxpipeError(f"{path} has no complete ('ph': 'X') events; write it with `fxpipe train --trace`")
    t0 = min(float(e["ts"]) for e in xs)
    ranks: Trace = {}
    for e in xs:
        start = (float(e["ts"]) - t0) / 1e6
        end = start + float(e.get("dur", 0)) / 1e6
        name = str(e.get("name", "?"))
        ranks.setdefault(int(e.get("pid", 0)), []).append(TraceEvent(start, end, name, trace_activity(name)))
    for evs in ranks.values():
        evs.sort()
    return ranks


def trace_activity(name: str) -> str:
    """Timeline category of a trace event name (``F3``, ``B0``, ``SEND_F2>r1``, ``wait ...``)."""
    n = name.upper()
    if n.startswith(("SEND", "RECV")):
        return "comm"
    if "WAIT" in n:
        return "wait"
    if n.startswith("ALLREDUCE"):
        return "allreduce"
    if n.startswith(("STEP", "OPT")):
        return "step"
    if n[:1] in ("F", "B", "W") and n[1:2].isdigit():
        return n[0]
    return "other"


def one_step(trace: Trace, steps: int = 1) -> Optional[Window]:
    """The middle window of ``steps`` optimizer steps of a measured trace, shifted to start at 0.

    A trace holds every step of a run, the simulation one step: cropping makes
    the two comparable on one time scale. The window runs from the end of one
    ``STEP`` of the lowest rank to the end of its ``steps``-th next one (for
    1F1B and GPipe the input stage finishes each step last). ``None`` when
    the trace has too few steps.
    """
    first = min(trace) if trace else None
    ends = sorted(e.end_s for e in trace.get(first, []) if e.activity == "step")
    if len(ends) < steps + 1:
        return None
    i = max(steps, len(ends) // 2)  # window ending at ends[i] is step i + 1; the first step has no start mark
    t0, t1 = ends[i - steps], ends[i]
    out = {r: [e._replace(start_s=max(e.start_s, t0) - t0, end_s=min(e.end_s, t1) - t0)
               for e in evs if e.end_s > t0 and e.start_s < t1]
           for r, evs in trace.items()}
    return Window(out, f"steps {i - steps + 1}..{i} of {len(ends)}" if steps > 1 else f"step {i + 1} of {len(ends)}")
