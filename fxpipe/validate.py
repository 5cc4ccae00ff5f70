"""Check a schedule on a CPU before any process runs it.

Two checks, both naming the rank and the action at fault:

- *matching*: every ``SEND_F m >p`` on rank ``r`` has exactly one
  ``RECV_F m <r`` on rank ``p`` (same for ``B``), posted before the ``F m``
  (``B m``) that uses it; every ``B m`` follows its ``F m`` on the same rank;
  in a list with ``W`` actions every ``B m`` has one ``W m`` after it, and
  no ``ALLREDUCE`` or ``STEP`` comes while a ``W`` is outstanding (the
  gradients are not complete before it);
- *deadlock*: the lists are executed symbolically with the runtime's
  semantics: sends are buffered (never block), a receive is posted where it
  stands and the ``F m`` / ``B m`` that uses its message blocks until the
  send ran, ``ALLREDUCE`` is a barrier of its group (the replicas of the
  stage, plus every rank of the tied stages when the stage holds tied
  parameters). If no rank can move, the error lists where every rank is
  stuck and on whom;
- *versions* (``2bw`` only): each rank's forwards of batch ``b`` come after
  its update of batch ``b - 2`` (they run on the weights that update made,
  and at most two versions are kept) and its backwards of batch ``b`` between
  the updates of ``b - 1`` and ``b`` (the gradient they accumulate is that
  batch's).

``execution_order`` yields one legal global order of the actions; the
simulator replays it with times, so validator and simulator agree by
construction.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from passes.errors import FxpipeError


class ScheduleError(FxpipeError):
    """A schedule that cannot run: unmatched communication or a deadlock."""

    def __init__(self, message: str, rank: Optional[int] = None, action: Optional[Action] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.action = action


class Schedule(dict):
    """``{rank: [Action, ...]}`` that remembers how it was built (layout, links)."""

    def __init__(self, *args, name: str = "custom", layout: Optional[Layout] = None, microbatches: int = 0,
                 links: Sequence[Tuple[int, int]] = (), tied_stages: Sequence[int] = (), **kw) -> None:
        super().__init__(*args, **kw)
        self.name = name
        self.layout = layout
        self.microbatches = microbatches
        self.links = list(links)
        self.tied_stages = tuple(tied_stages)


def reduce_groups(layout: Layout, tied_stages: Sequence[int] = ()) -> Dict[int, Tuple[int, ...]]:
    """For each rank, the ranks its ``ALLREDUCE`` waits for (itself included)."""
    tied = sorted(set(tied_stages)) if len(set(tied_stages)) > 1 else []
    tied_ranks = tuple(r for j in tied for r in layout.ranks(j))
    groups: Dict[int, Tuple[int, ...]] = {}
    for j in range(layout.num_stages):
        for r in layout.ranks(j):
            groups[r] = tied_ranks if j in tied else tuple(layout.ranks(j))
    return groups


def validate(schedule: Mapping[int, Sequence[Action]], layout: Optional[Layout] = None,
             tied_stages: Optional[Sequence[int]] = None) -> None:
    """Raise ``ScheduleError`` if ``schedule`` cannot run to completion.

    ``layout`` / ``tied_stages`` default to what a built ``Schedule`` carries;
    without a layout every ``ALLREDUCE`` is checked as a no-op barrier.
    """
    groups = _groups_for(schedule, layout, tied_stages)
    check_matching(schedule)
    if getattr(schedule, "name", None) == "2bw":
        check_two_versions(schedule, schedule.microbatches)
    for _ in execution_order(schedule, groups):
        pass


def _groups_for(schedule, layout, tied_stages) -> Optional[Dict[int, Tuple[int, ...]]]:
    layout = layout if layout is not None else getattr(schedule, "layout", None)
    if tied_stages is None:
        tied_stages = getattr(schedule, "tied_stages", ())
    return reduce_groups(layout, tied_stages) if layout is not None else None


def _message_key(rank: int, a: Action) -> Tuple[str, int, int, int]:
    """(direction, mb, src, dst) of the message a send or receive handles."""
    d = "F" if a.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
    return (d, a.mb, rank, a.peer) if a.is_send else (d, a.mb, a.peer, rank)


def check_matching(schedule: Mapping[int, Sequence[Action]]) -> None:
    """Every message sent once and received once, before its use; F, B, W of a microbatch in order."""
    sends: Dict[tuple, int] = {}
    recvs: Dict[tuple, int] = {}
    for rank, actions in schedule.items():
        for a in actions:
            if a.is_send or a.is_recv:
                if a.peer not in schedule:
                    raise ScheduleError(f"rank {rank}: {a} names rank {a.peer}, which has no schedule", rank, a)
                book = sends if a.is_send else recvs
                key = _message_key(rank, a)
                if key in book:
                    raise ScheduleError(f"rank {rank}: {a} appears twice (a message must be sent and received once)",
                                        rank, a)
                book[key] = rank
        _check_order(rank, actions)
    for key, rank in sends.items():
        if key not in recvs:
            d, mb, src, dst = key
            raise ScheduleError(f"rank {src}: SEND_{d}{mb}>r{dst} has no matching RECV_{d}{mb}<r{src} on rank {dst}",
                                src, Action(Kind[f"SEND_{d}"], mb, dst))
    for key, rank in recvs.items():
        if key not in sends:
            d, mb, src, dst = key
            raise ScheduleError(f"rank {dst}: RECV_{d}{mb}<r{src} has no matching SEND_{d}{mb}>r{dst} on rank {src}",
                                dst, Action(Kind[f"RECV_{d}"], mb, src))


def _check_order(rank: int, actions: Sequence[Action]) -> None:
    """On one rank: F before B before W of each microbatch, receives before their use, W before updates."""
    split = any(a.kind is Kind.W for a in actions)
    received = {(a.kind, a.mb): a for a in actions if a.is_recv}
    done: Counter = Counter()  # (kind, mb) -> count
    waiting_w: set = set()
    for a in actions:
        if a.kind is Kind.B and done[(Kind.F, a.mb)] == 0:
            raise ScheduleError(f"rank {rank}: {a} comes before F{a.mb} on that rank", rank, a)
        if a.kind is Kind.W and (a.mb not in waiting_w):
            raise ScheduleError(f"rank {rank}: {a} without a B{a.mb} before it that has no W yet", rank, a)
        need = (Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B, a.mb)
        if a.kind in (Kind.F, Kind.B) and need in received and done[need] == 0:
            raise ScheduleError(f"rank {rank}: {received[need]} comes after {a}, which needs it; "
                                "a receive must be posted before the compute that uses it", rank, received[need])
        if a.kind in (Kind.ALLREDUCE, Kind.STEP) and waiting_w:
            raise ScheduleError(f"rank {rank}: {a} while the weight gradients of microbatches "
                                f"{sorted(waiting_w)} are not computed yet (their W must come first)", rank, a)
        if split and a.kind is Kind.B:
            waiting_w.add(a.mb)
        elif a.kind is Kind.W:
            waiting_w.discard(a.mb)
        done[(a.kind, a.mb)] += 1
    if waiting_w:
        raise ScheduleError(f"rank {rank}: B of microbatches {sorted(waiting_w)} has no W after it "
                            "(a list with W actions needs one per backward)", rank, None)


def check_two_versions(schedule: Mapping[int, Sequence[Action]], batch: int) -> None:
    """2bw's weight-version rule on every rank, for batches of ``batch`` microbatches."""
    for rank, actions in schedule.items():
        updates = 0  # the version the rank's weights are at: updates so far
        for a in actions:
            b = a.mb // batch
            if a.kind is Kind.STEP:
                updates += 1
            elif a.kind is Kind.F and updates < b - 1:
                raise ScheduleError(f"rank {rank}: {a} (batch {b}) runs before the update of batch {b - 2}: it "
                                    f"would need weight version {b - 1}, not made yet (a third version)", rank, a)
            elif a.kind is Kind.B and updates != b:
                raise ScheduleError(f"rank {rank}: {a} (batch {b}) runs after {updates} updates; its gradient "
                                    f"belongs between the updates of batches {b - 1} and {b}", rank, a)


