"""Built-in pipeline schedules as data: ``{rank: [Action, ...]}``.

A schedule is decided here once, as plain lists, so the executor, the
validator and the simulator all walk the same instructions (the torchgpipe
``clock_cycles`` idea). Building happens in three steps:

1. *compute order*: for each rank, the order of its ``F m`` / ``B m`` (and
   ``W m``: 1F1B, GPipe or ZB-H1), plus where ``ALLREDUCE`` / ``STEP`` go;
2. *lowering*: every compute action gets its receives right before it and its
   sends right after it, one per link, peers chosen by ``Layout.rank_for``.
   Links may skip stages (a value from stage 0 used by stage 3 travels
   straight from the rank of stage 0 to the rank of stage 3);
3. *early receives*: a receive is only posted where it stands (the wait is
   in the ``F m`` / ``B m`` that uses it, see ``fxpipe.validate``), so each
   receive moves in front of the compute action before it: its bytes then
   arrive while that action computes instead of after it. Receives on
   ``blocking_links`` stay in place: the runtime names the links that carry
   non-tensor values on NCCL, where the transport completes them inside the
   receive action (``fxpipe.runtime.transport``).

A 1F1B rank of stage ``j`` runs ``in_flight`` forwards before its first
backward: the count the cost model charges memory for
(``passes.partition.costmodel.in_flight`` says why it is what it is). The
same order serves ``1f1b-flush`` (one step per flush), ``1f1b-stash`` (a
step after every backward, weights stashed per minibatch) and ``2bw``.

``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) splits
each backward in ``B m`` (input gradients: what the previous stage waits for)
and ``W m`` (weight gradients: nobody waits for them). It keeps 1F1B's
warm-up and B/F order and runs stage ``j``'s ``W`` a ``lag_j`` of backwards
late, ``lag_j = max_k n_k - n_j`` (``n`` from ``in_flight``; ``j`` without
replicas): the last stage returns gradients at the pace of ``F + B``
instead of ``F + B + W``, and the deferred ``W`` fill the cool-down where
1F1B waits. A microbatch's activations live from ``F m`` to ``W m``, so every
stage holds ``max_k n_k`` microbatches: the input stage's count under 1F1B,
the same peak. With equal ``F``, ``B``, ``W`` the bubble goes from
``(S-1)(F+B+W)`` to ``(S-1)(F+B-W)`` (tests/fxpipe/test_simulate.py).

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

import itertools
import math
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from fxpipe.validate import Schedule, ScheduleError, validate

from passes.partition import costmodel
from passes.partition.costmodel import DEFAULT_SCHEDULE, SCHEDULES

__all__ = ["SCHEDULES", "Schedule", "ScheduleError", "build_schedule", "in_flight", "rank_actions", "validate"]


def in_flight(layout: Layout, stage: int, schedule: str = DEFAULT_SCHEDULE, microbatches: Optional[int] = None) -> int:
    """Microbatches each rank of ``stage`` holds at once: ``costmodel.in_flight`` on ``layout``."""
    return costmodel.in_flight(stage, layout.replicas, schedule, microbatches)


def build_schedule(schedule: str, layout: Layout, microbatches: int,
                   links: Sequence[Tuple[int, int]], tied_stages: Sequence[int] = (),
                   blocking_links: Sequence[Tuple[int, int]] = (), steps: int = 1,
                   ranks: Optional[Sequence[int]] = None) -> Dict[int, List[Action]]:
    """The action list of every rank for one step of ``microbatches``.

    For ``1f1b-stash`` a "step" is a window of ``microbatches`` minibatches,
    each followed by its own weight update. ``2bw`` covers ``steps`` batches
    of ``microbatches`` (numbered ``0 .. steps * microbatches - 1``) without
    draining between them; the other schedules take ``steps=1`` only.
    ``blocking_links``: links that carry a non-tensor value, whose receives
    are not moved early. The result is a ``Schedule`` (a dict that remembers
    its layout, so ``validate`` knows the all-reduce groups). ``ranks``: build only
    these ranks' lists (a worker needs its own; ``()`` only checks the request),
    since a continuous run's lists grow with its length.
    """
    links = _check(schedule, layout, microbatches, links, tied_stages, steps)
    out = Schedule(name=schedule, layout=layout, microbatches=microbatches, links=links,
                   tied_stages=tuple(sorted(_synced(tied_stages))))
    for rank in range(layout.world_size):
        if ranks is None or rank in ranks:
            out[rank] = list(rank_actions(schedule, layout, microbatches, links, rank, tied_stages, blocking_links,
                                          steps))
    return out


def rank_actions(schedule: str, layout: Layout, microbatches: int, links: Sequence[Tuple[int, int]], rank: int,
                 tied_stages: Sequence[int] = (), blocking_links: Sequence[Tuple[int, int]] = (),
                 steps: int = 1) -> Iterator[Action]:
    """``build_schedule``'s list for ``rank``, one action at a time, without its checks (run them with
    ``build_schedule(..., ranks=())``). A ``1f1b-stash`` or ``2bw`` run streams it (``loop.py``): its
    list covers every step of the run, and only a window of it need exist at once."""
    stage, replica = layout.stage_of(rank), layout.replica_of(rank)
    reduce = layout.replicas[stage] > 1 or stage in _synced(tied_stages)
    mbs = range(replica, microbatches * steps, layout.replicas[stage])
    order = _compute_order(schedule, layout, stage, mbs, reduce, microbatches)
    return early_receives(_lower(order, stage, layout, _clean(links)), stage, layout, set(blocking_links))


def _synced(tied_stages: Sequence[int]) -> Set[int]:
    """The stages whose ranks all-reduce a tied weight together: none unless two or more hold it."""
    return set(tied_stages) if len(set(tied_stages)) > 1 else set()


def _clean(links: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Links as integer pairs, each once, sorted."""
    return sorted({(int(a), int(b)) for a, b in links})


