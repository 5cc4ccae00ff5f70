"""Gradient clipping by the norm of the whole model's gradient, across stages.

``torch.nn.utils.clip_grad_norm_(params, X)`` computes the 2-norm ``N`` of
all gradients together and multiplies each by ``min(1, X / (N + 1e-6))``.
Here each rank holds one stage, so the sum of squares is computed per stage
and summed with an all-reduce before every rank scales its own gradients by
the same factor. It runs at ``STEP``, after ``ALLREDUCE``: replicas then hold
the same (combined) gradient and every copy of a tied weight holds the full
gradient of that one parameter of the original model.

Counting each parameter of the original model once:

- replicas: only replica 0 of a stage adds its sum of squares; the others
  add 0 (but still take part in the all-reduce and scale their gradients).
  A unit of one stage needs no all-reduce at all: its replicas compute the
  same norm from the same gradient;
- tied weights: a parameter held by several stages is counted by the lowest
  of them; a tensor one stage holds under two names is one ``named_parameters``
  entry, counted once.

Which stages share one norm (the *clip unit*) depends on the schedule:

- ``1f1b-flush`` / ``gpipe``: every stage; one all-reduce over all ranks per
  step (none with one stage). The result equals ``clip_grad_norm_`` on the
  unsplit model's accumulated gradient.
- ``1f1b-stash``: stages update at different times (stage ``j`` updates for
  minibatch ``g`` while later stages are already past it), so a global norm
  per minibatch would make every stage wait for the slowest at every update
  and empty the pipeline; and a replicated stage updates once per ``r``
  minibatches, so its all-reduces would not even pair with the other stages'
  (tried on stages ``1-2-1``: it hung until the peer timeout). Each update is instead clipped by the norm of the
  gradient it applies, over the stage's own parameters (after the replicas'
  average): a per-stage clip. Stages that share tied weights already update
  together (their ``ALLREDUCE`` joins them every minibatch); they form one
  unit, with one norm over all their parameters (the tied weight once), so
  the copies of a tied weight are scaled alike and stay equal.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.layout import Layout
from fxpipe.runtime.transport import peer_guard

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def unit_stages(layout: Layout, tied: Dict[str, Sequence[int]], stashing: bool) -> Dict[int, List[int]]:
    """Each stage's clip unit: the stages whose gradients share one norm with it."""
    everyone = list(range(layout.num_stages))
    if not stashing:
        return {j: everyone for j in everyone}
    tied_stages = sorted({s for st in tied.values() for s in st})
    if len(tied_stages) < 2:
        tied_stages = []
    return {j: tied_stages if j in tied_stages else [j] for j in everyone}


def unit_groups(layout: Layout, units: Dict[int, List[int]], rank: int) -> Optional[Any]:
    """Create the all-reduce group of every clip unit of several stages; returns this rank's.

    A unit of one stage needs none: its replicas hold the same gradient, so
    each computes the same norm alone. Collective: every rank calls it with
    the same ``units``, in the same order.
    """
    mine = None
    for unit in sorted({tuple(u) for u in units.values()}):
        if len(unit) > 1:
            ranks = sorted(r for s in unit for r in layout.ranks(s))
            g = dist.new_group(ranks)
            if layout.stage_of(rank) in unit:
                mine = g
    return mine


class GradClipper:
    """Clips this rank's gradients by its clip unit's norm; ``__call__`` returns that norm."""

    def __init__(self, max_norm: float, master: Dict[str, nn.Parameter], counted: Sequence[str],
                 group: Optional[Any], device: torch.device) -> None:
        """``master``: the stage's parameters; ``counted``: the names whose squares this rank adds;
        ``group``: the unit's all-reduce group (None: the unit is this rank alone)."""
        self.max_norm = max_norm
        self.params = list(master.values())
        self.counted = [master[n] for n in counted]
        self.group, self.device = group, device

    def __call__(self) -> torch.Tensor:
        """Clip; returns the norm before clipping, a 0-d float64 tensor on the stage's device.

        No ``.item()``: on a GPU the factor stays on the device and no update
        waits for the host (the norm is read when a step line is printed).
        """
        grads = [p.grad for p in self.counted if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if grads:  # one foreach call per precision: half-precision gradients are summed in float32
            low = [g for g in grads if g.element_size() < 4]
            high = [g for g in grads if g.element_size() >= 4]
            norms = list(torch._foreach_norm(high)) if high else []
            norms += list(torch._foreach_norm(low, 2, dtype=torch.float32)) if low else []
            sq = torch.stack([n.double() for n in norms]).pow(2).sum()
        if self.group is not None:
            with peer_guard("all-reduce of the gradient norm"):
                dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.group)
        norm = sq.sqrt()
        coef = torch.clamp(self.max_norm / (norm + EPS), max=1.0)  # NaN stays NaN, as in clip_grad_norm_
        with torch.no_grad():
            scaled = [p.grad for p in self.params if p.grad is not None]
            if scaled:
                torch._foreach_mul_(scaled, coef)
        return norm


def make_clipper(max_norm: float, layout: Layout, rank: int, master: Dict[str, nn.Parameter],
                 names: Dict[str, str], tied: Dict[str, Sequence[int]], stashing: bool,
                 device: torch.device) -> GradClipper:
    """This rank's clipper; creates the unit groups (collective: every rank calls it).

    ``names``: the stage's local parameter names -> the original model's.
    """
    units = unit_stages(layout, tied, stashing)
    group = unit_groups(layout, units, rank)
    stage = layout.stage_of(rank)
    if group is not None and layout.replica_of(rank) != 0:
        counted: List[str] = []  # replica 0 counts the stage's share
    else:
        def first_holder(orig: str) -> int:
            holders = sorted(set(tied.get(orig, ()))) or [stage]
            return holders[0]
        counted = [n for n in master if first_holder(names.get(n, n)) == stage]
    return GradClipper(max_norm, master, counted, group, device)
