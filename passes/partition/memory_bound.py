"""A lower bound on the bottleneck under ``--memory``: the segment DP's lattice walked from the end.

Without a limit, the segment DP (``chain.py``) keeps per downset the fewest
devices its stages need at T. Under a limit that is not enough: a stage's
memory grows with the devices behind it (``costmodel.in_flight``: under
1F1B-stash a rank of stage j holds ``1 + ceil(behind / r_j)`` microbatches,
``behind`` the devices of every later stage; under 1F1B-flush, 2BW and ZB-H1
at least that many, since ``W_{j+1} = r_{j+1} n_{j+1} >= behind`` by
induction from the last stage; under GPipe ``ceil(M / r_j)``). So this DP
runs from the end: per downset, the fewest devices its complement's stages
can have within T, each stage given at least the replicas that meet T (the
segment DP's own counts, ``ChainSolver.fewest_replicas``) and the fewest
whose microbatches fit beside its weights with that many devices behind it
(``order_memory.Floors``); fewer devices behind never ask more of a stage.
And, since a plan uses exactly K devices, the most it can have: each stage at
most the largest count that meets T, behind it at most the devices its
memory can feed (``n`` microbatches fitting: ``d <= (n - 1) r``). A plan
within T and the limit has, suffix by suffix, a device count between the
two, so a T where K lies outside them for the whole graph is a proven lower
bound. The bottleneck is searched between the bound without the limit and
the best plan found, first down a ladder from the plan.

What the relaxation leaves out, so that it holds for every plan of the
graph: tied weights' bytes (only a unit's own weights count), the
activations of nodes folded into a unit (a plan may run them elsewhere: only
each unit's first node's output counts, the node whose stage is the unit's),
nodes left out of the units, the compute of folded nodes that send nothing,
and which counts inside a suffix's interval are reachable. The compute of the
other folded nodes is ``segments.fold_margin``'s, subtracted as the segment
DP does.

Each pass that holds is followed by a walk from the first stage over its
device counts (``memory_plan``), which both reads a plan back and, where it
goes through every choice without one, proves T as a failed pass does.

An end is dropped for good once a stage from the current segment's whole
cannot feed the devices behind it (``_alive``), or a smaller point with no
more devices behind and no larger cut replaces it (``_next_pool``).
The tests check it against every plan of 30 random small chains and DAGs
(and its tightness on 60 chains); its passes take 0.5-2 s on a 96-block GPT
(64-1,024 devices).
"""
from __future__ import annotations

import math
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from passes.costgraph import CostGraph
from passes.partition import wide_segments
from passes.partition.chain import ChainSolver, DeadlineExceeded
from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions, flat_bound, planned_microbatches
from passes.partition.memory_guard import past
from passes.partition.memory_plan import chain_restricted, read_plan, reads
from passes.partition.order_memory import Floors, microbatches_fit
from passes.partition.result import OPTIMAL_GAP, PartitionResult
from passes.partition.segment_plan import QUIET, floors, tiny_input
from passes.partition.segments import Segment, build_segments, fold_margin, folded_units

SCHEDULES = ("1f1b-flush", "1f1b-stash", "2bw", "zb-h1", "gpipe")
PROVE_WITHIN = 0.01  # the first pass sits this far under the plan: infeasible there proves it within 1 %
TOLERANCE = 2e-3  # the bisection stops with the bound and the lowest feasible T this close (relative)
MAX_PAIRS = 1_000_000  # stages inside segments a pass may read: past it, the nodes that send nothing fold whatever
# they cost (the 32-block GPT on 1,024 devices: 10.5 million pairs, 95 s a pass, at the segment DP's folding)
PAIRS = 1 << 16  # stages from a segment's points to the pool's ends worked out at once (a few dozen arrays of
# this many: at 1,024 devices the whole pool at once took the planning past its 600-MB budget)
LADDER = 3.0  # until a pass fails, each steps this many times further under the plan than the one before
READ_LEAST = 0.75  # seconds a read after a pass may take at least (``_read_by``), and
READ_SHARE = 2.0  # ... this many times the pass's own time where that is more (the 96-block GPT on 256 devices
# under 256 MiB: reads of 0.4-0.6 s after passes of 0.3 s found the plans of 12.6 ms)
CHAIN_SHARE = 0.6  # of the time, for plans on the chain-restricted lattice first
CHAIN_TOLERANCE = 1e-2  # ... whose search stops with its plan this close (relative) over the lowest T that failed
# (the whole lattice proves a plan within 1 % of its lowest T at best: a closer chain plan gains little)


