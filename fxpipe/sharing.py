"""Ranks that share CPU cores: how much each piece of work is slowed by the others.

With more ranks than cores (4 gloo ranks on a 2-core machine), a rank that
computes while ``k`` ranks compute gets ``cores / k`` of a core; a rank that
waits on a message sleeps and leaves its core to the others. The simulator
models this as processor sharing, solved by a fixed point: it replays the
schedule with every busy event stretched by ``max(1, k / cores)``, ``k`` the
average number of ranks busy during that event in the previous replay
(itself included), and repeats. A rank alone in its bubble runs at full
speed, so the shared machine loses less than ``ranks / cores``.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

ROUNDS = 8  # replays; the stretch factors settle within a few percent by then


def slowdown(events: Mapping[int, Sequence[object]], cores: int, busy: Sequence[str],
             previous: Mapping[Tuple[int, int], float]) -> Dict[Tuple[int, int], float]:
    """``(rank, n) -> factor`` for the ``n``-th busy event of each rank, from one replay's timeline.

    Damped (the mean of the new and the previous factor) so that the
    replays do not swing between two timelines.
    """
    spans: Dict[int, List[Tuple[float, float]]] = {
        r: [(e.start, e.end) for e in evs if e.activity in busy] for r, evs in events.items()}
    out: Dict[Tuple[int, int], float] = {}
    for rank, mine in spans.items():
        for n, (s, t) in enumerate(mine):
            if t <= s:
                continue
            others = sum(max(0.0, min(t, b) - max(s, a)) for r, theirs in spans.items() if r != rank
                         for a, b in theirs)
            k = 1.0 + others / (t - s)
            new = max(1.0, k / cores)
            out[(rank, n)] = (new + previous.get((rank, n), 1.0)) / 2
    return out
