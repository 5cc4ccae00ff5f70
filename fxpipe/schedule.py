"""Built-in pipeline schedules as data: ``{rank: [Action, ...]}``.

A schedule is decided here once, as plain lists, so the executor, the
validator and the simulator all walk the same instructions (the torchgpipe
``clock_cycles`` idea). Building happens in two steps:

1. *compute order*: for each rank, the order of its ``F m`` / ``B m``
   (1F1B or GPipe), plus where ``ALLREDUCE`` / ``STEP`` go;
2. *lowering*: every compute action gets its receives right before it and its
   sends right after it, one per link, peers chosen by ``Layout.rank_for``.
   Links may skip stages (a value from stage 0 used by stage 3 travels
   straight from the rank of stage 0 to the rank of stage 3).

A 1F1B rank of stage ``j`` runs ``in_flight`` forwards before its first
backward: the count the cost model charges memory for
(``passes.partition.costmodel.in_flight`` says why it is what it is). The
same order serves ``1f1b-flush`` (one step per flush), ``1f1b-stash`` (a
step after every backward, weights stashed per minibatch) and ``2bw``.

``2bw`` is PipeDream-2BW (Narayanan et al., ICML 2021): 1F1B without a flush
over ``steps`` batches of ``microbatches`` each, gradients accumulated over a
batch and one update right after the batch's last backward on the rank. The
forwards of batch ``b`` run on weight version ``b - 1`` (the weights after
``b - 1`` updates; version 0 for batch 0), so the update that follows batch
``b`` applies a gradient computed on ``W(b - 1)`` to ``W(b)``:
``W(b + 1) = W(b) - lr * grad f(W(b - 1))``. Each rank then holds at most two
versions; ``validate`` checks that the order allows it (batch ``b``'s first
forward after the update of batch ``b - 2``).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from fxpipe.validate import Schedule, ScheduleError, validate

from passes.partition import costmodel
from passes.partition.costmodel import DEFAULT_SCHEDULE, SCHEDULES

__all__ = ["SCHEDULES", "Schedule", "ScheduleError", "build_schedule", "in_flight", "validate"]


def in_flight(layout: Layout, stage: int, kind: str = DEFAULT_SCHEDULE, microbatches: Optional[int] = None) -> int:
    """Microbatches each rank of ``stage`` holds at once: ``costmodel.in_flight`` on ``layout``."""
    return costmodel.in_flight(stage, layout.replicas, kind, microbatches)


def build_schedule(kind: str, layout: Layout, microbatches: int,
                   links: Sequence[Tuple[int, int]], tied_stages: Sequence[int] = (),
                   steps: int = 1) -> Dict[int, List[Action]]:
    """The action list of every rank for one step of ``microbatches``.

    For ``1f1b-stash`` a "step" is a window of ``microbatches`` minibatches,
    each followed by its own weight update. ``2bw`` covers ``steps`` batches
    of ``microbatches`` (numbered ``0 .. steps * microbatches - 1``) without
    draining between them; the other kinds take ``steps=1`` only. The result
    is a ``Schedule`` (a dict that remembers its layout, so ``validate``
    knows the all-reduce groups).
    """
    links = _check(kind, layout, microbatches, links, tied_stages, steps)
    tied = set(tied_stages) if len(set(tied_stages)) > 1 else set()
    out = Schedule(kind=kind, layout=layout, microbatches=microbatches, links=links, tied_stages=tuple(sorted(tied)))
    for stage in range(layout.num_stages):
        reduce = layout.replicas[stage] > 1 or stage in tied
        for replica, rank in enumerate(layout.ranks(stage)):
            mbs = list(range(replica, microbatches * steps, layout.replicas[stage]))
            order = _compute_order(kind, layout, stage, mbs, reduce, microbatches)
            out[rank] = _lower(order, stage, layout, links)
    return out


def _compute_order(kind: str, layout: Layout, stage: int, mbs: List[int], reduce: bool,
                   batch: int) -> List[Action]:
    if kind == "2bw":
        return _batch_updates(_one_f_one_b(mbs, in_flight(layout, stage, kind)), mbs, batch, reduce)
    if kind == "gpipe":
        order = [Action(Kind.F, m) for m in mbs] + [Action(Kind.B, m) for m in mbs]
    else:
        order = _one_f_one_b(mbs, in_flight(layout, stage, kind))  # capped by the replica's microbatches
    if kind == "1f1b-stash":
        stepped: List[Action] = []
        for a in order:
            stepped.append(a)
            if a.kind is Kind.B:
                stepped += [Action(Kind.ALLREDUCE)] if reduce else []
                stepped.append(Action(Kind.STEP, a.mb))
        return stepped
    return order + ([Action(Kind.ALLREDUCE)] if reduce else []) + [Action(Kind.STEP)]


def _batch_updates(order: List[Action], mbs: List[int], batch: int, reduce: bool) -> List[Action]:
    """An update (``STEP`` of the batch's last microbatch here) after each batch's last backward on the rank."""
    last = {m // batch: m for m in mbs}
    out: List[Action] = []
    for a in order:
        out.append(a)
        if a.kind is Kind.B and last[a.mb // batch] == a.mb:
            out += ([Action(Kind.ALLREDUCE)] if reduce else []) + [Action(Kind.STEP, a.mb)]
    return out


def _one_f_one_b(mbs: List[int], window: int) -> List[Action]:
    """Warm-up forwards, then backward-forward pairs, then the remaining backwards."""
    warm = min(window, len(mbs))
    order = [Action(Kind.F, m) for m in mbs[:warm]]
    for i, m in enumerate(mbs):
        order.append(Action(Kind.B, m))
        if i + warm < len(mbs):
            order.append(Action(Kind.F, mbs[i + warm]))
    return order


def _lower(order: List[Action], stage: int, layout: Layout, links: List[Tuple[int, int]]) -> List[Action]:
    """Receives right before, sends right after each F/B (sorted by peer stage)."""
    ins = sorted(a for a, b in links if b == stage)
    outs = sorted(b for a, b in links if a == stage)
    actions: List[Action] = []
    for act in order:
        m = act.mb
        if act.kind is Kind.F:
            actions += [Action(Kind.RECV_F, m, layout.rank_for(a, m)) for a in ins]
            actions.append(act)
            actions += [Action(Kind.SEND_F, m, layout.rank_for(b, m)) for b in outs]
        elif act.kind is Kind.B:
            actions += [Action(Kind.RECV_B, m, layout.rank_for(b, m)) for b in outs]
            actions.append(act)
            actions += [Action(Kind.SEND_B, m, layout.rank_for(a, m)) for a in ins]
        else:
            actions.append(act)
    return actions


def _check(kind: str, layout: Layout, microbatches: int, links: Sequence[Tuple[int, int]],
           tied_stages: Sequence[int], steps: int = 1) -> List[Tuple[int, int]]:
    """Reject requests that cannot make a valid schedule, saying what would."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be at least 1, got {microbatches}")
    if steps < 1 or (steps > 1 and kind != "2bw"):
        raise ScheduleError(f"steps={steps}: only 2bw builds several steps into one action list (1 otherwise)")
    if kind == "2bw":
        _check_two_versions(layout, microbatches)
    S = layout.num_stages
    clean = sorted({(int(a), int(b)) for a, b in links})
    for a, b in clean:
        if not (0 <= a < b < S):
            raise ScheduleError(f"link ({a}, {b}) is not a forward link between stages 0..{S - 1}; "
                                "links go from an earlier stage to a later one")
    for s in tied_stages:
        if not 0 <= s < S:
            raise ScheduleError(f"tied stage {s} is outside stages 0..{S - 1}")
    for j, r in enumerate(layout.replicas):
        if r > microbatches:
            raise ScheduleError(f"stage {j} has {r} replicas but the step has only {microbatches} microbatches; "
                                f"use --microbatches >= {r} so every replica gets work")
    if kind == "1f1b-stash":
        _check_stash_groups(layout, microbatches, tied_stages)
    return clean


