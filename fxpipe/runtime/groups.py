"""Process groups for gradient all-reduce: stage replicas and tied parameters.

Two kinds of gradient sharing happen at an ``ALLREDUCE`` action:

- the replicas of a stage (data parallelism inside the stage) combine the
  gradients of every parameter that is not tied, in the stage's own group;
- a parameter tied across stages (GPT's input embedding and output
  projection) lives as one copy per stage; its copies must receive the same,
  summed gradient, over the group of every rank of every stage holding it.

Every rank takes part in creating every group (``new_group`` is collective),
in one fixed order, even the groups it is not a member of.

Scaling. In a flush or gpipe step each microbatch's loss is already divided
by the number of microbatches ``M``, so the *sum* over replicas is the
gradient of the mean loss of the step (each replica saw ``M / r`` of them).
With weight stashing each minibatch is its own step and replicas *average*
their gradients, as PipeDream's data-parallel stages do: ``scale = 1 / r``.
Each rank multiplies its gradients by ``scale`` and the groups sum, which also
gives a tied parameter ``sum over stages of (average over that stage's
replicas)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpipe.layout import Layout
from fxpipe.runtime.transport import peer_guard


@dataclass
class Groups:
    replica: Optional[object] = None  # this stage's replicas (None: one replica)
    tied: List[Tuple[Tuple[int, ...], object, List[str]]] = field(default_factory=list)


def make_groups(layout: Layout, tied: Dict[str, Sequence[int]], rank: int) -> Groups:
    """Create the replica groups and one group per set of stages sharing tied parameters."""
    me = layout.stage_of(rank)
    out = Groups()
    for j in range(layout.num_stages):
        if layout.replicas[j] > 1:
            g = dist.new_group(layout.ranks(j))
            if j == me:
                out.replica = g
    by_stages: Dict[Tuple[int, ...], List[str]] = {}
    for name in sorted(tied):
        by_stages.setdefault(tuple(sorted(set(tied[name]))), []).append(name)
    for stages, names in sorted(by_stages.items()):
        ranks = sorted(r for s in stages for r in layout.ranks(s))
        g = dist.new_group(ranks)
        if me in stages:
            out.tied.append((stages, g, names))
    return out


class GradReducer:
    """Sums (scaled) gradients over the groups this rank belongs to; one flat buffer per group."""

    def __init__(self, groups: Groups, master: Dict[str, nn.Parameter], local_of: Dict[str, str],
                 scale: float) -> None:
        """``master``: the stage's parameters by the names ``named_parameters()`` keeps; ``local_of``:
        original name -> one of those names (a tensor held under two names is reduced once; the
        caller maps every tied name to the name ``named_parameters()`` keeps)."""
        self.groups = groups
        self.master = master
        self.scale = scale
        self.tied_sets = [(g, [local_of[n] for n in names if n in local_of]) for _, g, names in groups.tied]
        tied_locals = {n for _, names in self.tied_sets for n in names}
        self.own = [n for n in master if n not in tied_locals]

    @property
    def active(self) -> bool:
        return self.groups.replica is not None or bool(self.tied_sets)

    def __call__(self) -> None:
        if self.groups.replica is not None:
            self._reduce(self.own, self.groups.replica)
        for g, names in self.tied_sets:
            self._reduce(names, g)

    def _reduce(self, names: List[str], group: object) -> None:
        params = [self.master[n] for n in names if self.master[n].requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        if self.scale != 1.0:
            flat.mul_(self.scale)
        with peer_guard("all-reduce of gradients"):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            p.grad = g
