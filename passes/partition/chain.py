"""Exact partitioning over ALL convex plans by parametric search on the bottleneck T.

For a given T, ``devices_needed`` is a DP over the points of the downset
lattice (``segments.py``: the concatenation of small per-segment lattices):
``dev[i] = min over downsets j ⊂ i of dev[j] + r(j, i, T)``, where
``r(j, i, T)`` is the fewest replicas that bring stage ``i \\ j`` under T
(``costmodel.min_replicas``: compute, weights, and both cuts, the cut
``2A/(B·min(r_b, r_b+1)) <= T`` being the same as each side having
``r >= 2A/(B·T)``). T is feasible iff ``dev[full] <= K``; that is necessary
for any plan on exactly K devices too, so an infeasible T is a proven lower
bound. The bottleneck is then bisected (geometrically, between ``sum C / K``
and the best plan found) until the two meet within ``TOLERANCE`` (0.03 %) or the deadline
comes, and the plan found at the lowest feasible T is padded to exactly K
devices where the options ask for that.

Candidates ``j`` for the points of a segment are the segment's own smaller
points (a small matrix per segment) plus a *pool* of earlier points. A pool
point that cannot start a stage ending at the current segment's last point
within the devices left is dropped (the stage only grows later), and one is
dropped when a later point contains it with no more devices used and no more
bytes cut (it is then at least as good a start for every later stage).
Shared (tied) weights count once per stage: a stage holds weight p iff one of
p's users lies in ``i \\ j``, i.e. the users counted in ``i`` exceed those in ``j``;
it shares p with another stage iff not all of them do. Its sync then runs over
its own ranks and those of every stage holding another user of p, so each
user u outside the stage (inside j, or outside i: ``Segment.shared`` keeps a
flag per user) brings at least the replicas u's unit needs alone within T
(``costmodel.partner_replicas``); the stage is charged ``tied_floor_s`` with the
largest of those (the smallest over its tied weights, if several). No plan
within T has a smaller group, so an infeasible T stays a proof.
"""
from __future__ import annotations

import math
import time
from collections import abc
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from passes.partition.coarsen import Units
from passes.partition.heuristic import Solution
from passes.partition.costmodel import (CostOptions, allreduce_at, allreduce_floor, closed_form_applies, cut_at,
                                        flat_bound, min_replicas, partner_replicas, replicas_floor, stage_time_s,
                                        tied_floor_coeff, tied_floor_s, tied_sync_s)
from passes.partition.canon import Canon
from passes.partition.memory_guard import pass_deadline, past
from passes.partition.offsets import count
from passes.partition.pins import Pins
from passes.partition.segments import Segment, bridged_units, user_pairs


PROVE_WITHIN = 0.01  # a known plan's first check: a pass this far below it proves the plan within 1 %, where
# bisecting from a far bound would need several passes (on two-level machines a pass can cost seconds)
NEAR_SLICE = 1 << 18  # pairs per ``_near`` call of ``_r``: bounds its temporaries (a few dozen arrays of this)
NEAR_KEPT = 1 << 22  # distinct in-segment pairs up to which ``_near`` keeps their gathered points between passes
# (eight arrays a pair: 256 MB here); past it each pass gathers them again, slice by slice: the 24-layer HF
# Llama with its attention blocks whole (``segment_plan.finer_bound``) has 26 million, 1.7 GB kept
NEAR_CACHED = 1 << 25  # distinct in-segment pairs up to which ``_near`` keeps the counts of the passes bracketing
# the next T (three passes' at most: 200 MB in 16 bits at this many; a 96-layer Llama's 110 million are not kept)
TOLERANCE = 3e-4  # the bisection stops when plan and bound are this close (relative; OPTIMAL means <= 0.1 %)
ROW_CELLS = 1 << 24  # about the most replica counts one pass keeps for equal blocks to read (``_pool_r``)
R_CHUNK = 1 << 15  # stages per piece of ``_r``: its few dozen temporaries of this many stay in the cache, where on a
# million stages at once each array operation waited on memory (a whole-block Llama pass's pool rows: 2.1x faster)
SLACK = 1e-9  # a pass at T admits stages up to T(1 + SLACK): prefix sums round (``_attempt``)


class DeadlineExceeded(Exception):
    """Raised inside a DP pass when the wall-clock deadline passes."""


@dataclass
class ChainSolution:
    stage_of: Optional[List[int]]  # per unit; None: a bound and no plan (``solve``'s ``ceiling``)
    replicas: Optional[List[int]]
    objective: float  # the plan's bottleneck on the units (inf without a plan)
    bound: float  # proven: no plan on these units is faster
    complete: bool  # the bisection closed (bound within ``TOLERANCE`` (0.03 %) of the plan)


class _Partners:
    """Per shared weight, the fewest replicas that the stages holding its users outside a stage have.

    Each user's unit lies whole in one stage, which at bottleneck T needs at
    least ``costmodel.partner_replicas`` of the unit alone (its compute, its
    weights, the shared one tied); the stages holding users outside a stage
    have at least the largest of those among those users. Computed once per T
    for every (weight, user) pair (``segments.user_pairs``).
    """

    def __init__(self, units: Units, opts: CostOptions) -> None:
        shared = list(units.shared.values())
        pairs = user_pairs(shared)
        holds = {u: sum(nb for nb, users in shared if u in users) for _, u in pairs}
        self.compute = np.array([units.compute[u] for _, u in pairs])
        self.params = np.array([units.param_bytes[u] + holds[u] for _, u in pairs], dtype=float)
        self.tied = np.array([float(shared[w][0]) for w, _ in pairs])
        self.starts = np.r_[0, np.cumsum([len(users) for _, users in shared])[:-1]].astype(np.int64)
        self.opts, self._at = opts, (None, None)

    def least(self, outside: np.ndarray, T: float) -> np.ndarray:
        """Per weight (last axis), the most replicas needed by a user flagged in ``outside`` (last axis: pairs)."""
        if self._at[0] != T:
            self._at = (T, partner_replicas(self.compute, self.params, self.tied, T, self.opts).astype(float))
        return np.maximum.reduceat(outside * self._at[1], self.starts, axis=-1)