@dataclass(frozen=True)
class Step:
    """One move of the symbolic execution: ranks (several for a barrier) run their next action."""

    ranks: Tuple[int, ...]
    action: Action


def execution_order(schedule: Mapping[int, Sequence[Action]],
                    groups: Optional[Mapping[int, Sequence[int]]] = None) -> Iterator[Step]:
    """Yield a legal global order of all actions, or raise on deadlock.

    An ``F m`` / ``B m`` is yielded only after the sends of every message its
    rank posted a receive for; a barrier once every member stands at an
    ``ALLREDUCE`` (the k-th of each pairs up by position).
    """
    pos = {r: 0 for r in schedule}
    sent: set = set()
    posted: Dict[Tuple[int, str, int], list] = {}  # (rank, direction, mb) -> message keys it waits for
    left = sum(len(a) for a in schedule.values())
    while left:
        moved = False
        for rank in sorted(schedule):
            for step in _advance(rank, schedule, pos, sent, posted, groups):
                moved = True
                left -= len(step.ranks)
                yield step
        if not moved:
            raise _deadlock(schedule, pos, groups, sent, posted)


def _needs(rank: int, a: Action, posted, sent) -> list:
    """The messages the compute ``a`` still waits for (none for other actions)."""
    if a.kind not in (Kind.F, Kind.B):
        return []
    return [k for k in posted.get((rank, a.kind.value, a.mb), ()) if k not in sent]


