"""Compute a relaxation freed that a stage must still run itself (``Units.hidden`` entries that name units
they run after), for the flat segment DP (``chain.ChainSolver._late``).

A relaxation that frees a node (``branches.forced_compute``: inception_v3's ReLUs, ``branchy.relaxed``)
still counts its compute in every prefix of stages that holds a unit it feeds, and a stage runs what
the stages before it have no room for. That room is any earlier stage's: so a stage full of ReLUs could
push their compute into the slack of a stage far before it. A freed node runs no earlier than the
first nodes of the units it descends from (``Units.hidden``'s last field) and no later than those of
the units it feeds: where a stage from point j to point i holds one of the latter (i forces it in,
j does not) and one of the former is not in j, the node runs in that stage, whatever room the
prefix has. ``Pins`` sums that compute per pair of points; ``ChainSolver`` takes the larger of it
and what does not fit in the prefix's room. On inception_v3 at 1.25 GB/s the bound rose 53.7 ->
55.7 ms (PipeDream's charges, 16 devices; the plan, 56.8 ms, is optimal) and 28.0 -> 29.1 ms (32).
A 24-layer Llama's bound did not move: its freed attention nodes straddle a stage boundary inside
the block in the relaxed plans, where the room of the prefix still takes them.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from passes.partition.coarsen import Units
from passes.partition.segments import Segment


class Pins:
    """Per pair of points, the compute of the ``Units.hidden`` entries the stage between them must run."""

    def __init__(self, units: Units, segments: List[Segment], offsets: np.ndarray) -> None:
        self.segs, self.offsets = segments, offsets
        pinned = [(s, forcing, after) for s, forcing, _, after in units.hidden if after and forcing]
        self.compute = np.array([s for s, _, _ in pinned])
        # per point (global ids, rows): whether it forces each entry in (holds one of its forcing units)
        # and whether it holds every unit the entry runs after
        self.forced = np.zeros((int(offsets[-1]), len(pinned)), dtype=bool)
        self.settled = np.zeros_like(self.forced)
        first = np.array([min(forcing) for _, forcing, _ in pinned], dtype=np.int64)  # the earliest forcing unit
        last = np.array([max(after) for _, _, after in pinned], dtype=np.int64)  # the latest unit to run after
        for a, seg in enumerate(segments):  # only the entries whose units meet the segment are worked out
            lo, hi = seg.units[0], seg.units[-1]
            pos = {u: k for k, u in enumerate(seg.units)}
            rows = slice(offsets[a], offsets[a + 1])
            self.forced[rows, first < lo] = True  # a unit before the segment is in every point
            self.settled[rows, last < lo] = True
            for e in np.nonzero((first >= lo) & (first <= hi))[0]:
                self.forced[rows, e] = _holds(seg, pos, pinned[e][1]).any(axis=0)
            for e in np.nonzero((last >= lo) & (last <= hi))[0]:
                self.settled[rows, e] = _holds(seg, pos, pinned[e][2]).all(axis=0)
        self._inside: Dict[int, Optional[np.ndarray]] = {}

    def __bool__(self) -> bool:
        return bool(self.compute.size)

    def pool(self, gid: np.ndarray, a: int) -> Optional[np.ndarray]:
        """(starts, points of segment ``a``): the compute each stage from a point ``gid`` to a point of
        segment ``a`` runs itself, or None where there is none."""
        rows = slice(self.offsets[a], self.offsets[a + 1])
        settled = self.settled[gid]
        cols = np.nonzero(self.forced[self.offsets[a + 1] - 1] & ~settled.all(axis=0))[0]  # the last point forces most
        if not cols.size:
            return None
        return (~settled[:, cols]).astype(float) @ (self.forced[rows, cols] * self.compute[cols]).T

    def inside(self, a: int) -> Optional[np.ndarray]:
        """``pool`` for the pairs (``Segment.sub_j``, ``sub_i``) of segment ``a`` (the same at every T)."""
        if a not in self._inside:
            seg = self.segs[a]
            full = self.pool(np.arange(self.offsets[a], self.offsets[a + 1]), a) if seg.sub_j.size else None
            self._inside[a] = None if full is None else full[seg.sub_j, seg.sub_i]
        return self._inside[a]


def _holds(seg: Segment, pos: Dict[int, int], units: List[int]) -> np.ndarray:
    """(units, points of ``seg``): whether each point holds each of ``units`` (those before the segment
    are in every point, those after it in none)."""
    lo, hi = seg.units[0], seg.units[-1]
    return np.array([seg.member[:, pos[u]] if lo <= u <= hi else np.full(len(seg.compute), u < lo)
                     for u in units], dtype=bool).reshape(len(units), len(seg.compute))