class ChainSolver:
    deadline = math.inf  # of the pass running: subclasses whose one segment can take seconds check it inside

    def __init__(self, units: Units, segments: List[Segment], opts: CostOptions, floor_counts: bool = False) -> None:
        """``floor_counts``: untied stages count ``costmodel.replicas_floor`` replicas, not the exact fewest,
        where the options allow (``costmodel.closed_form_applies``): for a search that keeps only its bound, since an
        infeasible pass still proves T (a feasible one may find a plan that does not meet T; it is
        scored as it runs). On the 96-layer HF Llama's whole-block passes (``segment_plan.finer_bound``,
        256 devices) a pass took 2.2-2.5 s instead of 3.8-4.5."""
        self.units, self.segs, self.opts = units, segments, opts
        self.shared_bytes = np.array([float(nb) for nb, _ in units.shared.values()])
        self.shared_users = np.array([len(users) for _, users in units.shared.values()])
        self._partners = _Partners(units, flat_bound(opts, fast=True))
        self.offsets = np.cumsum([0] + [len(s.compute) for s in segments])
        self.point_seg = np.searchsorted(self.offsets, np.arange(self.offsets[-1]), side="right") - 1  # point -> segment
        self._pairs = None
        self._near_seen: List[Tuple[float, List[np.ndarray]]] = []  # ``_near``: (T, counts per distinct set)
        # whether ``_near`` keeps them: the flat DP's own counts (a subclass's may not fall with T), on at most
        # ``NEAR_CACHED`` distinct pairs (set with ``_pairs``)
        self._keep_near = False
        self._ids: Optional[List[int]] = None  # ``_segment_ids``
        self._debt_all: Optional[np.ndarray] = None  # ``_debts``' tied part
        self._floor_at: Tuple[float, Optional[np.ndarray]] = (math.nan, None)  # (T, ``_debts`` at T)
        self._runs: dict = {}  # runs of segment ids -> a small int (``_pool_r``'s row keys)
        self._rows: Tuple[float, dict] = (math.nan, {})  # (T, row key -> ``_r`` row) of the pass running
        self._ends, self._starts = bridged_units(units)  # per unit (``Segment.start``)
        # where nodes are bridged a point's compute is two numbers as an end (``Segment.compute``,
        # ``plain``) and as a start (``start``, ``plain``), a stage the larger difference (``stage_compute``)
        self.two = bool(units.bridged)
        # ``floor_counts``: where it applies, the span of every point's compute and bytes (``replicas_floor``);
        # with shared weights, for the stages of ``_untied`` segments alone
        self._floor_span = float(np.sum(np.abs(units.compute)) + 2.0 * np.sum(np.abs(units.param_bytes))
                                 / opts.ar_bandwidth) if floor_counts and closed_form_applies(opts) and not self.two \
            and opts.tied_replicas is None else None
        # the type counts are kept in (the floor counts, the in-segment and the kept pool rows): at most K + 1,
        # and a pass adds a pool point's devices to them (up to 2K + 2): 16 bits where that fits, so its tables
        # of pool rows against a segment's points move a quarter of the bytes
        self._small = np.int16 if 2 * opts.devices + 2 <= np.iinfo(np.int16).max else np.int32
        self._pair_cache: dict = {}
        self._pins: Optional[Pins] = None  # ``pins``
        self._level_cache: dict = {}  # ``_levels``
        self._cut_cache: dict = {}  # ``_cut_no_larger``
        self._larger_cache: dict = {}  # ``_replacing``
        if units.bridged and units.hidden:  # ``_late``'s room reads one compute per point
            raise ValueError("units with both Units.bridged and Units.hidden compute: clear hidden (as "
                             "segment_plan.segment_dp does for the placed DPs) or fold without bridge")

    # ------------------------------------------------------------ one T
    def fewest_replicas(self, cj, pj, sj, cutj, ci, pi, si, cuti, T):
        """The fewest allowed replicas of each stage (j, i) that meet T (K + 1: none), the points' compute,
        weight bytes, ``Segment.shared`` rows and cuts given as broadcastable arrays (``_r``)."""
        return self._r(cj, pj, sj, cutj, ci, pi, si, cuti, T)

    def inside_replicas(self, T: float) -> Sequence[np.ndarray]:
        """``fewest_replicas`` of every stage with both ends in one segment, per segment, in the order of
        its ``sub_j`` / ``sub_i`` pairs (``_near``)."""
        return self._near(T)

    def _r(self, cj, pj, sj, cutj, ci, pi, si, cuti, T):
        """Fewest replicas for stages (j, i) given as broadcastable arrays of the two points, in pieces of
        about ``R_CHUNK`` stages along the first axis (``_stage_r`` each)."""
        args = (cj, pj, sj, cutj, ci, pi, si, cuti)
        n = max((np.shape(x)[0] for x in args if np.ndim(x)), default=0)
        size = math.prod(np.broadcast_shapes(*(np.shape(x) for x in (pj, cutj, pi, cuti))))  # the stages (no
        # extra axis there: the compute has one for bridged units, the shared flags one per weight)
        if n < 2 or size <= 2 * R_CHUNK:
            return self._stage_r(*args, T)
        step = max(1, R_CHUNK * n // size)
        cut = lambda x, k: x[k:k + step] if np.ndim(x) and np.shape(x)[0] == n else x  # noqa: E731
        return np.concatenate([self._stage_r(*(cut(x, k) for x in args), T) for k in range(0, n, step)])

    def _stage_r(self, cj, pj, sj, cutj, ci, pi, si, cuti, T):
        """``_r`` on one piece."""
        if self._floor_span is not None and (si is None or not self.shared_bytes.size):  # ``floor_counts``: no
            # tied weight held (none in the graph, or an ``_untied`` set's), one compute per point
            return replicas_floor(cj, pj, cutj, ci, pi, cuti, T, self.opts, self._floor_span, self._small)
        params, tied, shares, flags = self._held(pi - pj, sj, si)
        compute, partners = stage_compute(ci, cj, self.two), self._partner_count(shares, flags, T)
        r = min_replicas(compute, params, cutj, cuti, T, self.opts, tied, partners)
        c = self.opts.tied_replicas
        if c is None or shares is None:
            return r
        # ``1f1b-stash``'s rule for one count c: a stage sharing a tied weight runs exactly c replicas, and so
        # does every other holder (its group has at least c ranks besides the stage; none needing more may hold it)
        sharing = np.broadcast_to(shares.any(axis=-1), np.shape(r))
        upto = self.opts.tied_replicas_upto
        if upto is not None and upto > c:  # a range of counts, each stage its own: the fewest it can run from
            # c on, its partners at least c too (the group's sync grows with them, ``tied_floor_s``)
            floor = np.maximum(partners, c)
            fewest = min_replicas(compute, params, cutj, cuti, T, self.opts, tied, floor)
            least = np.maximum(fewest, c)
            meets = stage_time_s(compute, params, cutj, cuti, np.minimum(least, upto), self.opts, tied, floor) <= T
            # c failing where the fewest lies below it puts c past every count that meets T where those form
            # an interval: from one replica on under fxpipe's model, from two on under PipeDream's
            # (``min_replicas``); else it proves nothing, and the stage takes c
            decided = (fewest >= 2) | (self.opts.cost_model == "fxpipe")
            fits = (np.asarray(partners) <= upto) & (least <= upto) & (meets | ~decided)
            return np.where(sharing, np.where(fits, least, self.opts.devices + 1), r).astype(np.asarray(r).dtype)
        fits = (np.asarray(partners) <= c) & (stage_time_s(compute, params, cutj, cuti, c, self.opts, tied, c) <= T)
        return np.where(sharing, np.where(fits, c, self.opts.devices + 1), r)

    def _held(self, params, sj, si):
        """For stages (j, i): weight bytes with the shared weights they hold, the bytes another stage holds
        too, which weights those are, and each weight user's flags at j and at i (a user inside j or
        not inside i lies outside the stage); ``sj``, ``si``: the points' ``Segment.shared`` rows."""
        n = self.shared_bytes.size
        if not n or si is None:  # no shared weight, or none held in this set (``_untied``)
            return params, 0.0, None, None
        inside = si[..., :n] - sj[..., :n]
        held = inside > 0.5
        shares = held & (inside < self.shared_users - 0.5)
        return params + held @ self.shared_bytes, shares @ self.shared_bytes, shares, (sj[..., n:], si[..., n:])

    def _partner_count(self, shares, flags, T: float, floor=None):
        """Fewest replicas the other holders of a stage's tied weights have at T (the module docstring):
        per weight the most its outside users need, then the least over the weights it shares; 1 for
        stages that share none (only those few are worked out). ``floor`` (broadcasts to ``shares``):
        partners per weight known from elsewhere (``placed.PlacedChainSolver`` holds a tied weight's
        holders to ranges of counts)."""
        if shares is None:
            return 1
        some = np.nonzero(shares.any(axis=-1))
        out = np.ones(shares.shape[:-1])
        if some[0].size:
            at_j, at_i = (np.broadcast_to(f, shares.shape[:-1] + f.shape[-1:])[some] for f in flags)
            need = self._partners.least(np.maximum(at_j, 1.0 - at_i), T)
            if floor is not None:
                need = np.maximum(need, np.broadcast_to(floor, shares.shape)[some])
            out[some] = np.where(shares[some], need, np.inf).min(axis=-1)
        return out

    def devices_needed(self, T: float, deadline: float = math.inf, soft: float = math.inf):
        """(devices for the whole graph, back-pointers) at bottleneck T; devices > K means infeasible.
        Past ``soft`` the pass goes on to ``deadline`` only at a pace that ends by then
        (``memory_guard.pass_deadline``)."""
        K = self.opts.devices
        self.deadline = deadline
        began = time.monotonic()
        near = self._near(T)  # stages inside one segment do not depend on the DP
        pool = None  # arrays: global id, dev, compute, params, shared counts, cut
        back = np.zeros((self.offsets[-1], 2), dtype=np.int64)
        dev_all = np.full(self.offsets[-1], K + 1, dtype=np.int64)
        for a, seg in enumerate(self.segs):
            self._segment_deadline(a, began, soft, deadline)
            d, off = len(seg.compute), self.offsets[a]
            dev = np.full(d, K + 1, dtype=np.int64)
            src = np.zeros((d, 2), dtype=np.int64)
            if a == 0:
                dev[0] = 0
            reach = None
            if pool is not None and pool[0].size:
                gid, pdev, pc, pp, ps, pcut = pool
                # one extra column: the segment's last point with no cut after it, to prune the pool
                end = self.end_of(seg)
                cc, cp = np.concatenate([end, end[-1:]]), np.append(seg.params, seg.params[-1])
                cs, ccut = np.vstack([seg.shared, seg.shared[-1:]]), np.append(seg.cut, 0.0)
                R = self._pool_r(a, gid, T, (pc[:, None], pp[:, None], ps[:, None, :], pcut[:, None]),
                                 (cc[None, :], cp[None, :], cs[None, :, :], ccut[None, :]))
                reach = pdev + R[:, d] <= K
                tot, R = pdev.astype(R.dtype)[:, None] + R[:, :d], R[:, :d]
                if self.units.hidden:
                    self._late_pool(a, seg, T, pool, tot, R, (cc, cp, cs, ccut))
                k = tot.argmin(axis=0)
                dev = tot[k, np.arange(d)]
                src[:, 0], src[:, 1] = gid[k], R[k, np.arange(d)]
            least = self._least_devices(a, seg, T)
            dev = np.maximum(dev, least)
            rest = self._rest(seg, T)  # a T under the optimum fails sooner
            dev[dev + rest > K] = K + 1
            if seg.sub_j.size:
                j, R2, levels = seg.sub_j, near[a], self._levels(seg)
                floor = self._late_inside(a, seg, T, dev, least, j, R2, levels) if self.units.hidden else None
                self._inside(dev, src, off, R2, levels, least, floor)
            dev[dev + rest > K] = K + 1
            dev_all[off:off + d] = dev
            back[off:off + d] = src
            pool = self._next_pool(pool, reach, seg, off, dev)
            if not pool[0].size:
                return K + 1, back  # nothing can start the next stage: infeasible
        return int(dev_all[-1]), back

    def _segment_deadline(self, a: int, began: float, soft: float, deadline: float) -> None:
        """Before segment ``a`` of a pass begun at ``began``: ``self.deadline``, which the work inside the
        segment checks, from ``memory_guard.pass_deadline`` with the share of the points done so far;
        ``DeadlineExceeded`` once it has passed. Every solver's pass runs its segments through this."""
        self.deadline = pass_deadline(began, self.offsets[a] / self.offsets[-1], soft, deadline)
        if past(self.deadline):
            raise DeadlineExceeded()

    def _pool_r(self, a: int, gid: np.ndarray, T: float, starts: tuple, ends: tuple) -> np.ndarray:
        """``_r`` of every pool point (rows, ``starts``) with every point of segment ``a`` and its closing
        column (``ends``), each row worked out once per T among equal ones.

        A stage from point j of segment b to a point of segment a costs what the same stage costs in
        any run of segments equal to b..a (``_segment_ids``), j at the same place in the first: its
        compute and weights are the sums of the same units, its cuts and shared-weight users the
        same. So on a stack of repeated blocks the rows of one block serve every later one, and a
        pass costs a few blocks' rows rather than all of them (96 GPT blocks: most of a pass went to
        those rows, ~1e6 stages each pass). The empty set's row (a first stage, which may run compute
        its units force in) is its own (``row_keys``). Where no two segments are equal (blocks of equal
        shape but measured costs: the bundled 96-layer HF Llama) no row can be read again, and none is
        keyed or kept (a sixth of that Llama's pool rows' time on 1,024 devices)."""
        ids = self._segment_ids()
        if len(set(ids)) == len(ids):
            return self._r(*starts, *ends, T)
        if self._rows[0] != T:
            self._rows = (T, {})
        memo, keys = self._rows[1], self.row_keys(a, gid)
        miss = [k for k, key in enumerate(keys) if key is None or key not in memo]
        if not miss:
            return np.stack([memo[key] for key in keys])
        got = self._r(*(x[np.asarray(miss)] for x in starts), *ends, T)
        fresh = dict(zip(miss, got))
        if len(memo) * got.shape[1] < ROW_CELLS:  # a pass's rows stay bounded (wide lattices, few repeats)
            memo.update((keys[k], row.astype(self._small)) for k, row in fresh.items() if keys[k] is not None)
        if len(miss) == len(keys):
            return got
        return np.stack([fresh[k] if k in fresh else memo[key] for k, key in enumerate(keys)])

    def row_keys(self, a: int, gid: np.ndarray) -> list:
        """Per pool point (``gid``), a key equal for the stages from it to segment ``a``'s points and from
        an equal point of an equal run of segments (``_pool_r``); None where a stage's own flags differ
        from those of equal ones: from the empty set (a first stage), and to the last segment."""
        if a == len(self.segs) - 1:
            return [None] * gid.size
        ids, segs = self._segment_ids(), self.point_seg[gid]
        runs = {b: self._runs.setdefault(tuple(ids[b:a + 1]), len(self._runs)) for b in np.unique(segs).tolist()}
        return [(runs[b], j) if g else None
                for b, j, g in zip(segs.tolist(), (gid - self.offsets[segs]).tolist(), gid.tolist())]

    def _segment_ids(self) -> List[int]:
        """Per segment, the index of the first equal one (its units' own compute and weights per point,
        its cuts and shared-weight users: everything ``_r`` reads of a point but the prefix sums)."""
        if self._ids is None:
            canon, seen, self._ids = Canon(), {}, []
            for seg in self.segs:
                key = canon.get((*self._own_sums(seg), self._own_start(seg), seg.shared, seg.cut))
                self._ids.append(seen.setdefault(id(key), len(seen)))
        return self._ids

    def _rest(self, seg: Segment, T: float) -> np.ndarray:
        """Per point of ``seg``, the fewest devices the compute after it needs at T: every later stage
        needs at least its compute / T replicas, so a prefix whose devices plus these exceed K cannot
        finish and is dropped (the flat and the placed passes)."""
        total = self.segs[-1].compute[-1]  # the compute after a point: at least what a stage from it runs
        rest = count((total - seg.start) / T, self.opts.devices)
        rest[seg.start >= total * (1 - 1e-12)] = 0  # nothing after (``start`` rounds apart from ``compute``)
        return rest

    @staticmethod
    def _late(hidden_i, compute_j, dev_j, T: float):
        """Compute of ``Units.hidden`` that a stage (j, i) must run itself if the prefix j has ``dev_j``
        devices: what the prefix i forces in, less the room the prefix j has for it (``compute_j``:
        the prefix's units' compute and ``_debt``).

        Every stage time is at least its compute over its replicas, so the stages of a prefix with D
        devices hold at most ``D·T`` of compute, and whatever of the forced-in compute (``hidden_i``,
        which includes the prefix j's own) does not fit in that room runs in the stage (j, i) or in
        stages of their own: a real plan may put a branch's nodes in a stage that holds nothing else
        (the relaxed graph, where they cost nothing, has no such stage), which holds at most T a
        device, as if the prefix j had those devices (``_late_replicas``; the first stage too, whose
        prefix is empty). ``_least_devices`` counts the same compute over the prefix i as a whole,
        which lets the slack of any stage hold it; here only the stages that can, the stage (j, i) at
        its own replica count, its all-reduce included. HF GPT-2's mask branch (0.36 ms) filled the
        slack of replicated stages at 64 devices, which no plan can do."""
        return hidden_i + compute_j - dev_j * T * (1 + SLACK)

    def _late_replicas(self, late, plain, T: float, starts, ends, pinned=None):
        """Devices a stage (j, i) adds to the prefix j's count, with ``late`` > 0 compute it must hold if
        the prefix j has its least devices: ``min over e >= 0 of e + r(stage + max(pinned, late - e·T))``,
        ``e`` devices more before the stage (more for the prefix j, or stages of the branch alone:
        each holds at most T more of it); ``pinned`` (<= ``late``, 0 if None) of it no earlier stage can
        run (``pins.py``). ``plain``: r without any of it. A prefix j with more devices than the DP
        found is a start this minimum covers, so no count is above what a plan within T uses, and a
        later start j' ⊇ j with no more devices is still as good (the pool's pruning stays sound; its
        pinned compute is no more). The plan gives the stage those ``e`` devices."""
        cj, pj, sj, cutj = starts
        fixed = np.zeros_like(late) if pinned is None else pinned
        top = np.ceil((late - fixed) / T * (1 - 1e-12)).astype(np.int64)
        best = plain.astype(np.int64) + top
        held = np.nonzero(fixed > 0)[0]
        if held.size:  # the term at e = top runs the pinned compute still
            best[held] = top[held] + self._r(cj[held] - fixed[held], pj[held], sj[held], cutj[held],
                                             *(x[held] for x in ends), T)
        for e in range(int(top.max())):
            open_ = np.nonzero(e < top)[0]
            extra = late[open_] - e * T
            r = self._r(cj[open_] - extra, pj[open_], sj[open_], cutj[open_],
                        *(x[open_] for x in ends), T)
            best[open_] = np.minimum(best[open_], e + r)
        return best

    def _late_pool(self, a: int, seg: Segment, T: float, pool, tot, R, ends) -> None:
        """``_late_replicas`` for the stages from the pool's points to ``seg``'s (segment ``a``): ``tot``
        (devices) and ``R`` (replicas), rows by pool point, updated in place. Only where a late stage
        could beat the column's best stage that runs nothing late (its count only grows); the others
        leave the column (set above K)."""
        gid, pdev, pc, pp, ps, pcut = pool
        K = self.opts.devices
        room = pc + self._debts(T)[gid]
        pinned = self.pins.pool(gid, a) if self.pins else None
        if pinned is None:
            some = np.nonzero(self._late(seg.hidden[-1], room, pdev, T) > 0)[0]  # the last point forces in most
            if not some.size:
                return
            late = np.full(tot.shape, -1.0)
            late[some] = self._late(seg.hidden[None, :], room[some, None], pdev[some, None], T)
        else:
            late = np.maximum(self._late(seg.hidden[None, :], room[:, None], pdev[:, None], T), pinned)
        clean = np.where(late > 0, K + 1, tot).min(axis=0)
        tot[(late > 0) & (tot >= clean[None, :])] = K + 1
        rows, cols = np.nonzero((late > 0) & (tot < clean[None, :]))
        if rows.size:
            R[rows, cols] = self._late_replicas(late[rows, cols], R[rows, cols], T,
                                                (pc[rows], pp[rows], ps[rows], pcut[rows]),
                                                tuple(x[cols] for x in ends),
                                                None if pinned is None else pinned[rows, cols])
            tot[rows, cols] = pdev[rows] + R[rows, cols]

    @staticmethod
    def _inside(dev, src, off: int, R2, levels, least, floor=None) -> None:
        """Stages with both ends in the segment: ``dev`` and ``src`` updated in place, the points of one
        rank at a time (``_levels``; a stage starts at a point of lower rank, final by then), each end's
        first cheapest start as the points one by one found it. ``floor``: per pair, a count the stage's
        end reaches at the least (``_late_inside``)."""
        for xs, pairs, js, starts, sizes in levels:
            cand = dev[js] + R2[pairs]
            if floor is not None:
                cand = np.maximum(cand, floor[pairs])
            m = np.minimum.reduceat(cand, starts)
            better = np.nonzero(m < dev[xs])[0]
            if not better.size:
                continue
            hit = np.flatnonzero(cand == np.repeat(m, sizes))
            k = hit[np.searchsorted(hit, starts[better])]  # the first minimum of each group that improves
            x = xs[better]
            dev[x] = np.maximum(cand[k], least[x])
            src[x, 0] = off + js[k]
            src[x, 1] = cand[k] - dev[js[k]]

    def _levels(self, seg: Segment) -> list:
        """The pairs of ``seg`` by the rank of their end (the units its point holds; a strict subset holds
        fewer): per rank, its ends that have pairs (ascending), their pairs (grouped by end, in order),
        those pairs' starts, each group's start and size. Worked out once per lattice (equal segments
        share their pair arrays). The points one at a time cost a Python step each, two a point a pass:
        150,000 on a whole-block Llama pass, a sixth of it; gathering the starts every pass took a
        quarter of ``_inside`` there (96 layers, 1,024 devices)."""
        return self._per_lattice(self._level_cache, seg, None, lambda: self._grouped_by_rank(seg))

    @staticmethod
    def _grouped_by_rank(seg: Segment) -> list:
        """``_levels`` worked out."""
        d = len(seg.compute)
        bounds = np.searchsorted(seg.sub_i, np.arange(d + 1))
        counts = np.diff(bounds)
        rank = seg.member.sum(axis=1)
        levels = []
        for r in np.unique(rank[counts > 0]):
            xs = np.nonzero((rank == r) & (counts > 0))[0]
            sizes = counts[xs]
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            pairs = np.arange(int(sizes.sum())) - np.repeat(starts - bounds[xs], sizes)
            levels.append((xs, pairs, seg.sub_j[pairs], starts, sizes))
        return levels

    @staticmethod
    def _per_lattice(cache: dict, seg: Segment, extra, build):
        """``build()``, kept in ``cache`` for ``seg``'s lattice (equal segments share their pair arrays) and
        ``extra`` (hashable: what else the answer reads). The arrays are held with the answer, so an id
        is not reused while it is kept."""
        key = (id(seg.sub_i), extra)
        known = cache.get(key)
        if known is None or known[0] is not seg.sub_i:
            known = (seg.sub_i, build())
            cache[key] = known
        return known[1]

    def _late_inside(self, a: int, seg: Segment, T: float, dev, least, j, R2, levels) -> Optional[np.ndarray]:
        """Per pair (j, x) of ``seg``, a count the point x reaches through the stage (j, x) at the least
        with the compute it must run late (``_late``), or None where no stage has any.

        ``dev(j) + _late_replicas(...)`` at the prefix j's count is ``min over d >= dev(j) of d +
        r(stage + max(0, late at d))``: it grows with dev(j). So it is worked out once for all pairs at
        the counts the segment reaches without any late compute (no more than with it), and a pair's
        count is the larger of that and its count without late compute: both hold, and the loop over
        the points stays one array operation a rank (``_inside``).

        No pair's late compute exceeds its start's with the segment's last point as the end (which forces
        in the most, a sum of the same terms and more, rounded no lower): pairs are worked out only from
        the starts where that is positive (on a whole-block Llama pass, all pairs twice over took a
        fifth of the pass)."""
        room = seg.compute + self._seg_debt(a, T)
        pinned = self.pins.inside(a) if self.pins else None
        if pinned is None:
            # (``least``: no prefix has fewer devices, so none has less room)
            some = np.nonzero((self._late(seg.hidden[-1], room, least, T) > 0)[j])[0]
            if not some.size or not (self._late(seg.hidden[seg.sub_i[some]], room[j[some]], least[j[some]], T)
                                     > 0).any():
                return None
        lower, src = dev.copy(), np.zeros((len(dev), 2), dtype=np.int64)
        self._inside(lower, src, 0, R2, levels, least)
        starts = lower <= self.opts.devices  # the starts a late stage can follow: with pins, every such one
        if pinned is None:  # else only where the last point as the end leaves some compute late
            starts &= self._late(seg.hidden[-1], room, lower, T) > 0
        some = np.nonzero(starts[j])[0]
        late = self._late(seg.hidden[seg.sub_i[some]], room[j[some]], lower[j[some]], T)
        if pinned is not None:
            late = np.maximum(late, pinned[some])
        pos, late = some[late > 0], late[late > 0]
        if not pos.size:
            return None
        at, xs = j[pos], seg.sub_i[pos]
        r = self._late_replicas(late, R2[pos], T, (seg.compute[at], seg.params[at], seg.shared[at], seg.cut[at]),
                                (seg.compute[xs], seg.params[xs], seg.shared[xs], seg.cut[xs]),
                                None if pinned is None else pinned[pos])
        floor = np.zeros(len(j), dtype=np.int64)
        floor[pos] = lower[at] + r
        return floor

    @property
    def pins(self) -> Pins:
        """``pins.Pins`` of these units and segments, built on first use."""
        if self._pins is None:
            self._pins = Pins(self.units, self.segs, self.offsets)
        return self._pins

    def _least_devices(self, a: int, seg: Segment, T: float):
        """Devices any plan within T spends on each point's prefix: its compute, with what a relaxation
        took off the units (``Units.hidden``), over T (every stage time is at least compute / r); 0
        without such compute, where the per-stage counts already say more."""
        if not self.units.hidden:
            return np.zeros(len(seg.compute), dtype=np.int64)
        return np.ceil((seg.compute + seg.hidden + self._seg_debt(a, T)) / T * (1 - 1e-12)).astype(np.int64)

    def _debts(self, T: float) -> np.ndarray:
        """Per point (global ids), device time its prefix's stages spend at T on anything but compute,
        at the least: ``_debt`` (tied weights) and ``_allreduce_floors`` (their own weights)."""
        if self._floor_at[0] != T:
            if self._debt_all is None:
                self._debt_all = np.concatenate([self._debt(seg.shared) for seg in self.segs])
            self._floor_at = (T, self._debt_all + self._allreduce_floors(T))
        return self._floor_at[1]

    def _seg_debt(self, a: int, T: float) -> np.ndarray:
        """``_debts`` of segment ``a``'s points."""
        return self._debts(T)[self.offsets[a]:self.offsets[a + 1]]

    def _allreduce_floors(self, T: float) -> np.ndarray:
        """Per point (global ids), the sum over its prefix's units of ``costmodel.allreduce_floor``: the
        all-reduce time its stages spend at the least, room that compute forced into the prefix
        (``Units.hidden``) cannot use. Counted only with such compute: elsewhere every stage's own
        replica count charges its all-reduce exactly. Without it, on a 24-layer Llama at 512 devices
        the freed attention nodes' compute filled the time replicated stages all-reduce in."""
        if not self.units.hidden or self.opts.replication == "none":
            return np.zeros(self.offsets[-1])
        per_unit = allreduce_floor(np.asarray(self.units.compute, dtype=float),
                                   np.asarray(self.units.param_bytes, dtype=float), T, self.opts)
        # a unit no count brings under T: its prefixes need more than K devices (inf would make 0 * inf)
        per_unit = np.minimum(per_unit, 2.0 * self.opts.devices * T)
        out, before = [], 0.0
        for seg in self.segs:
            own = per_unit[np.asarray(seg.units, dtype=np.int64)]
            out.append(before + seg.member.astype(float) @ own)
            before += float(own.sum())
        return np.concatenate(out)

    def _debt(self, shared):
        """Per point (rows of ``Segment.shared``), time its prefix's stages spend on tied weights at
        the least: a prefix that holds some of a weight's users but not all has a stage sharing it,
        which pays at least ``tied_floor_s`` with one replica and one partner (r times the floor,
        the room it takes from r replicas, grows with r); the weights add up (a stage's sync is
        charged per byte). Room the forced-in compute cannot use (``_late``, ``_least_devices``).

        Under ``1f1b-stash``'s rule for a count c (``CostOptions.tied_replicas``; with a range, c its
        least) that stage runs c replicas and its group has at least c more: ``c · tied_floor_s(P, c)``
        with c partners, the least over the range's counts (it grows with both). HF GPT-2 tied on 64
        devices, count 2: the 0.39-ms mask branch filled the 0.21 ms more that its first stage's two
        replicas spend syncing the embedding over four ranks."""
        n = self.shared_bytes.size
        if not n:
            return np.zeros(shared.shape[:-1])
        held = shared[..., :n]
        partial = (held > 0.5) & (held < self.shared_users - 0.5)
        return partial @ (self.shared_bytes * self._tie_room())

    def _tie_room(self) -> float:
        """``_debt``'s room per tied byte: ``r · tied_floor_s(1, r)`` with one replica and one partner, or
        under a count c (``CostOptions.tied_replicas``) with c of each."""
        c = self.opts.tied_replicas or 1
        return tied_floor_coeff(c, self.opts, c)

    def _near(self, T: float) -> Sequence[np.ndarray]:
        """Replicas of every stage (j, i) with both ends in the same segment, per segment.

        Segments of repeated blocks hold equal pairs (``canon.Canon``): each distinct set is worked out
        once, in slices of ``NEAR_SLICE`` pairs, so a deep stack of blocks with many sub-block points
        costs one block's pairs per pass and its temporaries stay bounded (all pairs at once took
        2.9 GB on 32 blocks at K = 1024). Past ``NEAR_KEPT`` distinct pairs (blocks of equal shape but
        measured costs, each its own set) their points are gathered anew each pass, slice by slice, and
        the counts held in 16 bits: two bytes a pair a pass, where the kept points take 48 or more.

        Where the counts are not kept between passes (``_keep_near``), each distinct set is worked out
        when the pass first reads it (``_PerSegment``): a pass that proves T infeasible often stops
        before the last segment (nothing can start the next stage), and the sets after it are never
        read (96-layer HF Llama, 1,024 devices, the bound pass 1 % under the plan: it stops at
        segment 173 of 191)."""
        if self._pairs is None:
            # equal points and equal pair lists give equal pairs: compare the points (a block's 1,600 on an
            # H100's profile) rather than the gathered pairs (its 330,000), gather each distinct set once
            canon, distinct, which = Canon(), {}, []  # distinct pair sets by identity, in first-seen order
            for seg in self.segs:
                (c, p), c0, ends = self._own_sums(seg), self._own_start(seg), (seg.sub_j, seg.sub_i)
                key = canon.get((*ends, c, c0, p, seg.shared, seg.cut))
                if id(key) not in distinct:  # a stage from j runs c[i] - c0[j] (``Segment.start``)
                    users = None if self._untied(seg) else seg.shared  # None: no stage here holds a tied weight
                    distinct[id(key)] = (len(distinct), (ends, tuple((first, p, users, seg.cut)
                                                                     for first in (c0, c))))
                which.append(distinct[id(key)][0])  # ``_r``'s argument order above
            sets = [pairs for _, pairs in distinct.values()]
            if sum(ends[0].size for ends, _ in sets) <= NEAR_KEPT:  # gathered once, read every pass
                sets = [(None, _gathered(ends, points, slice(None))) for ends, points in sets]
            self._pairs = (sets, which)
            self._keep_near = type(self)._stage_r is ChainSolver._stage_r and type(self)._r is ChainSolver._r \
                and sum((p if e is None else e)[0].shape[0] for e, p in sets) <= NEAR_CACHED
        distinct, which = self._pairs
        known = self._bracketing(T)
        if not self._keep_near:
            return _PerSegment(lambda s: self._near_set(s, *distinct[s], known, T), which)
        out = [self._near_set(s, ends, pairs, known, T) for s, (ends, pairs) in enumerate(distinct)]
        self._remember(T, out)
        return [out[k] for k in which]

    def _near_set(self, s: int, ends, pairs, known, T: float) -> np.ndarray:
        """``_near``'s counts at T of its distinct set ``s`` (``ends`` and ``pairs`` as it holds them);
        ``known``: ``_bracketing``'s counts, or None."""
        small = self._small
        n = (pairs if ends is None else ends)[0].shape[0]
        one = self._fits_one(ends, pairs, T)  # a stage of this set whose compute fits T fits one replica
        if one and n and self._fits_one(ends, pairs, T, self._compute_bound(ends, pairs)):  # every one does
            return np.ones(n, dtype=np.int64 if ends is None else small)
        if known is not None:  # counts fall as T grows: where the passes on both sides agree, T's agrees
            below, above = known[0][s], known[1][s]
            counts, todo = below.copy(), np.nonzero(below != above)[0]
            for a in range(0, todo.size, NEAR_SLICE):
                if past(self.deadline):
                    raise DeadlineExceeded()
                at = todo[a:a + NEAR_SLICE]
                some = (None, tuple(None if x is None else x[at] for x in pairs)) if ends is None else \
                    ((ends[0][at], ends[1][at]), pairs)
                counts[at] = self._near_slice(*some, 0, at.size, T, one)
            return counts
        parts = []
        for a in range(0, n, NEAR_SLICE):  # a pass over millions of pairs takes seconds: the deadline holds
            if past(self.deadline):
                raise DeadlineExceeded()
            part = self._near_slice(ends, pairs, a, min(a + NEAR_SLICE, n), T, one)
            # gathered anew, that many counts are kept for the pass: in the fewest bytes that hold K
            parts.append(part if ends is None else part.astype(small))
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _bracketing(self, T: float):
        """The counts of the kept passes nearest T from below and from above (``_near``), or None.

        Every count is the fewest replicas that meet T (or K + 1), so it never rises with T: a pair whose
        count is the same at a lower and a higher T has that count at T, and only the pairs whose counts
        differ there are worked out again. A bisection's bracket narrows pass by pass, and with it those
        pairs: on Gemma's whole-block bound on 256 devices (26.6 million pairs) a pass gathered and
        counted all of them, 0.4-0.7 s of its 1.1-1.9 s."""
        below, above = _nearest(self._near_seen, T)
        return None if below is None or above is None else (below[1], above[1])

    def _remember(self, T: float, counts: List[np.ndarray]) -> None:
        """Keep ``_near``'s counts at T and the kept ones nearest it on each side (the next T of a bisection
        lies between two of these)."""
        if self._keep_near:
            sides = _nearest([e for e in self._near_seen if e[0] != T], T)
            self._near_seen = [(T, counts)] + [e for e in sides if e is not None]

    def _near_slice(self, ends, pairs, a: int, b: int, T: float, one: bool) -> np.ndarray:
        """``_r`` of the pairs ``a:b`` of one of ``_near``'s sets; with ``one`` (``_fits_one``) only the
        stages whose compute exceeds T are gathered and counted, the others fit one replica."""
        if ends is None:  # kept gathered: the pairs' columns
            cols = tuple(None if x is None else x[a:b] for x in pairs)
            take = lambda k: tuple(None if x is None else x[k] for x in cols)  # noqa: E731
            compute = lambda: (cols[4], cols[0])  # noqa: E731
        else:  # gathered here from the points, the compute alone first
            ends = (ends[0][a:b], ends[1][a:b])
            take = lambda k: _gathered(ends, pairs, k)  # noqa: E731
            compute = lambda: (pairs[1][0][ends[1]], pairs[0][0][ends[0]])  # noqa: E731
        if not one:
            return self._r(*take(slice(None)), T)
        part = np.ones(b - a, dtype=np.int64)
        heavy = np.nonzero(stage_compute(*compute(), self.two) > T)[0]
        if heavy.size:
            part[heavy] = self._r(*take(heavy), T)
        return part

    def _fits_one(self, ends, pairs, T: float, compute: float = 0.0) -> bool:
        """Whether every stage of one of ``_near``'s sets (``ends`` and ``pairs`` as it holds them) whose
        compute is at most ``compute``, and at most T, fits one replica at T: ``stage_time_s`` at one
        replica of that compute with the largest cuts of the set's points (the time grows with both, and
        at one replica no weights are synced). Only for the flat DP's own counts (a subclass's ``_stage_r``
        may charge more), and where no stage of the set holds a tied weight (``_untied``). On many devices
        most stages inside a segment run on one replica: a whole-block Llama pass gathered and counted a
        million pairs a block, all of them such stages at 64 devices, 73 % at 256, 28 % at 512."""
        users = pairs[2] if ends is None else pairs[0][2]
        if (self.shared_bytes.size and users is not None) or type(self)._stage_r is not ChainSolver._stage_r:
            return False
        cutj, cuti = (pairs[3], pairs[7]) if ends is None else (pairs[0][3], pairs[1][3])
        if not np.size(cutj) or not np.size(cuti):
            return False
        return stage_time_s(compute, 0.0, float(np.max(cutj)), float(np.max(cuti)), 1, self.opts) <= T

    def _untied(self, seg: Segment) -> bool:
        """Whether no stage with both ends in ``seg`` holds a shared (tied) weight, on a graph that has
        some: every point of the segment holds as many of each weight's users (HF Gemma's blocks: its
        tied embedding is read before them and after them, never inside). ``_near`` then drops the
        segment's user columns (None), and ``_stage_r`` counts its stages as untied ones (no weight bytes
        added, partners 1, ``1f1b-stash``'s rule not applied: what ``_held`` and ``_partner_count`` give
        them anyway), from below where ``floor_counts`` asks (``replicas_floor``, which a tie anywhere in
        the graph used to rule out), and ``_fits_one`` may skip them. On Gemma (24 layers, 128 devices)
        gathering those columns for the million stages inside each block took 1.1 s of a whole-block
        bound pass: its passes at four T took 1.9-3.6 s, now 0.8-1.4 s, with the same counts."""
        n = self.shared_bytes.size
        return bool(n) and not np.ptp(seg.shared[:, :n], axis=0).any()

    @staticmethod
    def _compute_bound(ends, pairs) -> float:
        """A bound on the compute of every stage of a ``_near`` set: its largest end's less its smallest
        start's (rounding is monotone, so no stage's difference rounds above it)."""
        cj, ci = (pairs[0], pairs[4]) if ends is None else (pairs[0][0], pairs[1][0])
        return float(np.max(ci)) - float(np.min(cj))

    def _own_sums(self, seg: Segment) -> Tuple[np.ndarray, np.ndarray]:
        """Each point's compute and weight bytes within ``seg`` alone (``Segment.compute`` and ``params``
        hold the whole prefix). A stage with both ends in the segment is the difference either way,
        but these are equal in every repeated block, where the prefix sums differ in rounding: so the
        pairs of repeated blocks compare equal (``canon.Canon``) and are worked out once."""
        lo, hi = seg.units[0], seg.units[-1] + 1
        compute = seg.member @ self._ends[lo:hi]
        if self.two:
            compute = np.stack([compute, seg.member @ np.asarray(self.units.compute[lo:hi], dtype=float)], axis=-1)
        return compute, seg.member @ np.asarray([self.units.param_bytes[u] for u in seg.units], dtype=float)

    def _own_start(self, seg: Segment) -> np.ndarray:
        """``Segment.start`` within ``seg`` alone, on the same base as ``_own_sums``'s compute: a stage
        (j, i) inside the segment runs at least ``own compute[i] - own start[j]``."""
        if not self.two:
            return self._own_sums(seg)[0]
        lo, hi = seg.units[0], seg.units[-1] + 1
        return np.stack([seg.member @ self._starts[lo:hi] + seg.base_span,
                         seg.member @ np.asarray(self.units.compute[lo:hi], dtype=float)], axis=-1)

    def end_of(self, seg: Segment) -> np.ndarray:
        """A point's compute as the end of a stage (``stage_compute``)."""
        return self._paired(seg, seg.compute)

    def start_of(self, seg: Segment) -> np.ndarray:
        """A point's compute as the start of a stage (``stage_compute``)."""
        return self._paired(seg, seg.start)

    def _paired(self, seg: Segment, charged: np.ndarray) -> np.ndarray:
        """``charged`` alone, or where nodes are bridged beside ``Segment.plain`` (kept per array)."""
        if not self.two:
            return charged
        key = id(charged)
        if key not in self._pair_cache:
            self._pair_cache[key] = (charged, np.stack([charged, seg.plain], axis=-1))
        return self._pair_cache[key][1]

    def _next_pool(self, pool, reach, seg: Segment, off: int, dev: np.ndarray):
        """Earlier points that may still start a stage (see the module docstring)."""
        K = self.opts.devices
        keep = dev <= K
        if seg.sub_j.size:  # a point of this segment containing j with dev and cut no larger replaces j
            ends, first, starts = self._replacing(seg)
            if ends.size:
                keep[starts[np.minimum.reduceat(dev[ends], first) <= dev[starts]]] = False
        new = (off + np.nonzero(keep)[0], dev[keep], self.start_of(seg)[keep], seg.params[keep], seg.shared[keep],
               seg.cut[keep])
        if pool is None or not pool[0].size:
            return new
        ndev, ncut = new[1], new[5]
        beaten = ((ndev[None, :] <= pool[1][:, None]) & (ncut[None, :] <= pool[5][:, None])).any(axis=1)
        alive = ~beaten & reach  # reach: can still end a stage past this segment within K devices
        return tuple(np.concatenate([old[alive], fresh]) for old, fresh in zip(pool, new))

    def _cut_no_larger(self, seg: Segment) -> Tuple[np.ndarray, np.ndarray]:
        """The pairs (j, i) of ``seg`` whose end sends no more than its start (``_next_pool``'s test, less
        the devices: the same every pass), worked out once per lattice and cuts (repeated blocks share
        both). On a whole-block Llama pass (1.15 million pairs a block, a third of them here) testing every
        pair took a sixth of it."""
        def build():
            le = seg.cut[seg.sub_i] <= seg.cut[seg.sub_j]
            return seg.sub_j[le], seg.sub_i[le]
        return self._per_lattice(self._cut_cache, seg, seg.cut.tobytes(), build)

    def _replacing(self, seg: Segment) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_cut_no_larger``'s pairs grouped by start: their ends, each group's first position, and the
        starts, worked out once per lattice and cuts. ``_next_pool`` drops a start whose cheapest such end
        has no more devices: one gather and a reduction over the pairs, where testing them one by one
        took 0.22 s of a whole-block Llama pass (96 layers, 1,024 devices)."""
        def build():
            j, i = self._cut_no_larger(seg)
            order = np.argsort(j, kind="stable")
            j, i = j[order], i[order]
            first = np.flatnonzero(np.r_[True, j[1:] != j[:-1]]) if j.size else np.zeros(0, dtype=np.int64)
            return i, first, j[first]
        return self._per_lattice(self._larger_cache, seg, seg.cut.tobytes(), build)

    # ------------------------------------------------------------ the plan
    def plan(self, back: np.ndarray) -> Tuple[List[int], List[int]]:
        """Stage per unit and replicas, walking back from the full set."""
        chain, reps = self._walk(back)
        return self.stages_of(chain), reps

    def stages_of(self, chain: List[int]) -> List[int]:
        """Stage per unit of the stages between consecutive points of ``chain`` (from the empty one)."""
        stage_of = [0] * len(self.units)
        for s in range(len(chain) - 1):
            inside = self._members(chain[s + 1]) & ~self._members(chain[s])
            for u in np.nonzero(inside)[0]:
                stage_of[u] = s
        return stage_of

    def _walk(self, back: np.ndarray) -> Tuple[List[int], List[int]]:
        """The points that end each stage (from the empty one) and the stages' replicas."""
        chain, reps, x = [], [], self.offsets[-1] - 1
        while True:
            j, r = (int(v) for v in back[x])
            chain.append(x)
            if x == 0:
                break
            reps.append(r)
            x = j
        return chain[::-1], reps[::-1]

    def pad(self, stage_of: List[int], replicas: List[int], T: float) -> Optional[List[int]]:
        """Replicas spread over exactly K devices within T (``pad``)."""
        return pad(self.units, stage_of, replicas, self.opts, T)

    def _members(self, point: int) -> np.ndarray:
        a = int(self.point_seg[point])
        seg = self.segs[a]
        out = np.zeros(len(self.units), dtype=bool)
        first = seg.units[0] if seg.units else 0
        out[:first] = True
        out[seg.units] = seg.member[point - self.offsets[a]]
        return out


def pad(units: Units, stage_of: List[int], replicas: List[int], opts: CostOptions, T: float) -> Optional[List[int]]:
    """Replicas using exactly K devices with no stage slower than T (None if the greedy fails).

    Each step gives the next allowed replica count to the slowest stage that
    it speeds up, else to the stage it slows least, never past T. A stage
    holding a tied weight also slows the other holders (their group grows), so
    its step counts the slowest of them, and may not push one past T (or past
    its time now, where the DP's floor already left it above T).
    """
    reps = np.array(replicas, dtype=np.int64)
    left = opts.devices - int(reps.sum())
    if left == 0 or opts.fewer_devices:
        return [int(r) for r in reps]
    allowed = np.asarray(opts.allowed_replicas(), dtype=np.int64)
    comp, par = _stage_sums(units, stage_of, len(reps))
    groups = tied_groups(units, stage_of)
    fixed = np.zeros(len(reps), dtype=bool)  # ``CostOptions.tied_replicas``: the tied stages keep their count
    if opts.tied_replicas is not None:
        fixed[[h for _, holders in groups for h in holders]] = True
    free = np.nonzero(~fixed)[0]  # held stages are never tried (each tied one costs a pass over its group)
    # where every holder of a tied weight is held, a step changes the time of its own stage only: the
    # loop then works out that stage again, not every stage (one replica a step: ~260 steps on 512 devices)
    alone = all(fixed[h] for _, holders in groups for h in holders)
    now = then = changed = None
    while left > 0:
        pos = np.searchsorted(allowed, reps, side="right")
        nxt = allowed[np.minimum(pos, len(allowed) - 1)]
        usable = (pos < len(allowed)) & (nxt - reps <= left) & ~fixed
        if now is None or not alone:
            now = group_times(comp, par, groups, reps, opts)
            then = np.full(len(reps), np.inf)
            then[free] = _times_after(comp, par, groups, reps, free, nxt[free], now, T, opts)
        else:
            one = np.array([changed])
            now[changed] = group_times(comp, par, [], reps[one], opts, one)[0]
            then[changed] = _times_after(comp, par, groups, reps, one, nxt[one], now, T, opts)[0]
        usable &= then <= T * (1 + 1e-12)
        if not usable.any():  # the next count is too slow somewhere in between (PipeDream at r = 2): look further
            jump = _first_fit_above(comp, par, groups, reps, now, left, allowed, opts, T, fixed)
            if jump is None:
                return None
            changed, r = jump
            left -= int(r - reps[changed])
            reps[changed] = r
            continue
        faster = usable & (then < now)
        changed = int(np.argmax(np.where(faster, now, -np.inf))) if faster.any() else \
            int(np.argmin(np.where(usable, then - now, np.inf)))
        left -= int(nxt[changed] - reps[changed])
        reps[changed] = nxt[changed]
    return [int(r) for r in reps]


def _times_after(comp, par, groups, reps, stages, counts, now, T: float, opts: CostOptions) -> np.ndarray:
    """Per pair (``stages[k]`` given ``counts[k]`` replicas, the others as ``reps``): that stage's time, or
    for a stage holding a tied weight the slowest of it and its partners, infinite where a partner would
    pass both T and its time ``now``."""
    trial = np.tile(np.asarray(reps, dtype=np.int64), (len(stages), 1))
    trial[np.arange(len(stages)), stages] = counts
    tied = {h for _, holders in groups for h in holders}
    out = group_times(comp, par, [], trial[np.arange(len(stages)), stages], opts, stages)
    for k in (k for k, s in enumerate(stages) if s in tied):
        times = group_times(comp, par, groups, trial[k], opts)
        worse = np.delete(times > np.maximum(now, T) * (1 + 1e-12), stages[k])
        out[k] = np.inf if worse.any() else times.max()
    return out


def _first_fit_above(comp, par, groups, reps, now, left: int, allowed, opts: CostOptions, T: float, fixed):
    """(stage, replicas) adding the fewest devices (at most ``left``) that keeps that stage (and its tied
    partners, ``_times_after``) within T; ``fixed`` stages keep their count."""
    best = None
    for s, r in enumerate(reps):
        cand = allowed[(allowed > r) & (allowed - r <= left)]
        if not cand.size or fixed[s]:
            continue
        times = _times_after(comp, par, groups, reps, np.full(cand.size, s), cand, now, T, opts)
        ok = np.nonzero(times <= T * (1 + 1e-12))[0]
        if ok.size and (best is None or cand[ok[0]] - r < best[1] - reps[best[0]]):
            best = (s, int(cand[ok[0]]))
    return best


class _PerSegment(abc.Sequence):
    """Per segment, the counts of its distinct set (``which``), each set counted (``count``) when first read."""

    def __init__(self, count: Callable[[int], np.ndarray], which: List[int]) -> None:
        self._count, self._which, self._done = count, which, {}

    def __len__(self) -> int:
        return len(self._which)

    def __getitem__(self, a: int) -> np.ndarray:
        s = self._which[a]
        if s not in self._done:
            self._done[s] = self._count(s)
        return self._done[s]


def _nearest(entries: list, T: float) -> tuple:
    """Of (T', ...) ``entries``, the one with the largest T' <= T and the one with the smallest T' >= T
    (None where there is none)."""
    below = max((e for e in entries if e[0] <= T), key=lambda e: e[0], default=None)
    above = min((e for e in entries if e[0] >= T), key=lambda e: e[0], default=None)
    return below, above


def _gathered(ends: tuple, points: tuple, which) -> tuple:
    """``_r``'s eight arguments for the pairs ``which`` (a slice or indices) of a segment: the start's then
    the end's columns (``points``: compute, weight bytes, shared users, cut per point) at the pairs'
    points (``ends``)."""
    return tuple(None if x is None else x[at]  # None: a column ``_near`` dropped
                 for e, cols in zip(ends, points) for at in (e[which],) for x in cols)  # each side's points once


def stage_compute(ci, cj, two: bool) -> np.ndarray:
    """A stage's compute from its end's and its start's (``ChainSolver.end_of``, ``start_of``): their
    difference; where nodes are bridged (``two``: a last axis of two) the larger of the bridged charge
    ``Segment.compute[i] - start[j]`` and the units' own ``plain[i] - plain[j]``, both at most what any
    plan runs there (the first falls below the second for a stage between a bridged node's two units)."""
    d = ci - cj
    return np.maximum(d.max(axis=-1) if two else d, 0.0)


def _stage_sums(units: Units, stage_of: List[int], S: int, bridged: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Compute and weight bytes per stage (a shared weight once per stage that uses it). Compute the
    units do not hold (``Units.hidden``) counts where the graph's plan puts it (``to_nodes``: a node
    folded into a unit with that unit, one left out like an input with its first reader), never after
    the first stage that forces it in: so a plan's score is never below the T at which the DP, which
    counts that compute too (``ChainSolver._late``), accepts it, and the bisection's upper end
    stays a T it can reach. ``bridged``: ``Units.bridged`` compute too, in the unit each node joined
    (a plan's score; ``pad`` leaves it out, as the DP's charge mostly does)."""
    comp, par = np.zeros(S), np.zeros(S)
    np.add.at(comp, stage_of, units.compute)
    for seconds, forcing, home, _ in units.hidden:
        if home >= 0:
            comp[stage_of[home]] += seconds
        elif forcing:
            comp[min(stage_of[u] for u in forcing)] += seconds
    for seconds, _, _, home in units.bridged if bridged else ():  # with the unit it joined, as the graph's
        comp[stage_of[home]] += seconds  # plan puts it (a score; ``pad`` keeps to what the DP charged)
    np.add.at(par, stage_of, units.param_bytes)
    for _, (nb, users) in units.shared.items():
        for s in {stage_of[u] for u in users}:
            par[s] += nb
    return comp, par


def tied_groups(units: Units, stage_of: List[int]) -> List[Tuple[float, List[int]]]:
    """(bytes, stages holding it) of every shared weight that more than one stage holds."""
    out = []
    for nb, users in units.shared.values():
        holders = sorted({stage_of[u] for u in users})
        if len(holders) > 1:
            out.append((float(nb), holders))
    return out


def group_times(comp, par, groups, reps, opts: CostOptions, which=None) -> np.ndarray:
    """Compute plus weight sync of each stage (flat options, no cuts) with every tied weight synced over
    all ranks of its holders, as ``evaluate`` charges it: ``tied_floor_s`` with the other holders'
    replicas as partners is the group's exact charge on a flat machine. ``which``: the stages that
    ``comp``, ``par`` and ``reps`` (then aligned) stand for, default all; ``groups`` then must be []."""
    idx = np.arange(len(comp)) if which is None else np.asarray(which)
    reps = np.asarray(reps, dtype=float)
    own, sync = np.asarray(par, dtype=float)[idx].copy(), np.zeros(reps.shape)
    for nbytes, holders in groups:
        others = reps[holders].sum() - reps[holders]
        own[holders] -= nbytes
        sync[holders] += tied_floor_s(nbytes, reps[holders], opts, others)
    return stage_time_s(np.asarray(comp)[idx], own, 0.0, 0.0, reps, opts) + sync


def solve(units: Units, segments: List[Segment], opts: CostOptions, deadline: float,
          score, solver: Optional[ChainSolver] = None, tolerance: float = TOLERANCE,
          ladder: Sequence[float] = (), probe_within: float = math.inf, floor: float = 0.0,
          ceiling: float = math.inf, settle_by: float = math.inf, bound_only: bool = False,
          plan_by: float = math.inf, trust_ceiling: bool = False,
          settle_above: Optional[float] = None, loose: Optional[float] = None,
          prove_by: float = -math.inf, descend: bool = False,
          settle_near: Optional[Tuple[float, float]] = None,
          fake_above: Optional[float] = None) -> Optional[ChainSolution]:
    """Bisect T (see the module docstring); ``score(stage_of, replicas)`` gives a plan's true bottleneck.

    A T that is feasible on at most K devices but whose plan the greedy cannot
    spread over exactly K (``pad``) lowers the search's upper end without
    giving a plan; the answer's bound stays the highest proven-infeasible T.
    ``solver``: the DP for one T (default the flat ``ChainSolver``; ``placed.py``
    has the two-level one); ``tolerance``: where the bisection stops;
    ``ladder``: the first T to try, as multiples of ``sum C / K``, before T
    doubles (a pass that costs more is better spent near that bound);
    ``probe_within``: check just below a plan's own time only while the bracket
    is narrower than this ratio (far from the bound a bisection step gains more);
    ``floor``: a bound on the optimum known already (the ladder starts from it);
    ``ceiling``: the time of a plan known already (the caller keeps that plan):
    when the bound is within ``PROVE_WITHIN`` of it the search tries the first
    rung of the ladder, then that time, then bisects; further apart it bisects
    between the two at once, since a pass there either raises the bound or
    finds a faster plan, where one at the ceiling could only do the second;
    that first pass sits ``PROVE_WITHIN`` below the ceiling, so that one
    infeasible pass proves the caller's plan that close (a pass near the
    bound instead would raise the bound by a rung only, and one nearer the
    ceiling, where the bound is within twice that, often finds a plan that
    scores no better than the caller's, proving nothing).
    With a ceiling the answer may then hold a bound and no plan
    (``stage_of`` None) when no pass found one faster. The bound itself is
    never tried: no plan is faster than it, so that pass would only confirm
    what is known. ``settle_by``: past this time the bisection stops once it
    holds a plan (a caller that wants a plan soon and has better uses for the
    rest of the time; ``deadline`` still bounds the search for a first plan); with ``settle_above``,
    only while the best plan scores more than that fraction above the bisection's upper end, which a
    pass that finds a plan scoring above its T lowers to that T (a relaxation whose passes find plans
    that score far above their T: ``driver._resumed``).
    ``bound_only``: cut off before any plan, answer the bound proven so far
    (``stage_of`` None) rather than None, for a caller that wants the bound
    alone (a relaxation whose plans it does not use). ``plan_by``: past this
    time without a plan the search stops, mid-pass, as if cut by the deadline
    (a caller with a faster way to a plan for the rest of the time). ``trust_ceiling``: the caller's
    plan is likely the optimum (``wide_blocks``: the coarse lattice's), so once a pass proves it within
    ``PROVE_WITHIN`` the next checks just under it, where one infeasible pass closes the search; the
    placed DPs' bracket plans are not, and a pass there mostly found a plan a hair faster.
    ``loose``: the tolerance once a pass has found a plan ``PROVE_WITHIN`` under the ceiling: the bound can
    then no longer prove the caller's plan that close, and its remaining passes only raise a fallback
    (``segment_plan.early_bound``, whose last passes the next bound needs the time of); the next pass then
    sits ``loose`` above the bound, where a plan ends the search (the relaxation under a 24-layer Llama's
    plans on 8-1,024 devices, and under the 96-layer one's on 512 and 1,024, rose nowhere above the
    closed-form floors it starts from: its passes halving the bracket down to them took up to 0.9 s).
    ``prove_by``: where later than ``deadline``, when the pass ``PROVE_WITHIN`` under the ceiling is cut
    off (the one that can prove the caller's plan that close; the later passes stop at ``deadline``).
    ``descend``: once that pass finds a plan, step down from the bracket's upper end rather than bisect
    up from the bound: the next pass ``PROVE_WITHIN`` under it, each further step twice the last, until
    a pass is infeasible, then bisect (a plan scoring under its T is still checked just under its time
    first). For a caller that keeps only the bound, whose relaxed plans score above their T, and whose
    relaxation lies near its plans (``segment_plan.finer_bound``): a bisection from a bound far below
    spends its few passes of seconds climbing.
    ``settle_near``: (width, most): the bisection stops once its bracket is within ``width`` (relative)
    while its best plan scores more than ``PROVE_WITHIN`` but at most ``most`` above the bracket's upper
    end. No pass can then prove that plan within 1 %, and the last passes would raise the bound by less
    than ``width``: a relaxation whose plans score a little above their T for a reason a restricted
    search mends (``segment_plan.chain_plan``: the folded nodes' compute) spends that time there.
    ``fake_above``: with a ceiling, the bisection stops once a pass is feasible at ``PROVE_WITHIN`` or more
    under the ceiling (no later pass can then prove the caller's plan that close) while its best plan
    scores more than this fraction above its T: a relaxation whose "plans" are not real ones, which
    would spend its remaining passes on a bound that proves nothing (``driver._cuts_exact``, ``_finer``).
    """
    solver = solver or ChainSolver(units, segments, opts)
    lo = max(sum(units.compute) / opts.devices, floor) * (1 - 1e-9)
    T, best, hi = max(lo, 1e-12), None, math.inf
    steps = [T * f for f in ladder]
    wide = ceiling < math.inf and ceiling > T * (1 + PROVE_WITHIN)
    if ceiling < math.inf:  # a bracket: just above its bound when the two are near (often the optimum), then its plan
        steps = [T * f for f in ladder[:1] if T * f < ceiling and not wide] + [ceiling]
    T = steps.pop(0) if steps else T * 2  # never the bound (lo) itself: no plan is faster
    try:
        for _ in range(0 if wide else 64):  # find a plan: up the ladder, then double T, from sum C / K
            found = _attempt(solver, units, opts, T, score, min(deadline, plan_by))
            if found is _INFEASIBLE:
                lo = T
            elif found is not _UNPADDED:
                best, hi = found, found.objective
                break
            T = steps.pop(0) if steps else T * 2
        if wide:
            hi = ceiling
        elif best is None:
            return None
        probe = best is not None and best.objective < T * (1 - tolerance) and hi <= lo * probe_within  # else bisect
        first_wide, bottom, step = wide, False, None
        while hi > lo * (1 + (loose if loose is not None and hi * (1 + PROVE_WITHIN) < ceiling else tolerance)):
            if best is not None and time.monotonic() > settle_by and \
                    (settle_above is None or best.objective > hi * (1 + settle_above)):
                break
            if settle_near is not None and best is not None and hi <= lo * (1 + settle_near[0]) \
                    and hi * (1 + PROVE_WITHIN) < best.objective <= hi * (1 + settle_near[1]):
                break
            # ``fake_above``: the first pass sits at ceiling / (1 + PROVE_WITHIN), rounded: SLACK absorbs that
            if fake_above is not None and best is not None and hi * (1 + PROVE_WITHIN) <= ceiling * (1 + SLACK) \
                    and best.objective > hi * (1 + fake_above):
                break
            if probe:  # the plan's own time is often the optimum: check just below it first
                T = max(hi / (1 + tolerance), lo)
            else:
                T = math.sqrt(lo * hi) if hi > lo * 1.01 else (lo + hi) / 2
            proving = first_wide
            if first_wide:  # one pass may prove the caller's plan within PROVE_WITHIN (or beat it by that)
                T, first_wide = hi / (1 + PROVE_WITHIN), False
            elif bottom and lo * (1 + loose) < hi:  # ``loose``: just above the bound, where a plan ends the search
                T = lo * (1 + loose)
            elif step is not None and not probe and hi / (1 + step) > lo * (1 + tolerance):  # ``descend``
                T = hi / (1 + step)
            found = _attempt(solver, units, opts, T, score, max(deadline, prove_by) if proving else deadline,
                             deadline if proving else math.inf)
            probe = not probe and isinstance(found, tuple) and found.objective < T * (1 - tolerance) \
                and hi <= lo * probe_within
            # proven within PROVE_WITHIN: where the caller's plan is likely the optimum, one pass just under it proves it
            probe = probe or (trust_ceiling and proving and found is _INFEASIBLE)
            bottom = proving and loose is not None and found is not _INFEASIBLE
            if descend:  # down from the upper end while passes find plans; bisect from the first that fails
                if found is _INFEASIBLE:
                    step = None
                elif step is not None or proving:
                    step = PROVE_WITHIN if step is None else 2 * step
            if found is _INFEASIBLE:
                lo = T
            elif found is _UNPADDED:
                hi = T
            else:  # on a two-level machine a plan may score above T (``placed.py`` charges cuts at their cheapest)
                best = found if best is None else min(best, found, key=lambda f: f.objective)
                hi = min(found.objective, T)
    except DeadlineExceeded:
        if best is None and ceiling == math.inf and not bound_only:
            return None
    if best is None:  # only with a ceiling: the bound the passes proved, the caller's plan stands
        return ChainSolution(None, None, math.inf, min(lo, ceiling), False)
    bound = min(lo, best.objective)
    return ChainSolution(*best, bound, best.objective <= bound * (1 + tolerance))


_INFEASIBLE, _UNPADDED = "infeasible", "unpadded"


def _attempt(solver: ChainSolver, units: Units, opts: CostOptions, T: float, score, deadline: float,
             soft: float = math.inf):
    """A plan at most T (stage per unit, replicas, its bottleneck), ``_INFEASIBLE`` (more than K
    devices needed: a proof), or ``_UNPADDED`` (fits on fewer, but not spread over exactly K).
    Past ``soft`` the pass runs on to ``deadline`` only at a pace that ends by then
    (``memory_guard.pass_deadline``).

    The pass runs at T widened by ``SLACK``: a stage's compute there is a difference of prefix sums,
    which rounds apart from the plan's own sum (and, on repeated blocks, from the equal stage whose
    row the pass reads, ``ChainSolver._pool_r``), so a pass at exactly a known plan's time (the
    bisection tries the ceiling it is given) could find that plan too slow by an ulp and take T
    for a bound: on 96 H100-profiled blocks on 8 devices it then climbed from twice T and ran out
    of time. Infeasible at T(1 + SLACK) is infeasible at T: the bound stays a bound."""
    T = T * (1 + SLACK)
    need, back = solver.devices_needed(T, deadline, soft)
    if need > opts.devices:
        return _INFEASIBLE
    stage_of, reps = solver.plan(back)
    reps = solver.pad(stage_of, reps, T)
    if reps is None:
        return _UNPADDED
    return Solution(stage_of, reps, score(stage_of, reps))


def stage_totals(units: Units, stage_of: List[int], S: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute, weight bytes and the bytes crossing into each stage (``cut[s]``, s = 0..S) of a plan."""
    comp, par = _stage_sums(units, stage_of, S, bridged=True)
    cut = np.zeros(S + 1)
    for unit, nbytes, consumers in units.producers:
        cut[stage_of[unit] + 1: max(stage_of[c] for c in consumers) + 1] += nbytes
    for nbytes, holders, needers, blockers in units.hidden_sends:  # sent on from its first holder's stage (or
        # its last blocker's, if later), as the plan places them, to its last needer's
        first = max([min(stage_of[c] for c in holders)] + [stage_of[b] for b in blockers])
        cut[first + 1: max(stage_of[c] for c in needers) + 1] += nbytes
    return comp, par, cut


def unit_bottleneck(units: Units, stage_of: List[int], replicas: List[int], opts: CostOptions) -> float:
    """A plan's bottleneck on ``units`` as ``costmodel.evaluate`` charges it (flat or two-level; each
    tied weight synced over every rank of every stage holding it)."""
    S = len(replicas)
    comp, par, cut = stage_totals(units, stage_of, S)
    reps = np.asarray(replicas, dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(reps)[:-1]])
    ranks = [list(range(f, f + r)) for f, r in zip(firsts, reps)]
    times = comp / reps
    for nbytes, holders in tied_groups(units, stage_of):
        group = [x for h in holders for x in ranks[h]]
        for h in holders:
            par[h] -= nbytes
            times[h] += tied_sync_s(nbytes, ranks[h], group, opts)
    times += [allreduce_at(p, int(f), int(r), opts) for p, r, f in zip(par, reps, firsts)]
    for b in range(S - 1):
        if cut[b + 1] > 0:
            c = cut_at(cut[b + 1], int(firsts[b]), int(reps[b]), int(reps[b + 1]), opts)
            times[b] = max(times[b], c)
            times[b + 1] = max(times[b + 1], c)
    return float(times.max())