def _advance(rank, schedule, pos, sent, posted, groups) -> Iterator[Step]:
    actions = schedule[rank]
    while pos[rank] < len(actions):
        a = actions[pos[rank]]
        if _needs(rank, a, posted, sent):
            return
        if a.kind is Kind.ALLREDUCE and groups is not None:
            members = tuple(groups.get(rank, (rank,)))
            if not all(_at_allreduce(m, schedule, pos) for m in members):
                return
            for m in members:
                pos[m] += 1
            yield Step(members, a)
            continue
        if a.is_send:
            sent.add(_message_key(rank, a))
        elif a.is_recv:
            key = _message_key(rank, a)
            posted.setdefault((rank, key[0], a.mb), []).append(key)
        pos[rank] += 1
        yield Step((rank,), a)


def _at_allreduce(rank, schedule, pos) -> bool:
    actions = schedule.get(rank, ())
    return pos.get(rank, 0) < len(actions) and actions[pos[rank]].kind is Kind.ALLREDUCE


def _deadlock(schedule, pos, groups, sent, posted) -> ScheduleError:
    lines = []
    first: Optional[Tuple[int, Action]] = None
    for rank in sorted(schedule):
        if pos[rank] >= len(schedule[rank]):
            lines.append(f"  rank {rank}: finished")
            continue
        a = schedule[rank][pos[rank]]
        first = first or (rank, a)
        lines.append(f"  rank {rank}: blocked at action #{pos[rank]} {a}{_waiting_on(rank, a, schedule, pos, groups, sent, posted)}")
    return ScheduleError("deadlock: no rank can move\n" + "\n".join(lines),
                         first[0] if first else None, first[1] if first else None)


def _waiting_on(rank, a, schedule, pos, groups, sent, posted) -> str:
    missing = _needs(rank, a, posted, sent)
    if missing:
        return "".join(f" (waits for SEND_{d}{mb}>r{dst} on rank {src})" for d, mb, src, dst in missing)
    if a.kind is Kind.ALLREDUCE and groups is not None:
        missing = [m for m in groups.get(rank, (rank,)) if not _at_allreduce(m, schedule, pos)]
        return f" (barrier waits for ranks {missing})"
    return ""
