"""Put the pieces together: load, simulate the plan's schedule, render."""
from __future__ import annotations

from typing import Optional, Tuple

from fxpipe.layout import Layout
from fxpipe.simulate import SimResult, simulate_plan
from fxpipe.validate import ScheduleError
from fxpipe.show.data import ShowInput


def simulate_input(data: ShowInput, kind: Optional[str] = None,
                   microbatches: Optional[int] = None) -> Tuple[Optional[SimResult], Layout]:
    """Simulate the schedule the plan asks for (or ``kind``); a refusal becomes a note, not a crash."""
    layout = Layout.of([s.replicas for s in data.plan.stages])
    try:
        sim, _ = simulate_plan(data.plan, kind=kind, microbatches=microbatches, graph=data.graph,
                               tied_stages=data.tied_stages, links=data.links)
    except ScheduleError as exc:
        data.notes.append(f"schedule not simulated: {exc}")
        return None, layout
    if data.graph is None:
        data.notes.append("simulated with each stage's send_bytes going to the next stage only "
                          "(no profile: links and activation memory unknown)")
    return sim, layout