def _compute_order(schedule: str, layout: Layout, stage: int, mbs: range, reduce: bool,
                   batch: int) -> Iterator[Action]:
    if schedule == "2bw":
        return _batch_updates(_one_f_one_b(mbs, in_flight(layout, stage, schedule)), mbs, batch, reduce)
    if schedule == "gpipe":
        order: Iterable[Action] = [Action(Kind.F, m) for m in mbs] + [Action(Kind.B, m) for m in mbs]
    elif schedule == "zb-h1":
        window = in_flight(layout, stage, "1f1b-flush")
        first = in_flight(layout, stage, "zb-h1")  # the deepest stage's window
        order = _deferred_weights(list(_one_f_one_b(mbs, window)), first - window)
    else:
        order = _one_f_one_b(mbs, in_flight(layout, stage, schedule))  # capped by the replica's microbatches
    if schedule == "1f1b-stash":  # an update after every backward: batches of one
        return _batch_updates(order, mbs, 1, reduce)
    return itertools.chain(order, [Action(Kind.ALLREDUCE)] if reduce else [], [Action(Kind.STEP)])


def _batch_updates(order: Iterable[Action], mbs: range, batch: int, reduce: bool) -> Iterator[Action]:
    """An update (``STEP`` of the batch's last microbatch here) after each batch's last backward on the rank."""
    for a in order:
        yield a
        if a.kind is Kind.B and ((a.mb + mbs.step) // batch != a.mb // batch or a.mb + mbs.step >= mbs.stop):
            if reduce:
                yield Action(Kind.ALLREDUCE)
            yield Action(Kind.STEP, a.mb)


def _one_f_one_b(mbs: range, window: int) -> Iterator[Action]:
    """Warm-up forwards, then backward-forward pairs, then the remaining backwards."""
    warm = min(window, len(mbs))
    for m in mbs[:warm]:
        yield Action(Kind.F, m)
    for i, m in enumerate(mbs):
        yield Action(Kind.B, m)
        if i + warm < len(mbs):
            yield Action(Kind.F, mbs[i + warm])


def _deferred_weights(order: List[Action], lag: int) -> List[Action]:
    """``W`` of the ``i``-th backward right after the ``(i + lag)``-th backward; the last ``lag`` at the end."""
    backs = [a.mb for a in order if a.kind is Kind.B]
    out: List[Action] = []
    done = 0
    for a in order:
        out.append(a)
        if a.kind is Kind.B:
            done += 1
            if done > lag:
                out.append(Action(Kind.W, backs[done - lag - 1]))
    return out + [Action(Kind.W, m) for m in backs[max(0, len(backs) - lag):]]


def early_receives(actions: Iterable[Action], stage: int, layout: Layout,
                   blocking: Set[Tuple[int, int]] = frozenset()) -> Iterator[Action]:
    """Each receive moved in front of the compute action (F, B, W) before it, unless its link blocks.

    Posting an ``irecv`` earlier changes no order the schedule fixes (the
    wait stays in the compute that uses the message) but lets the bytes
    arrive while the previous compute runs. Only one compute action early:
    a receive posted further ahead holds its buffer longer for nothing.
    """
    held: List[Action] = []  # from the latest compute action on, with the receives moved in front of it
    moved = 0
    for a in actions:
        if a.is_recv and held and (not blocking or _link(a, stage, layout) not in blocking):
            held.insert(moved, a)
            moved += 1
        elif a.kind in (Kind.F, Kind.B, Kind.W):
            yield from held
            held, moved = [a], 0
        elif held:
            held.append(a)
        else:
            yield a
    yield from held


def _link(a: Action, stage: int, layout: Layout) -> Tuple[int, int]:
    """The (earlier stage, later stage) link a receive on ``stage`` uses."""
    peer = layout.stage_of(a.peer)
    return (peer, stage) if a.kind is Kind.RECV_F else (stage, peer)


def _lower(order: Iterable[Action], stage: int, layout: Layout, links: List[Tuple[int, int]]) -> Iterator[Action]:
    """Receives right before, sends right after each F/B (sorted by peer stage)."""
    # each peer stage's ranks, looked up once: ``layout.rank_for`` per action was most of a long list's build
    ins = [layout.ranks(a) for a in sorted(a for a, b in links if b == stage)]
    outs = [layout.ranks(b) for b in sorted(b for a, b in links if a == stage)]
    for act in order:
        m = act.mb
        if act.kind is Kind.F:
            yield from (Action(Kind.RECV_F, m, rs[m % len(rs)]) for rs in ins)
            yield act
            yield from (Action(Kind.SEND_F, m, rs[m % len(rs)]) for rs in outs)
        elif act.kind is Kind.B:
            yield from (Action(Kind.RECV_B, m, rs[m % len(rs)]) for rs in outs)
            yield act
            yield from (Action(Kind.SEND_B, m, rs[m % len(rs)]) for rs in ins)
        else:
            yield act


def _check(schedule: str, layout: Layout, microbatches: int, links: Sequence[Tuple[int, int]],
           tied_stages: Sequence[int], steps: int = 1) -> List[Tuple[int, int]]:
    """Reject requests that cannot make a valid schedule, saying what would."""
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be at least 1, got {microbatches}")
    if steps < 1 or (steps > 1 and schedule != "2bw"):
        raise ScheduleError(f"steps={steps}: only 2bw builds several steps into one action list (1 otherwise)")
    if schedule == "2bw":
        _check_two_versions(layout, microbatches)
    S = layout.num_stages
    clean = _clean(links)
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
    if schedule == "1f1b-stash":
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
    tied = sorted(_synced(tied_stages))
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
    if tied and len({layout.replicas[j] for j in tied}) > 1:  # no count of minibatches evens these out
        raise ScheduleError(
            f"1f1b-stash: the stages sharing a tied weight ({', '.join(map(str, tied))}) have "
            f"{[layout.replicas[j] for j in tied]} replicas; their ranks all-reduce the weight after every "
            "backward, so they need equal counts: plan the split for this schedule (`fxpipe split ... "
            "--schedule 1f1b-stash` gives them equal replicas), or use --schedule 1f1b-flush (or zb-h1, 2bw)")
    for group in groups:
        if len({counts[r] for r in group}) > 1:
            raise ScheduleError(
                f"1f1b-stash: ranks {group} all-reduce after every backward but would run "
                f"{[counts[r] for r in group]} backwards with {microbatches} minibatches; "
                f"use a multiple of {need} minibatches (or replicate tied stages equally)")
