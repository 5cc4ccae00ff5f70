"""Where each stage replica lives: ranks are assigned stage by stage.

Stage ``j`` with ``r_j`` replicas owns the ``r_j`` consecutive ranks after
those of stages ``0..j-1``. Minibatch ``m`` runs on replica ``m % r_j`` of
stage ``j`` (round-robin, as PipeDream does), and its backward returns to the
same replica because the same rule picks it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple


@dataclass(frozen=True)
class Layout:
    replicas: Tuple[int, ...]

    @classmethod
    def of(cls, replicas: Sequence[int]) -> "Layout":
        if not replicas or any(int(r) < 1 for r in replicas):
            raise ValueError(f"every stage needs at least one replica, got {list(replicas)}")
        return cls(tuple(int(r) for r in replicas))

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def world_size(self) -> int:
        return sum(self.replicas)

    def ranks(self, stage: int) -> List[int]:
        start = sum(self.replicas[:stage])
        return list(range(start, start + self.replicas[stage]))

    def stage_of(self, rank: int) -> int:
        for j in range(self.num_stages):
            if rank in self.ranks(j):
                return j
        raise ValueError(f"rank {rank} is outside the layout {self.replicas} ({self.world_size} ranks)")

    def replica_of(self, rank: int) -> int:
        return self.ranks(self.stage_of(rank)).index(rank)

    def rank_for(self, stage: int, mb: int) -> int:
        """The rank of ``stage`` that runs minibatch ``mb``."""
        return self.ranks(stage)[mb % self.replicas[stage]]
