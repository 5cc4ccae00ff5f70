"""Plans read back from the memory bound's DP (``memory_bound.MemorySuffixDP``) where a pass finds T feasible.

The bound's pass keeps, per downset (point) of the segment DP's lattice, the
fewest and the most devices the stages after it can have within T and the
limit. Those intervals are nearly exact: one stage (j, i) with ``d`` devices
for itself and the stages after it needs ``r >= ceil(d / n_max)`` replicas to
fit its microbatches (1F1B-stash holds ``ceil(d / r)``), and the counts it
reaches from an interval of ``d`` form one interval again. So a walk from the
first stage, with exactly K devices left, can pick each next stage from the
intervals (the 96-block GPT on 256 devices under 256 MiB: straight through
near the lowest T that holds; a few hundred states undone 10 % above it).

What the pass relaxes, the walk checks exactly: under 1F1B-flush and 2BW a
stage holds ``1 + ceil(W / r)`` microbatches, ``W`` the window product of the
stage after it (``costmodel.in_flight``), which can exceed the devices behind
it: the walk carries the most ``W`` the stages so far allow the rest,
``W_j = r (1 + ceil(W_i / r)) <= c`` giving ``W_i <= r (floor(c / r) - 1)``,
and a state that failed with a cap fails with every smaller one.

Two uses:

- a plan: scored on the graph (``evaluate``: tied weights, folded nodes,
  links) and kept only where it fits the limit and, under 1F1B-stash with
  tied weights, where the stages sharing one have equal replicas
  (``stash_ties.runnable``); where the walk's plan does not fit, a second
  walk counts every tied weight a stage's units use and every node's
  activations;
- a bound: the first walk checks only what every plan of the graph meets
  (the pass's relaxation, with a tied weight counted where a unit's first
  node uses it, ``sure_users``), so a walk through every choice without a
  plan proves T as a failed pass does (``Read.none``). On random small
  graphs it proved the midpoint between the pass's lowest T and the best
  plan on 37 of 57 where the pass was more than 1 % loose (the tests).

The walk has a budget (``STEPS``, and the caller's deadline); past it, no
plan and no proof. ZB-H1 (every stage holds the deepest window) is not read.
Flat machines only: a two-level machine's bound pass runs under its faster
links and does not place ranks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import numpy as np

from passes.costgraph import CostGraph
from passes.partition import stash_ties
from passes.partition.coarsen import Units, to_nodes
from passes.partition.costmodel import CostOptions, Evaluation, evaluate, stage_time_s
from passes.partition.memory_guard import past
from passes.partition.offsets import EPS
from passes.partition.order_memory import microbatches_fit
from passes.partition.segments import Segment

if TYPE_CHECKING:  # the DP imports this module
    from passes.partition.memory_bound import MemorySuffixDP

SCHEDULES = ("1f1b-flush", "1f1b-stash", "2bw", "gpipe")  # the windows the walk knows exactly
WINDOWED = ("1f1b-flush", "2bw")  # a stage's window grows with the window product of the stage after it
FIRST_TRIES = 4  # with ``fewer_devices``, device counts tried for the whole plan (the fewest first)
STEPS = 20_000  # states the walk may open before it gives up (each reads every later point once, then its
# options are cheap: 1,300-1,400 states a second on the deep GPTs)


class Reader:
    """The walk from the first stage over one feasible pass's intervals (``MemorySuffixDP.suf`` / ``most``)."""

    def __init__(self, dp: "MemorySuffixDP", T: float, deadline: float, tied: bool = False,
                 sure: Optional[np.ndarray] = None, acts: Optional[np.ndarray] = None) -> None:
        """``tied``, ``acts``: a stage's tied weights count in its memory wherever a user of one lies in it,
        and the activations per point are ``acts`` (every node's: plans that fit). Else the pass's own
        (each unit's first node's), with the tied weights that ``sure`` (per point and tied weight, the
        users inside it that every plan runs in that unit's stage: ``sure_users``) says, and a walk gone
        through to the end without a plan proves T infeasible (``exhausted``), as a pass that fails does."""
        self.dp, self.T, self.deadline, self.tied, self.sure = dp, T, deadline, tied, sure
        self.acts = dp.acts if acts is None else acts
        self.exhausted = False  # ``plan`` tried every choice the pass allows and found none
        self.K, self.G = dp.K, int(dp.offsets[-1])
        self.suf, self.most = dp.suf, dp.most  # the pass's answer
        self.in_start, self.in_end, order = _once(dp, "inside", lambda: _inside_by_start(dp))
        near = dp.solver.inside_replicas(T)
        self.in_r = np.concatenate([np.asarray(near[a], dtype=float) for a in range(len(dp.segs))])[order]
        self.windowed = dp.opts.schedule in WINDOWED
        self.rises = dp.opts.cost_model != "fxpipe"  # counts meeting T are not one run (``_options``)
        # units in each point's downset
        self.size = _once(dp, "size", lambda: dp.per_point(np.ones(len(dp.solver.units))))
        self.failed: Dict[Tuple[int, int], float] = {}  # (point, devices) -> the largest W cap that failed
        self._cache: Dict[int, tuple] = {}  # ``_candidates``

    def plan(self) -> Optional[Tuple[List[int], List[int]]]:
        """(points ending each stage, replicas) of a plan on exactly K devices (on the fewest the intervals
        allow, from there up, with ``fewer_devices``), or None where the walk finds none."""
        dp = self.dp
        if dp.opts.schedule not in SCHEDULES or self.suf[0] > self.K:
            return None
        first = list(range(int(self.suf[0]), min(self.K, int(self.most[0])) + 1)) if dp.opts.fewer_devices \
            else [self.K]
        complete = len(first) <= FIRST_TRIES
        for d in first[:FIRST_TRIES]:
            path, through = self._walk(d)
            if path is not None:
                return [e for e, _ in path], [r for _, r in path]
            complete &= through
        self.exhausted = complete
        return None

    def _walk(self, devices: int) -> Tuple[Optional[List[Tuple[int, int]]], bool]:
        """(the path, whether the walk went through every choice): depth first from point 0 with ``devices``
        left; the states that fail are remembered, with the largest cap they failed under (one that fails
        under a cap fails under every smaller one)."""
        path: List[Tuple[int, int]] = []
        stack = [(0, devices, math.inf, self._options(0, devices, math.inf))]
        steps = 0
        while stack:
            j, d, c, options = stack[-1]
            nxt = next(options, None)
            if nxt is None:
                self.failed[(j, d)] = max(self.failed.get((j, d), -1.0), c)
                stack.pop()
                if path:
                    path.pop()
                continue
            e, r, c2 = nxt
            path.append((e, r))
            if e == self.G - 1:
                return path, True
            if c2 <= self.failed.get((e, d - r), -1.0):
                path.pop()
                continue
            steps += 1
            if steps > STEPS or (steps % 64 == 0 and past(self.deadline)):
                return None, False
            stack.append((e, d - r, c2, self._options(e, d - r, c2)))
        return None, True

    def _candidates(self, j: int) -> tuple:
        """Every stage from point j that one microbatch fits and some suffix after it allows, with what
        ``_options`` reads of it whatever the devices: (ends, the fewest replicas meeting T, microbatches
        that fit, the floors with nothing behind and under the cap of M microbatches, the most replicas
        meeting T), the furthest end first. Worked out once per point: the walk may come back to it."""
        known = self._cache.get(j)
        if known is not None:
            return known
        dp, G, T = self.dp, self.G, self.T
        a = int(dp.solver.point_seg[j])
        lo, hi = np.searchsorted(self.in_start, j, side="left"), np.searchsorted(self.in_start, j, side="right")
        later = np.arange(int(dp.offsets[a + 1]), G)
        later = later[(self.suf[later] <= self.K) & (self.most[later] >= 0)]
        later = later[microbatches_fit(self._weights(j, later), self.acts[later] - self.acts[j], dp.opts) >= 1]
        ends = np.concatenate([self.in_end[lo:hi], later]).astype(np.int64)
        r_t = np.empty(ends.size)
        r_t[:hi - lo] = self.in_r[lo:hi]
        if later.size:
            r_t[hi - lo:] = np.broadcast_to(dp.solver.fewest_replicas(
                dp.start[j], dp.params[j], dp.shared[j][None, :], dp.cut[j], dp.end[later], dp.params[later],
                dp.shared[later], dp.cut[later], T), later.shape)
        last = ends == G - 1
        keep = (r_t <= self.K) & (self.suf[ends] <= self.K) & (self.most[ends] >= 0) & (last == (self.suf[ends] == 0)) \
            & (self.size[ends] > self.size[j])  # a segment's whole is the next one's empty point: no empty stage
        ends, r_t = ends[keep], r_t[keep]
        order = np.argsort(-dp.end[ends], kind="stable")
        ends, r_t = ends[order], r_t[order]
        nmax = microbatches_fit(self._weights(j, ends), self.acts[ends] - self.acts[j], dp.opts)
        _, _, first, capped, most_r, _ = dp.stage_terms(np.full(ends.size, j), ends, r_t, T, nmax)
        known = (ends, r_t, nmax, first, capped, most_r)
        self._cache[j] = known
        return known

    def _options(self, j: int, d: int, c: float) -> Iterator[Tuple[int, int, float]]:
        """The next stages from point j with d devices for it and those after it, and the cap ``c`` on its
        window product (flush, 2BW): (end, replicas, the cap on the rest's), the furthest end first, then
        the fewest replicas."""
        ends, r_t, nmax, first, capped, most_r = self._candidates(j)
        last = ends == self.G - 1
        with np.errstate(divide="ignore", invalid="ignore"):
            # r devices of d fit (d - r behind): r >= ceil(d / nmax) (stash exactly; flush at least), or the cap
            own = np.where(nmax >= 2, np.ceil(d / np.maximum(nmax, 1)), np.inf) if self.dp.opts.schedule != "gpipe" \
                else np.full(ends.size, np.inf)
        mem = np.where(last, first, np.minimum(own, capped))
        low = np.maximum.reduce([r_t, mem, d - self.most[ends].astype(float), np.ones(ends.size)])
        high = np.minimum(most_r, d - self.suf[ends])  # the last stage: d - most = d - suf = d, so r = d
        high = np.where(last | (self.suf[ends] >= 1), high, -1)  # (no point but the last has nothing after it)
        allowed, dp = self.dp.allowed, self.dp
        for k in np.flatnonzero(low <= high):
            e = int(ends[k])
            for r in allowed[np.searchsorted(allowed, low[k]):np.searchsorted(allowed, high[k], side="right")]:
                if self.rises and stage_time_s(dp.end[e] - dp.start[j], dp.params[e] - dp.params[j], dp.cut[j],
                                               dp.cut[e], float(r), dp.opts) > self.T * (1 + EPS):
                    continue  # PipeDream's time rises with r and falls again: the pass took every count up to K
                c2 = self._rest_cap(int(r), d, c, float(nmax[k]), float(capped[k]), bool(last[k]))
                if c2 is not None:
                    yield e, int(r), c2

    def _weights(self, j: int, ends: np.ndarray) -> np.ndarray:
        """Weight bytes of stages (j, end): their own, and each tied weight they hold a user of (with
        ``tied``; else where that user is a unit's first node, ``sure``), whole on every device."""
        dp = self.dp
        own = dp.params[ends] - dp.params[j]
        n = dp.solver.shared_bytes.size
        if not n:
            return own
        users = dp.shared[:, :n] if self.tied else self.sure
        if users is None:
            return own
        held = (users[ends] - users[j]) > 0.5
        return own + held @ dp.solver.shared_bytes

    def _rest_cap(self, r: int, d: int, c: float, nmax: float, capped: float, last: bool) -> Optional[float]:
        """The cap on the window product of the stages after a stage of r replicas, d devices from it on,
        under a cap ``c`` on its own; None where no suffix can meet it (it has at least d - r)."""
        if not self.windowed:
            return math.inf
        if last:
            return math.inf if r <= c else None
        mine = math.inf if r >= capped else (nmax - 1) * r  # its own microbatches: 1 + ceil(W / r) <= nmax
        before = math.inf if math.isinf(c) else r * (c // r - 1)  # the stage before it: W_j <= c
        rest = min(mine, before)
        return rest if rest >= d - r else None


def reads(opts: CostOptions) -> bool:
    """Whether ``read_plan`` reads plans under ``opts`` (a flat machine, a schedule whose windows it knows)."""
    return opts.memory is not None and opts.gpus_per_node is None and opts.schedule in SCHEDULES


class Read(NamedTuple):
    """What ``read_plan`` found at one T."""

    plan: Optional[Tuple[Dict[str, int], List[int], Evaluation]]  # (assignment, replicas, evaluation), or None
    none: bool  # the walk went through every choice the pass allows and found no plan: T is a lower bound


def read_plan(dp: "MemorySuffixDP", T: float, graph: CostGraph, units: Units, opts: CostOptions,
              deadline: float) -> Read:
    """A plan the pass just run at T allows, scored under ``opts`` (None where the walk finds none, or
    its plan does not fit the limit or cannot run), and whether the walk proved that none exists.

    The walk runs on the pass's own relaxation first (a stage's tied weights counted only where a unit's
    first node uses one, ``sure_users``), so that going through every choice proves T: a plan of the
    graph within T and the limit is a path through the lattice that meets all it checks. Where its plan
    then does not fit the limit as ``evaluate`` counts it, a second walk counts every unit using a tied
    weight and every node's activations (a plan, no proof)."""
    if not reads(opts):
        return Read(None, False)
    reader = Reader(dp, T, deadline, sure=sure_users(dp, graph, units))
    found = reader.plan()
    if found is None:
        return Read(None, reader.exhausted)
    scored = _scored(dp, graph, units, opts, *found)
    if scored is None:
        acts = _once(dp, "acts", lambda: dp.per_point(units.act_bytes))  # every node's
        found = Reader(dp, T, deadline, tied=True, acts=acts).plan()
        scored = None if found is None else _scored(dp, graph, units, opts, *found)
    return Read(scored, False)


def sure_users(dp: "MemorySuffixDP", graph: CostGraph, units: Units) -> Optional[np.ndarray]:
    """Per point of ``dp``'s lattice and tied weight, how many units inside it have a first node that uses
    the weight (a plan runs a unit's first node in the unit's stage; a node folded into it may run
    elsewhere, which is why the pass leaves tied weights out); None without tied weights. Kept on ``dp``."""
    if not units.shared:
        return None
    return _once(dp, "sure", lambda: dp.per_point(np.array(
        [[w in graph.nodes[names[0]].params for w in units.shared] for names in units.members], dtype=float)))


def _once(dp: "MemorySuffixDP", key: str, build: Callable[[], object]):
    """``build()``, worked out once per lattice (``MemorySuffixDP.read_facts``): the reads after every
    pass share it."""
    if key not in dp.read_facts:
        dp.read_facts[key] = build()
    return dp.read_facts[key]


def _inside_by_start(dp: "MemorySuffixDP") -> tuple:
    """(starts, ends, the order that sorts them by start) of every stage inside one segment, as global
    points; the order also sorts ``inside_replicas``' counts, concatenated segment by segment."""
    starts = np.concatenate([dp.offsets[a] + s.sub_j for a, s in enumerate(dp.segs)])
    order = np.argsort(starts, kind="stable")
    ends = np.concatenate([dp.offsets[a] + s.sub_i for a, s in enumerate(dp.segs)])
    return starts[order], ends[order], order


def _scored(dp: "MemorySuffixDP", graph: CostGraph, units: Units, opts: CostOptions, chain: List[int],
            replicas: List[int]) -> Optional[Tuple[Dict[str, int], List[int], Evaluation]]:
    """The walk's plan on the graph, scored under ``opts``; None where it does not fit the limit, or (under
    1F1B-stash) stages sharing a tied weight have unequal replicas."""
    stage_of = dp.solver.stages_of([0] + chain)
    assignment = to_nodes(graph, units, stage_of)
    ev = evaluate(graph, assignment, replicas, opts)
    if ev.peak_memory_bytes > opts.memory:
        return None
    if opts.schedule == stash_ties.SCHEDULE and not stash_ties.runnable(graph, assignment, replicas):
        return None
    return assignment, replicas, ev


def chain_restricted(segs: List[Segment]) -> List[Segment]:
    """Each segment's points cut down to one chain from its empty point to its whole, as few units more at
    each step as a kept point allows (of those, the one sending the fewest bytes), with
    every pair of them a stage. Its plans are plans of the lattice; a T it cannot meet proves nothing.
    On the 96-block GPT: 2,886 points and 21,000 stages inside segments against 11,527 and 301,000."""
    out = []
    for seg in segs:
        rank = seg.member.sum(axis=1)
        at, full = int(np.argmin(rank)), int(np.argmax(rank))
        chain = [at]
        while at != full:  # the full point holds every other: the chain always reaches it
            above = np.flatnonzero(seg.member[:, seg.member[at]].all(axis=1) & (rank > rank[at]))
            nxt = above[rank[above] == rank[above].min()]  # a unit more where such a point is kept
            at = int(nxt[np.argmin(seg.cut[nxt])])
            chain.append(at)
        pts = np.array(chain)
        sub_j, sub_i = np.triu_indices(len(pts), 1)
        out.append(dataclasses.replace(
            seg, member=seg.member[pts], compute=seg.compute[pts], params=seg.params[pts], cut=seg.cut[pts],
            shared=seg.shared[pts], hidden=seg.hidden[pts], sub_j=sub_j, sub_i=sub_i, start=seg.start[pts],
            plain=None if seg.plain is None else seg.plain[pts]))
    return out
