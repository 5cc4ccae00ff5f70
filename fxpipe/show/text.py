"""Terminal view: the stage table and an ASCII timeline of the simulated schedule.

One character is a fixed slice of time. A forward fills its slice with ``.``
and starts with ``F<m>``, a backward with ``:`` and ``B<m>`` (the label is
cut when the slot is short); ``~`` is waiting for a message, ``A`` an
all-reduce, ``|`` an optimizer step, blank is idle.
"""
from __future__ import annotations

from typing import Any, List

from tabulate import tabulate

from fxpipe.show.html import batches_word, fmt_bytes, fmt_s, stage_rows

FILL = {"F": ".", "B": ":", "W": "=", "wait": "~", "allreduce": "A", "step": "|", "send_blocking": ">"}


def stage_table(plan: Any) -> str:
    rows = stage_rows(plan)
    cols = [c for c in rows[0] if c != "bottleneck"] if rows else []
    body = [[("*" if r["bottleneck"] else "") + str(r[c]) if c == "stage" else r[c] for c in cols] for r in rows]
    table = tabulate(body, headers=cols, tablefmt="simple", stralign="right")
    return table + "\n* bottleneck stage"


def ascii_timeline(sim: Any, layout: Any, width: int = 100) -> str:
    """One line per rank over the simulated step."""
    T = sim.step_s or 1.0
    dt = T / width
    span = "step" if sim.steps == 1 else f"{sim.steps} steps"
    lines = [f"{sim.schedule}: {sim.microbatches} {batches_word(sim.schedule)}, {span} {fmt_s(sim.step_s)}, "
             f"{sim.samples_per_s:.4g} samples/s, bubble {100 * sim.bubble_fraction:.1f} %"]
    for rank in sorted(sim.events):
        row = [" "] * width
        for e in sim.events[rank]:
            activity = e.action.kind.value if e.activity == "compute" else e.activity
            if activity not in FILL or e.end <= e.start:
                continue
            a, b = int(e.start / dt + 1e-9), max(int(e.start / dt + 1e-9) + 1, int(round(e.end / dt)))
            b = min(b, width)
            for c in range(a, b):
                row[c] = FILL[activity]
            if activity in ("F", "B", "W"):
                label = str(e.action)[: max(0, b - a)]
                row[a:a + len(label)] = list(label)
        mem = fmt_bytes(sim.peak_memory.get(rank, 0))
        lines.append(f"r{rank:<3} s{layout.stage_of(rank):<2} |{''.join(row)}| peak {mem}")
    lines.append(f"{'':8} 0{'':{width - 2}}{fmt_s(T)}")
    lines.append("legend: F<m>.... forward  B<m>:::: backward  W<m>==== weight gradients  ~ wait  A all-reduce  | step  (blank: idle)")
    return "\n".join(lines)


def render_text(plan: Any, sim: Any, layout: Any, notes: List[str], width: int = 100) -> str:
    parts: List[str] = [stage_table(plan), ""]
    if sim is not None:
        parts.append(ascii_timeline(sim, layout, width))
    parts += [f"note: {n}" for n in notes]
    return "\n".join(parts)

