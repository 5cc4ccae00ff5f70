"""What a search answers: kept apart from the CP-SAT model so that planning
paths that never reach CP-SAT (the segment DP) do not import OR-Tools, which
costs most of a second of start-up (it loads pandas)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class SolveResult:
    status: str
    stage_of: Optional[List[int]]  # per unit
    replicas: Optional[List[int]]
    objective: float  # seconds (scaled model), or bytes when minimising memory
    bound: float  # proven lower bound, same unit, rounding margin removed
    wall_s: float
    progress: List[tuple] = field(default_factory=list)  # (wall_s, objective) per improving solution