def _check_two_versions(layout: Layout, microbatches: int) -> None:
    """2bw's batch ``b`` starts after the update of ``b - 2`` only if a batch outlasts the warm-up.

    A rank of stage ``j`` runs ``F(x)`` right after ``B(x - n_j)`` (its own
    microbatches, ``n_j`` in flight) and updates after its batch's last
    backward, so it needs ``n_j <= microbatches / r_j + 1``.
    """
    for j, r in enumerate(layout.replicas):
        n = in_flight(layout, j, "2bw")
        if n > microbatches // r + 1:
            need = (n - 1) * r
            raise ScheduleError(f"2bw: stage {j} keeps {n} microbatches in flight, more than a batch of "
                                f"{microbatches} gives each of its {r} replica(s) plus one, so it would need a "
                                f"third weight version; use --microbatches >= {need}")


def _check_stash_groups(layout: Layout, microbatches: int, tied_stages: Sequence[int]) -> None:
    """Under stash every backward all-reduces, so group members need equal counts."""
    tied = sorted(set(tied_stages)) if len(set(tied_stages)) > 1 else []
    need = 1
    for r in layout.replicas:
        need = need * r // math.gcd(need, r)
    counts = {}
    for j in range(layout.num_stages):
        if layout.replicas[j] > 1 or j in tied:
            for rank in layout.ranks(j):
                counts[rank] = len(range(layout.replica_of(rank), microbatches, layout.replicas[j]))
    groups = [[r for j in tied for r in layout.ranks(j)]] if tied else []
    groups += [layout.ranks(j) for j in range(layout.num_stages) if layout.replicas[j] > 1 and j not in tied]
    for group in groups:
        if len({counts[r] for r in group}) > 1:
            raise ScheduleError(
                f"1f1b-stash: ranks {group} all-reduce after every backward but would run "
                f"{[counts[r] for r in group]} backwards with {microbatches} minibatches; "
                f"use a multiple of {need} minibatches (or replicate tied stages equally)")