class MemorySuffixDP:
    """Per T, the fewest devices of every downset's complement within T and the memory limit."""

    def __init__(self, units: Units, segs: List[Segment], opts: CostOptions, acts: np.ndarray) -> None:
        """``acts``: per unit, the activation bytes a stage holding it surely keeps per microbatch."""
        self.segs, self.opts = segs, opts
        self.solver = ChainSolver(units, segs, opts)  # the counts that meet T
        self.K = opts.devices
        self.offsets = self.solver.offsets
        self.end = np.concatenate([self.solver.end_of(s) for s in segs])
        self.start = np.concatenate([self.solver.start_of(s) for s in segs])
        self.params = np.concatenate([s.params for s in segs])
        self.cut = np.concatenate([s.cut for s in segs])
        self.shared = np.concatenate([s.shared for s in segs])
        self.acts = self.per_point(acts)
        self.allowed = np.asarray(opts.allowed_replicas(), dtype=np.int64)
        self.tied = bool(units.shared)
        self.read_facts: dict = {}  # what ``memory_plan`` works out once per lattice (whatever T)
        self._inside: dict = {}

    def per_point(self, per_unit: np.ndarray) -> np.ndarray:
        """A per-unit quantity (a row per unit where 2-D) summed over every point's downset (the prefix
        before its segment included)."""
        per_unit = np.asarray(per_unit, dtype=float)
        return np.concatenate([per_unit[:s.units[0]].sum(axis=0) + s.member @ per_unit[s.units[0]:s.units[-1] + 1]
                               for s in self.segs])

    def stage_terms(self, gj: np.ndarray, gi: np.ndarray, r_t: np.ndarray, T: float,
                    nmax: Optional[np.ndarray] = None) -> tuple:
        """What a pass reads of stages (gj, gi) (global points, flat arrays) besides the suffixes after
        them: the fewest allowed count meeting T (``r_t``), the memory floor's terms (``Floors``), the
        most replicas that meet T (``_most_replicas``) and the most devices that count lets behind the
        stage. ``nmax``: the microbatches that fit (``order_memory.microbatches_fit``), where known.

        With n microbatches fitting beside the stage's weights, a device holds ``1 + ceil(d / r) <= n``
        for ``d`` devices behind, so ``d <= (n - 1) r`` (1F1B-flush, ZB-H1: ``W >= d`` in place of
        ``d``); where ``ceil(M / r)`` caps the window within n, or under GPipe, d is free."""
        params = self.params[gi] - self.params[gj]
        if nmax is None:
            nmax = microbatches_fit(params, self.acts[gi] - self.acts[gj], self.opts)
        floors = Floors.of(nmax, self.opts)
        hi = self._most_replicas(self.end[gi] - self.start[gj], params, T)
        M = planned_microbatches(self.opts)
        with np.errstate(invalid="ignore"):
            cap = np.where(nmax >= 1, (nmax - 1) * hi, -1.0)
            if self.opts.schedule == "gpipe":
                cap = np.where(nmax >= 1, np.inf, -1.0)
            elif M is not None:
                cap = np.where((nmax >= 1) & (np.ceil(M / np.maximum(hi, 1)) <= nmax), np.inf, cap)
        return (np.asarray(r_t, dtype=float), *floors, hi, cap)

    def _through(self, terms: tuple, suf: np.ndarray, most: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The fewest and the most devices a suffix can have through each stage of ``terms`` given the
        fewest (``suf``) and the most (``most``) of the suffix after it; K + 1 and -1 where none.

        Its replicas lie between the larger of the fewest meeting T and the memory floor with the fewest
        devices behind, and the most meeting T; the devices behind, between the suffix's fewest and the
        most the memory lets behind that many replicas."""
        K = self.K
        r_t, per, last, capped, hi, cap = terms
        behind = np.minimum(suf, K).astype(float)
        need = np.maximum(Floors(per, last, capped).least(np.arange(per.size), behind), r_t)
        at = np.searchsorted(self.allowed, need)  # the fewest allowed count from there (inf: none)
        lo = np.where(at < self.allowed.size, self.allowed[np.minimum(at, self.allowed.size - 1)], K + 1)
        ok = (lo <= hi) & (suf + lo <= K) & (cap >= suf)  # else no plan on K devices runs this stage
        fewest = np.where(ok, suf + lo, K + 1)
        most_ = np.where(ok, np.minimum(hi + np.minimum(most, np.minimum(cap, K)), K), -1)
        return fewest, most_.astype(np.int64)

    def _most_replicas(self, compute: np.ndarray, params: np.ndarray, T: float) -> np.ndarray:
        """Per stage, the largest allowed replica count whose time meets T, or a larger count (0: none).

        Under fxpipe's model the work term ``C/r + a(r-1)/r`` (``a = 2P/B``) meets T for every r from
        its least on where ``T >= a``, else up to ``(a - C) / (a - T)``; the link term only falls with r,
        and a tied weight's sync, left out, only adds. Under PipeDream's the work term rises and then falls
        towards 0 as r grows: the largest allowed count, a relaxation."""
        top = self.allowed[-1]
        if self.opts.cost_model != "fxpipe":
            return np.full(len(compute), top, dtype=np.int64)
        a = 2.0 * params / self.opts.ar_bandwidth
        with np.errstate(divide="ignore", invalid="ignore"):
            most = np.where(T >= a, np.inf, (a - compute) / (a - T) * (1 + 1e-9))
        at = np.searchsorted(self.allowed, np.minimum(most, top), side="right") - 1
        return np.where(at >= 0, self.allowed[np.maximum(at, 0)], 0)

    def _inside_pairs(self, a: int) -> tuple:
        """Segment ``a``'s pairs ordered by the rank of their start, highest first (a pass from the end
        reads a start's ends, which hold more units, once they are final), with each rank's slice and
        the microbatches that fit each stage (the same every pass)."""
        known = self._inside.get(a)
        if known is None:
            seg, off = self.segs[a], int(self.offsets[a])
            rank = seg.member.sum(axis=1)[seg.sub_j]
            order = np.argsort(-rank, kind="stable")
            ranks = rank[order]
            cuts = np.flatnonzero(np.diff(ranks)) + 1
            bounds = np.concatenate([[0], cuts, [ranks.size]])
            gj, gi = off + seg.sub_j[order], off + seg.sub_i[order]
            nmax = microbatches_fit(self.params[gi] - self.params[gj], self.acts[gi] - self.acts[gj], self.opts)
            known = (order, gj, gi, list(zip(bounds[:-1], bounds[1:])), nmax)
            self._inside[a] = known
        return known

    def feasible(self, T: float, deadline: float = math.inf) -> bool:
        """Whether some plan may meet T within the limit on K devices (False: none does, T is a bound)."""
        K, solver = self.K, self.solver
        solver.deadline = deadline
        near = solver.inside_replicas(T)
        G = int(self.offsets[-1])
        suf = np.full(G, K + 1, dtype=np.int64)
        most = np.full(G, -1, dtype=np.int64)
        suf[G - 1] = most[G - 1] = 0  # the whole graph: nothing after it
        self.suf, self.most = suf, most  # the pass's answer per point (``memory_plan.Reader``; new arrays each pass)
        pool = np.zeros(0, dtype=np.int64)  # later points that may end a stage
        for a in range(len(self.segs) - 1, -1, -1):
            if past(deadline):
                raise DeadlineExceeded()
            seg, off = self.segs[a], int(self.offsets[a])
            d = len(seg.compute)
            js = np.arange(off, off + d)
            dev, top = suf[js].copy(), most[js].copy()
            if pool.size:
                pool = self._alive(pool, off + int(np.argmax(seg.member.sum(axis=1))), suf)
            step = max(1, PAIRS // d)  # pool ends at a time: a pass's temporaries stay bounded
            for k in range(0, pool.size, step):
                ends = pool[k:k + step]
                R = solver.fewest_replicas(self.start[js][:, None], self.params[js][:, None],
                                           self.shared[js][:, None, :], self.cut[js][:, None], self.end[ends][None, :],
                                           self.params[ends][None, :], self.shared[ends][None, :, :],
                                           self.cut[ends][None, :], T)
                shape = (d, ends.size)
                gj, gi = np.repeat(js, ends.size), np.tile(ends, d)
                f, m = self._through(self.stage_terms(gj, gi, np.broadcast_to(R, shape).ravel(), T), suf[gi], most[gi])
                dev = np.minimum(dev, f.reshape(shape).min(axis=1))
                top = np.maximum(top, m.reshape(shape).max(axis=1))
            if seg.sub_j.size:
                order, gj, gi, levels, nmax = self._inside_pairs(a)
                terms = self.stage_terms(gj, gi, np.asarray(near[a])[order], T, nmax)
                for lo, hi in levels:  # ends hold more units than starts: final by the time a start is read
                    ends, starts = gi[lo:hi] - off, gj[lo:hi] - off
                    f, m = self._through(tuple(x[lo:hi] for x in terms), dev[ends], top[ends])
                    np.minimum.at(dev, starts, f)
                    np.maximum.at(top, starts, m)
            before = np.ceil(self.end[js] / T * (1 - 1e-12))  # the compute before a point needs this many
            dead = (dev + before > K) | (top < dev)
            dev[dead], top[dead] = K + 1, -1
            suf[js], most[js] = dev, top
            pool = self._next_pool(pool, js, suf, most)
            if not pool.size:
                return False  # no later point can end a stage from any earlier one
        return bool(suf[0] <= K and (self.opts.fewer_devices or most[0] >= K))

    def _alive(self, pool: np.ndarray, full: int, suf: np.ndarray) -> np.ndarray:
        """The ends of ``pool`` that a stage from point ``full`` (the segment's whole, the smallest stage
        to them from it or any earlier start) can reach: its weights and one microbatch fit, and the
        replicas its memory needs with the fewest devices behind fit in the devices left. A stage from
        an earlier start holds more, so an end dropped here is dropped for good."""
        floors = Floors.of(microbatches_fit(self.params[pool] - self.params[full], self.acts[pool] - self.acts[full],
                                            self.opts), self.opts)
        behind = suf[pool].astype(float)
        need = floors.least(np.arange(pool.size), behind)
        return pool[need <= self.K - behind]

    def _next_pool(self, pool: np.ndarray, js: np.ndarray, suf: np.ndarray, most: np.ndarray) -> np.ndarray:
        """The pool with segment ``js``'s reachable points added; an older point dropped where a new one
        (a subset of it) has no more devices after it at the least, no fewer at the most, and sends no
        more: as an end it is no worse for every start before it (less compute, weights and activations
        in the stage, so no fewer counts meet T and the limit). With tied weights only by a point that
        holds the same users of each (else a smaller stage may share a weight the larger one holds whole)."""
        new = js[suf[js] <= self.K]
        if pool.size and new.size:
            beats = ((suf[new][None, :] <= suf[pool][:, None]) & (most[new][None, :] >= most[pool][:, None])
                     & (self.cut[new][None, :] <= self.cut[pool][:, None]))
            if self.tied:  # only by a point holding the same users of every shared weight
                beats &= (self.shared[new][None, :, :] == self.shared[pool][:, None, :]).all(axis=-1)
            pool = pool[~beats.any(axis=1)]
        return np.concatenate([new, pool])


def head_acts(graph: CostGraph, units: Units) -> np.ndarray:
    """Per unit, its first node's output bytes (0 for a model input): the unit's stage is that node's,
    while a node folded into it may run in another stage of a plan."""
    out = np.zeros(len(units), dtype=float)
    for u, members in enumerate(units.members):
        node = graph.nodes[members[0]]
        out[u] = 0.0 if node.is_input else float(node.out_bytes)
    return out


def lattice(graph: CostGraph, opts: CostOptions,
            deadline: float) -> Optional[Tuple[Units, List[Segment], float, np.ndarray]]:
    """(units, segments, fold margin, per-unit activations) of ``graph`` for the DP, folded as the segment
    DP folds (``segment_plan.segment_dp``); None where a segment's lattice is too wide. Not the wide
    segments' relaxation (``wide_segments.relaxed``): the nodes it frees take their compute and
    activations out of every stage, and on the 96-layer HF Llama the bound then stayed under the one
    without the limit."""
    if past(deadline):
        return None
    ideal = graph.total_compute_s() / opts.devices
    for silent in (QUIET * ideal, math.inf):  # then every node that sends nothing folded, its compute dropped
        units, folded = folded_units(graph, opts, tiny=1e-5 * ideal, tiny_silent=silent,
                                     tiny_input=tiny_input(opts, ideal))
        units.hidden = []  # compute a relaxation took off the units: dropped (the bound only weakens)
        segs = build_segments(units, limit=wide_segments.LIMIT, deadline=deadline)  # stops at a wide one
        if segs is None:
            return None
        if sum(s.sub_j.size for s in segs) <= MAX_PAIRS:
            return units, segs, fold_margin(units, folded), head_acts(graph, units)
    return None


class Descent:
    """The T a search tries next: down a ladder from the plan (``PROVE_WITHIN``, then ``LADDER`` times
    further each time) until a pass fails, then bisection between the highest failed T and the lowest
    that held; a plan read back lowers the ceiling, and the ladder starts again under it."""

    def __init__(self, lo: float, ceiling: float, margin: float, step: float = PROVE_WITHIN) -> None:
        self.lo, self.hi, self.margin, self.first = lo, ceiling + margin, margin, step
        self.ceiling, self.step, self.failed = ceiling, step, False

    def next(self) -> float:
        if self.failed:
            return math.sqrt(self.lo * self.hi)
        return max(self.ceiling / (1 + self.step) + self.margin, math.sqrt(self.lo * self.hi))

    def fail(self, T: float) -> None:
        self.lo, self.failed = T, True

    def hold(self, T: float, plan_s: Optional[float], restart: bool = False) -> None:
        """T held; ``plan_s``: a plan read back there (seconds), or None; ``restart``: the ladder starts
        again under a faster plan (a proof is tried 1 % under it), else it goes on growing."""
        faster = plan_s is not None and plan_s < self.ceiling
        if faster:
            self.ceiling = plan_s
        self.hi = min(T, self.ceiling + self.margin)
        self.step = self.first if faster and restart else self.step * LADDER

    def done(self, T: float, tolerance: float = TOLERANCE) -> bool:
        return self.hi <= self.lo * (1 + tolerance) or not self.lo < T < self.hi


def memory_bound(graph: CostGraph, opts: CostOptions, floor: float, ceiling: float, deadline: float,
                 progress: Optional[Callable[[str], None]] = None, real: Optional[CostOptions] = None,
                 built: Optional[tuple] = None) -> tuple:
    """(bound, plan): a proven lower bound on the bottleneck of every plan of ``graph`` within
    ``opts.memory`` (see the module docstring), searched between ``floor`` (proven already) and
    ``ceiling`` (a plan's time), None where it proves nothing above ``floor`` (no lattice, another
    schedule, or no pass in time); and the fastest plan faster than ``ceiling`` read back from the
    feasible passes (``memory_plan.read_plan``, scored under ``real``, the caller's options: (assignment,
    replicas, evaluation)), None where none is. ``built``: ``lattice``'s answer for ``opts`` where the caller has it.

    First the same DP on one chain of points per segment (``memory_plan.chain_restricted``: a
    restriction, passes a third as long, whose failures prove nothing) looks for faster plans with
    ``CHAIN_SHARE`` of the time; then the whole lattice, from 1 % under the fastest plan: where that
    pass fails the plan is proven."""
    real = opts if real is None else real
    opts = flat_bound(opts, fast=True)  # a two-level machine: every link at the faster bandwidth, a relaxation
    if opts.memory is None or opts.schedule not in SCHEDULES or ceiling <= floor:
        return None, None
    if opts.schedule == "gpipe" and planned_microbatches(opts) is None:
        return None, None
    built = lattice(graph, opts, deadline) if built is None else built
    if built is None:
        return None, None
    units, segs, margin, acts = built
    dp = MemorySuffixDP(units, segs, opts, acts)
    began = time.monotonic()
    said = _said(progress, began, margin)
    search = Descent(floor + margin, ceiling, margin)  # on the units: their bound less the margin bounds the graph
    best = None
    if reads(real):  # faster plans first, from the chain's quicker passes
        chain = MemorySuffixDP(units, chain_restricted(segs), opts, acts)
        best = _chain_plans(chain, search, graph, units, real, began + CHAIN_SHARE * (deadline - began), said)
    proven, reading = None, True
    T = search.next()
    while not search.done(T):
        began_pass = time.monotonic()
        try:
            infeasible = not dp.feasible(T, deadline)
        except DeadlineExceeded:
            break
        got = None if infeasible or not reading else read_plan(dp, T, graph, units, real,
                                                               _read_by(began_pass, deadline))
        reading = got is None or got.plan is not None or got.none  # once a read ends with neither, the passes
        # get the time (1F1B-flush on many devices: the reads run to their budget, and again at the next T)
        read = None if got is None else got.plan
        faster = read is not None and read[2].bottleneck_s < search.ceiling
        best = read if faster else best
        if got is not None and got.none:  # the reads went through every path the pass left: none meets T
            infeasible = True
        said("", T, infeasible, read if faster else None, got is not None and got.none)
        if infeasible:
            search.fail(T)
            proven = T
        else:
            search.hold(T, None if read is None else read[2].bottleneck_s, restart=True)  # 1 % under a new plan
        T = search.next()
    return (None if proven is None else proven - margin), best


def _chain_plans(dp: MemorySuffixDP, outer: Descent, graph: CostGraph, units: Units, real: CostOptions,
                 until: float, said) -> Optional[tuple]:
    """The fastest plan read back from the chain-restricted ``dp`` under ``outer``'s ceiling (its own
    descent from there, down to ``outer``'s proven floor), which it lowers; None where none is faster."""
    search = Descent(outer.lo, outer.ceiling, outer.margin, PROVE_WITHIN * LADDER)  # 1 %: the lattice's to try
    best = None
    T = search.next()
    while not search.done(T, CHAIN_TOLERANCE) and not past(until):
        began_pass = time.monotonic()
        try:
            held = dp.feasible(T, until)
        except DeadlineExceeded:
            break
        got = read_plan(dp, T, graph, units, real, _read_by(began_pass, until)) if held else None
        read = None if got is None else got.plan
        said("on a chain of points ", T, read is None, read, got is not None and got.none)
        if got is not None and read is None and not got.none:
            break  # the reads ran out of their time: at the next T they would again (1F1B-flush on many devices)
        if read is None:
            search.fail(T)  # no plan on the chain: the whole lattice may still hold one
        else:
            search.hold(T, read[2].bottleneck_s)
            if read[2].bottleneck_s < outer.ceiling:
                best = read
                outer.hold(outer.hi, read[2].bottleneck_s, restart=True)
        T = search.next()
    return best


