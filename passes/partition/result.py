"""What a search answers: kept apart from the CP-SAT model so that planning
paths that never reach CP-SAT (the segment DP) do not import OR-Tools, which
costs most of a second of start-up (it loads pandas)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from passes.errors import FxpipeError
from passes.partition.costmodel import CostOptions, StagePlan

OPTIMAL_GAP = 1e-3  # the segment DP calls a plan optimal within 0.1 % of its proven bound, as CP-SAT's scaling does


@dataclass
class SolveResult:
    status: str
    stage_of: Optional[List[int]]  # per unit
    replicas: Optional[List[int]]
    objective: float  # seconds (scaled model), or bytes when minimising memory
    bound: float  # proven lower bound, same unit, rounding margin removed
    wall_s: float
    progress: List[tuple] = field(default_factory=list)  # (wall_s, objective) per improving solution
    plans: List[tuple] = field(default_factory=list)  # (objective, stage_of, replicas) per improving solution, where kept


class InfeasibleError(FxpipeError):
    """No plan satisfies the request; the message says what would fit."""


@dataclass
class PartitionResult:
    assignment: Dict[str, int]
    replicas: List[int]
    stages: List[StagePlan]
    bottleneck_s: float
    options: CostOptions
    status: str  # OPTIMAL, FEASIBLE (time limit), HEURISTIC (no solver answer); BOUND only inside the driver
    # (``segment_plan.chain_plan`` under a known plan: a bound, no plan of its own)
    objective_s: float
    bound_s: float
    wall_s: float
    units: int  # what the solver saw after coarsening
    heuristic_s: Optional[float] = None  # the warm start's bottleneck
    trace: List[tuple] = field(default_factory=list)
    method: str = "CP-SAT"  # or "segment DP" (segments.py, chain.py) or "downset DP" (downsets.py)
    hierarchical: Optional[Dict[str, object]] = None  # PipeDream's level-by-level answer (pipedream model, G set)
    memory_stop_mb: Optional[float] = None  # the searches stopped at the planning memory budget, at this RSS
    # under --memory without --fewer-devices: (devices, bottleneck s) of a faster plan the walk found on fewer
    # devices within the same limit (``driver._fewer_hint``), for the user to weigh; None where none is faster
    fewer: Optional[Tuple[int, float]] = None

    @property
    def gap(self) -> float:
        return max(0.0, (self.bottleneck_s - self.bound_s) / self.bottleneck_s) if self.bottleneck_s > 0 else 0.0

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    def solver_stats(self) -> Dict[str, object]:
        return {"status": self.status, "objective_s": self.bottleneck_s, "bound_s": self.bound_s,
                "gap": self.gap, "wall_s": self.wall_s, "units": self.units, "heuristic_s": self.heuristic_s,
                "method": self.method, **({"pipedream_hierarchical": self.hierarchical} if self.hierarchical else {}),
                **({"memory_stop_mb": self.memory_stop_mb} if self.memory_stop_mb is not None else {}),
                **({"fewer_devices": {"devices": self.fewer[0], "bottleneck_s": self.fewer[1]}}
                   if self.fewer is not None else {})}