def _read_by(began_pass: float, deadline: float) -> float:
    """When the reads after a pass begun at ``began_pass`` stop (``READ_LEAST``, ``READ_SHARE``): a walk
    that must step back through thousands of states (1F1B-flush's windows on many devices: 20,000 took
    6 s on the 32-block GPT) does not take the time of the passes after it."""
    now = time.monotonic()
    return min(deadline, now + max(READ_LEAST, READ_SHARE * (now - began_pass)))


def _said(progress: Optional[Callable[[str], None]], began: float, margin: float):
    """A progress line per pass (nothing where ``progress`` is None)."""
    def say(where: str, T: float, failed: bool, read, by_reads: bool = False) -> None:
        if progress is not None:
            progress(f"partition: within the memory limit {where}{'no' if failed else 'maybe a'} plan at "
                     f"{(T - margin) * 1e3:.4g} ms" + (f", a plan of {read[2].bottleneck_s * 1e3:.4g} ms read back"
                                                         if read is not None else "")
                     + (" (the reads: none)" if by_reads else "") + f" ({time.monotonic() - began:.1f} s)")
    return say


def raise_bound(graph: CostGraph, opts: CostOptions, found: PartitionResult, deadline: float,
                progress: Optional[Callable[[str], None]] = None, built: Optional[tuple] = None) -> None:
    """``found`` (a plan within ``opts.memory``) with its bound raised to ``memory_bound``'s where that
    proves more, its plan replaced by the one read back from the bound's DP where that is faster (its
    method saying each), and its status OPTIMAL where the gap closes to ``OPTIMAL_GAP``."""
    floor = max(found.bound_s, floors(graph, flat_bound(opts, fast=True)))  # a proven start for the bisection
    lower, read = memory_bound(graph, opts, floor, found.bottleneck_s, deadline, progress, built=built)
    if read is not None and read[2].bottleneck_s < found.bottleneck_s:
        assignment, replicas, ev = read
        found.assignment, found.replicas, found.stages = assignment, list(replicas), ev.stages
        found.bottleneck_s = found.objective_s = ev.bottleneck_s
        found.bound_s = min(found.bound_s, found.bottleneck_s)
        found.method = "bound's DP within memory"  # the plan is the DP's now, not the walk's
    if lower is not None and lower > found.bound_s:
        found.bound_s = min(lower, found.bottleneck_s)
        found.method += ", bound within the limit"  # the solver line says which bound it states
    found.status = "OPTIMAL" if found.gap <= OPTIMAL_GAP else "FEASIBLE"
