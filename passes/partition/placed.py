"""The segment DP on a two-level machine: devices used so far, modulo the node size, in the state.

Stages sit on contiguous ranks (``topology.py``), so a stage's first rank is
the number of devices used before it. Under the fxpipe cost model a stage of r
replicas starting at rank d runs its all-reduce ring at the intra-node
bandwidth B1 iff it stays in one node, ``d mod G + r <= G``, and at B2
otherwise; shifting every stage by a whole node changes no charge. So for a
bottleneck T the DP keeps, for every point of the lattice (``segments.py``)
and every offset m = d mod G, the fewest devices d ≡ m that bring the prefix
under T (``PlacedChainSolver.devices_needed``); fewer devices with the same
offset are never worse, since everything after depends on d only through m
and the devices left.

For a stage (j, i) the replica counts that meet T form an interval at each
bandwidth (``offsets.intervals``: compute/r plus the ring, ``(C - a)/r + a`` with
``a = 2P/B``, is monotone in r). From offset m the counts r <= G - m use the
B1 interval and end at offset m + r; the others use the B2 interval, and when
it is unbounded above they reach every count from its start on, so one number
per pair (``offsets.crossing_start``) yields all G offsets. Both steps are table
look-ups per (source point, offset), so a pass costs G times fewer steps
than trying every offset pair.

Each cut is charged the least any placement allows (``offsets.cut_floors``: B2 on a
side with a rank whose partners all sit in other nodes, else B1): T
infeasible is still a proof, and the plan found is scored placed by the
caller (``costmodel.evaluate``). (``charged.py``'s ``exact_cuts`` puts the
previous stage's count in the state, ``R`` classes of it beside the G offsets,
and charges each cut exactly.) Where no cut limits the bottleneck
(activations are small against the weights' all-reduce) the plan meets T and
the bound is exact. A prefix that leaves more compute than its spare devices
can run within T (every later stage needs compute / T replicas) is dropped,
so a T far below the optimum fails within a few segments.

The interval look-ups serve the fxpipe cost model with replication ``any``.
PipeDream's hierarchical all-reduce depends on how a crossing stage splits
over nodes, and ``pow2`` counts reach only some offsets, so there
``charged.ChargedChainSolver`` tries each candidate count at every offset with the
exact all-reduce charge instead (``charged.solver_for`` picks). Replication ``none``
and memory limits are bracketed by the driver with the flat models.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from passes.costgraph import closure
from passes.partition.chain import ChainSolver, _stage_sums, stage_compute, unit_bottleneck
from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions, allreduce_at, flat_bound, stage_time_s, tied_floor_s
from passes.partition.segments import Segment
from passes.partition.canon import Canon
from passes.partition.pool_rows import RowStore
from passes.partition.offsets import (EPS, Sources, Stages, crossing_start, cut_floors, every_offset,
                                      intervals, targets, tied_intervals)

TOLERANCE = 8e-4  # where the bisection stops (relative): a pass costs more than a flat one
PROBE_WITHIN = 1.05  # bracket (hi / lo) below which the bisection checks just under a plan's time
POOL_PAIRS = 1 << 20  # about the most pool stages one pass keeps for equal blocks to read (``_pool_stages``, ~100 B each)
TIE_PASSES = 6  # passes per T the search over a tied weight's holders may take (``devices_needed``)
SETTLE_ABOVE = 0.04  # past ``settle_by`` the bisection stops only while its best plan scores this far above
# the bisection's upper end (a pass whose plan scores above its T lowers that end to T): its plans then come
# from elsewhere (``driver._resumed``). H100-profiled GPT, 32 blocks, two-level: the plans found at T scored
# 1.06-1.18 T on 256 and 512 devices (settling there: 4.3 -> 1.0 % and 9.9 -> 1.0 %), 1.02-1.03 T on 128
# and up to 1.002 T on 16, where the bisection's bound needs the time
SETTLE_WITHIN = 0.004  # under PipeDream's charges the bisection stops once its bracket is this narrow ...
SETTLE_NEAR = 0.04  # ... while its best plan scores 1 % to this far above the upper end (``segment_plan._settle_near``)
LADDER = (1.005, 1.01, 1.02, 1.04, 1.08, 1.3, 1.6)  # first T tried, times sum C / K: optima sit close above it,
# and a T far below one fails fast (prefixes that cannot finish are dropped)


def supports(opts: CostOptions) -> bool:
    """Whether this DP is exact for ``opts`` (see the module docstring)."""
    return opts.gpus_per_node is not None and opts.replication in ("any", "pow2") and opts.memory is None


def _two_user_tie(units: Units):
    """(weight index, its two user columns in ``Segment.shared``'s flags, the two user units) of the
    largest shared weight with exactly two users, or None."""
    best, col = None, 0
    for w, (nbytes, users) in enumerate(units.shared.values()):
        if len(users) == 2 and (best is None or nbytes > best[0]):
            best = (nbytes, (w, col, col + 1, users[0], users[1]))
        col += len(users)
    return None if best is None else best[1]


def _split_holders(holders, r0: int, r1: int) -> list:
    """The ranges to search next when a plan's holder counts are not the least its ranges charged:
    the first range (else the second) split at the plan's count, that count alone last so it is
    tried first."""
    for side, r in ((0, r0), (1, r1)):
        least, most = holders[side]
        if r == least:
            continue
        parts = [(r + 1, most), (least, r - 1), (r, r)]
        return [tuple(part if k == side else holders[k] for k in (0, 1)) for part in parts if part[0] <= part[1]]
    return []


class PlacedChainSolver(ChainSolver):
    """``ChainSolver`` whose state is (point, devices used mod G); see the module docstring."""

    SPLIT_HOLDERS = True  # search the counts of a tied weight's holders (``devices_needed``)

    def __init__(self, units: Units, segments: List[Segment], opts: CostOptions) -> None:
        super().__init__(units, segments, opts)
        self.G = int(opts.gpus_per_node)
        self.R = 1  # classes of the previous stage's count in the state (``charged.py`` keeps them under pow2)
        self.flat = (flat_bound(opts, fast=True), flat_bound(opts, fast=False))  # every link at B1 / at B2
        self.end_offset = 0
        self._near_stages: Dict[int, tuple] = {}
        self._levels_of: Dict[int, list] = {}  # per segment (``_levels``), shared by equal segments
        self._narrower: Dict[int, tuple] = {}  # per segment: pairs whose end cuts no more than their start
        self._canon = Canon()  # equal arrays of repeated segments kept once
        self._intervals_at: Tuple[tuple, dict] = ((), {})
        self._pool_rows: Tuple[tuple, dict] = ((), {})  # ((T, holders), width -> ``RowStore``) (``_pool_stages``)
        self._seg_at = {id(seg): a for a, seg in enumerate(segments)}
        self.far_first_below, self.far_last_below = self._far_below()
        K = opts.devices
        self.holders = ((1, K), (1, K))  # counts the stages holding ``self.tie``'s two users may have
        self.tie = _two_user_tie(units) if K > self.G and not opts.fewer_devices else None

    def _far_below(self) -> Tuple[np.ndarray, np.ndarray]:
        """Per shared weight, the bottleneck below which a first stage holding it (then a last one)
        syncs it across nodes: +inf where that holds at every T, 0 where the DP cannot tell.

        With more than one node the first stage (from rank 0) and the last (to rank K - 1) sit in
        different nodes. So a weight the last stage holds whatever the plan (a user is the last unit
        with compute, which every other unit with compute precedes) is synced at B2 by the first stage
        whenever it holds it, and the other way round. Otherwise a first stage holding the weight
        shares a node with the holder of its user u only if every stage up to that holder sits in
        node 0, so at most G devices run u and all its ancestors: never when their compute exceeds
        G·T; likewise a last stage with u's descendants. The DP gives the first stage compute."""
        units, n = self.units, len(self.units)
        none = np.zeros(len(units.shared))
        work = [u for u in range(n) if units.has_compute[u]]
        if not work or not units.shared or self.opts.devices <= self.G or self.opts.fewer_devices:
            return none, none.copy()
        succ: List[List[int]] = [[] for _ in range(n)]
        pred: List[List[int]] = [[] for _ in range(n)]
        for a, b in units.edges:
            succ[a].append(b)
            pred[b].append(a)

        first, last = work[0], work[-1]
        first_ok = set(work) <= closure(first, succ)
        last_ok = set(work) <= closure(last, pred)
        compute = np.asarray(units.compute, dtype=float)
        reach = lambda u, nxt: compute[sorted(closure(u, nxt))].sum() / self.G  # noqa: E731
        below_first, below_last = none.copy(), none.copy()
        for w, (_, users) in enumerate(units.shared.values()):
            if last_ok and last in users:
                below_first[w] = np.inf
            else:
                below_first[w] = max((reach(u, pred) for u in users), default=0.0)
            if first_ok and first in users:
                below_last[w] = np.inf
            else:
                below_last[w] = max((reach(u, succ) for u in users), default=0.0)
        return below_first, below_last

    def _far(self, first, last, shares, T: float):
        """Per stage, the bytes of its shared weights synced across nodes for sure at T (``_far_below``)."""
        if shares is None:
            return np.zeros(first.shape)
        far = (first[:, None] & (self.far_first_below > T)[None, :]) \
            | (last[:, None] & (self.far_last_below > T)[None, :])
        return (shares & far) @ self.shared_bytes

    def _stages(self, cj, pj, sj, cutj, ci, pi, si, cuti, first=False, last=False):
        """What ``_stage_intervals`` needs of stages (j, i) (arrays that broadcast, flattened): compute,
        weight bytes, cuts in and out, weight bytes another stage holds too, whether the stage starts at
        the empty point (``first``) and whether it ends at the full one (``last``), which weights it
        shares and its users' flags at j and at i (``ChainSolver._held``)."""
        params, tied, shares, flags = self._held(pi - pj, sj, si)
        C, cut_in, cut_out = np.broadcast_arrays(stage_compute(ci, cj, self.two), cutj, cuti)
        flat = lambda x: np.broadcast_to(x, C.shape).ravel()  # noqa: E731
        rows = lambda x: np.broadcast_to(x, C.shape + x.shape[-1:]).reshape(C.size, -1)  # noqa: E731
        return (C.ravel(), flat(params), cut_in.ravel(), cut_out.ravel(), flat(tied),
                flat(np.asarray(first)), flat(np.asarray(last)), None if shares is None else rows(shares),
                None if flags is None else tuple(rows(f) for f in flags))

    def _stage_intervals(self, stages, T: float) -> Stages:
        """Replica counts of ``stages`` (from ``_stages``) by placement (``Stages``).

        A stage sharing a weight syncs it over its ranks and at least ``partners`` more
        (``ChainSolver._partner_count``): at B2 when the stage crosses nodes or a partner sits on
        another node for sure (``_far``), else at least at B1 (``costmodel.tied_floor_s`` on the flat
        models of each rate)."""
        C, params, cut_in, cut_out, tied, first, last, shares, flags = stages
        far = self._far(first, last, shares, T)
        o = self.opts
        lo1, hi1 = intervals(C, params, T, o.intra_bw, o.devices)  # one replica never crosses nodes
        lo2, hi2 = intervals(C, params, T, o.bandwidth, o.devices)
        some = np.nonzero(tied > 0)[0]
        if some.size:
            held = tuple(f[some] for f in flags)
            q = self._partner_count(shares[some], held, T, self._holder_floor(held))
            c, p, t, f = C[some], params[some], tied[some], far[some]
            fast, slow = self.flat
            inside = lambda r, k: (stage_time_s(c[k], p[k] - f[k], 0.0, 0.0, r, fast, t[k] - f[k], q[k])  # noqa: E731
                                   + tied_floor_s(f[k], r, slow, q[k]))
            across = lambda r, k: stage_time_s(c[k], p[k], 0.0, 0.0, r, slow, t[k], q[k])  # noqa: E731
            lo1[some], hi1[some] = tied_intervals(inside, some.size, T, o.devices)
            lo2[some], hi2[some] = tied_intervals(across, some.size, T, o.devices)
        lo1 = np.where(first & (C <= 0), o.devices + 1, lo1)  # the first stage has compute (``_far_below``)
        for at, (least, most) in zip(self._holding(flags), self.holders):  # counts the holders are held to
            lo1, lo2 = np.where(at, np.maximum(lo1, least), lo1), np.where(at, np.maximum(lo2, least), lo2)
            hi1, hi2 = np.where(at, np.minimum(hi1, most), hi1), np.where(at, np.minimum(hi2, most), hi2)
        near, in_far, out_far = cut_floors(cut_in, cut_out, T, o)
        lo1 = np.maximum(lo1, near)
        return Stages(lo1, np.maximum(lo1, out_far), in_far, hi1, np.maximum(lo2, np.maximum(in_far, out_far)), hi2)

    def _holding(self, flags):
        """Per stage, whether it holds each of ``self.tie``'s two users (False without one)."""
        if self.tie is None or flags is None:
            return (False, False)
        at_j, at_i = flags
        return tuple(at_i[:, c] - at_j[:, c] > 0.5 for c in self.tie[1:3])

    def _holder_floor(self, flags):
        """Partners per (stage, shared weight) that ``holders`` guarantee: a stage holding one user of
        the tied weight but not the other has at least the other's least count of partners for it;
        None while both ranges are open."""
        (a0, _), (a1, _) = self.holders
        if a0 <= 1 and a1 <= 1:
            return None
        has0, has1 = self._holding(flags)
        floor = np.ones(flags[0].shape[:1] + self.shared_bytes.shape)
        floor[:, self.tie[0]] = np.where(has1 & ~has0, a0, np.where(has0 & ~has1, a1, 1))
        return floor

    def devices_needed(self, T: float, deadline: float = math.inf, soft: float = math.inf):
        """(devices for the whole graph, back-pointers ``(point, state, replicas)`` per point and state: the
        offset within a node, and with ``charged.py``'s ``exact_cuts`` the previous stage's count class).

        A stage sharing a weight is charged the ring over its own ranks and only the fewest its partners
        can have, so where two stages on different nodes share a large weight (GPT's embedding and
        head) a plan found at T may sync over more ranks and score above it. For the largest weight
        with two users (``self.tie``) the counts of the stages holding them are then searched by
        branch and bound (``_split_holders``): the pass is rerun with the first holder (else the
        second) held to the count the plan gave it, below it and above it, each range charging the
        other holder its least; T is infeasible when every range is, and the answer stands once a
        plan's holder counts are the ones charged or it meets T as ``evaluate`` charges it. At most
        ``TIE_PASSES`` passes per T: past them the first plan is returned (T not proven infeasible, as
        without the search). Past ``soft`` a pass goes on to ``deadline`` only at a pace that ends by then
        (``memory_guard.pass_deadline``)."""
        K = self.opts.devices
        if not self.SPLIT_HOLDERS or self.tie is None:
            return self._needed(T, deadline, soft)
        todo, first, back = [((1, K), (1, K))], None, None
        try:
            for _ in range(TIE_PASSES):
                if not todo:
                    break
                self.holders = todo.pop()
                need, back = self._needed(T, deadline, soft)
                if need > K:
                    continue
                first = first or (need, back, self.end_offset)
                stage_of, reps = self.plan(back)
                s0, s1 = stage_of[self.tie[3]], stage_of[self.tie[4]]
                split = _split_holders(self.holders, reps[s0], reps[s1]) if s0 != s1 else []
                padded = self.pad(stage_of, reps, T) if split else None
                if padded is not None and unit_bottleneck(self.units, stage_of, padded, self.opts) <= T * (1 + EPS):
                    split = []  # the plan meets T as it is charged: nothing to prove
                if not split:
                    return need, back
                todo += split
            if not todo:
                return K + 1, back
            need, back, self.end_offset = first
            return need, back
        finally:
            self.holders = ((1, K), (1, K))

    def _needed(self, T: float, deadline: float = math.inf, soft: float = math.inf):
        """``devices_needed`` with the tied weight's holders held to ``holders``."""
        K, G = self.opts.devices, self.G
        began, self.deadline = time.monotonic(), deadline
        S = G * self.R  # states per point: offset within a node, and the previous stage's count class
        total = self.offsets[-1]
        dev_all = np.full((total, S), K + 1, dtype=np.int64)
        back = np.zeros((total, S, 3), dtype=np.int64)
        pool = None  # earlier points that may still start a stage (``_from_pool``)
        for a, seg in enumerate(self.segs):
            self._segment_deadline(a, began, soft, deadline)  # a charged pass checks it inside too (``charged.py``)
            d, off = len(seg.compute), self.offsets[a]
            dev = np.full((d, S), K + 1, dtype=np.int64)
            src_b = np.zeros((d, S, 3), dtype=np.int64)
            if a == 0:
                dev[0, 0] = 0
            rest = self._rest(seg, T)  # prefixes that cannot finish are dropped (``ChainSolver._rest``)
            reach = None
            if pool is not None and pool[0].size:
                reach = self._from_pool(pool, seg, T, dev, src_b, dev_all, rest)
                dev[dev + rest[:, None] > K] = K + 1
            if seg.sub_j.size:
                self._inside(seg, off, T, dev, src_b, rest)
                dev[dev + rest[:, None] > K] = K + 1
            dev_all[off:off + d] = dev
            back[off:off + d] = src_b
            pool = self._next_pool_placed(pool, reach, seg, off, dev, dev_all)
            if not pool[0].size:
                return K + 1, back
        last = dev_all[-1]
        if self.opts.fewer_devices:
            self.end_offset = int(last.argmin())
        else:  # K devices end on a node boundary: offset 0, whatever the last stage's count
            self.end_offset = int(last[::G].argmin()) * G
        return int(last[self.end_offset]), back

    def _from_pool(self, pool, seg: Segment, T: float, dev, src_b, dev_all, rest=None):
        """Stages from pool points to this segment's points; returns which pool points still reach.

        ``pool``: (global ids, compute, params, shared counts, cut) of the earlier points. A stage
        that crosses nodes with counts unbounded above reaches every offset from one number on, and
        the least such number over all sources gives the same for a target
        (``offsets.every_offset`` is monotone), so those pairs reduce before the offsets are spread; only
        stages that fit in a node or are bounded above go through ``offsets.targets`` pair by pair.
        ``rest``: per point of ``seg``, the devices the compute after it needs at T (``_needed``); the
        interval look-ups here do not use it, the charged DP skips counts with it (``charged.py``).
        """
        K, G = self.opts.devices, self.G
        ids = pool[0]
        d, n = len(seg.compute), ids.size
        s = np.repeat(np.arange(n), d + 1)
        st = self._pool_stages(pool, seg, T)
        rows = dev_all[ids]
        src = Sources(rows, G, K)
        start, start_m = crossing_start(src, s, st.lo2, st.hi2, G, K)
        start = start.reshape(n, d + 1)
        first = start.argmin(axis=0)
        val = every_offset(start[first, np.arange(d + 1)], G)  # (d + 1, G)
        from_row = np.broadcast_to(first[:, None], val.shape).copy()
        reach = start[:, d] <= K
        small = np.nonzero((st.lo1 <= np.minimum(st.hi1, G)) | ((st.hi2 < K) & (st.lo2 <= st.hi2)))[0]
        if small.size:
            vs = targets(src, s[small], st.take(small), G, K, crossing=False)
            dense = np.full((n * (d + 1), G), K + 1, dtype=np.int64)
            dense[small] = vs
            dense = dense.reshape(n, d + 1, G)
            reach |= (dense[:, d, :] <= K).any(axis=1)
            k = dense.argmin(axis=0)
            got = np.take_along_axis(dense, k[None], axis=0)[0]
            better = got < val
            val = np.where(better, got, val)
            from_row = np.where(better, k, from_row)
        else:
            better = np.zeros(val.shape, dtype=bool)
        val = np.where(val <= K, val, K + 1)
        xs, ms = np.nonzero(val[:d] < dev)
        if not xs.size:
            return reach
        row = from_row[xs, ms]
        pair = row * (d + 1) + xs
        via = better[xs, ms]
        got_m = start_m[pair]
        if via.any():
            p = pair[via]
            _, fm, _ = targets(src, s[p], st.take(p), G, K, want_from=True, crossing=False)
            got_m[via] = fm[np.arange(p.size), ms[via]]
        dev[xs, ms] = val[xs, ms]
        src_b[xs, ms, 0] = ids[row]
        src_b[xs, ms, 1] = got_m
        src_b[xs, ms, 2] = val[xs, ms] - rows[row, got_m]
        return reach

    def _pool_stages(self, pool, seg: Segment, T: float):
        """``_stage_intervals`` of every stage from a pool point (rows) to a point of ``seg`` or past
        its end (columns: the segment's points, then its last point with no cut after it), flattened;
        each row worked out once per T (and holders' ranges) among equal ones (``ChainSolver._pool_r``:
        a charged pass near the optimum on 96 blocks and 256 devices, 5.5 s before, 4.6 s with it) and
        kept in a ``pool_rows.RowStore``; where some rows were known, the answer gathers each field
        when it is read (``pool_rows.Gathered``)."""
        if self._pool_rows[0] != (T, self.holders):
            self._pool_rows = ((T, self.holders), {})
        stores, keys = self._pool_rows[1], self.row_keys(self._seg_at[id(seg)], pool[0])
        width = len(seg.compute) + 1
        store = stores.get(width)
        if store is None:
            store = stores[width] = RowStore(width)
        slots = store.find(keys)
        miss = np.nonzero(slots < 0)[0]
        if not miss.size:
            return store.view(slots)
        got = self._pool_stages_of(tuple(x[miss] for x in pool), seg, T)
        room = (POOL_PAIRS - sum(st.kept * st.width for st in stores.values())) // width
        slots[miss] = store.put(got, [keys[k] for k in miss], room)
        return got if miss.size == slots.size else store.view(slots)

    def _pool_stages_of(self, pool, seg: Segment, T: float):
        """``_pool_stages`` worked out for every row of ``pool``."""
        ids, pc, pp, ps, pcut = pool
        d = len(seg.compute)
        end = self.end_of(seg)
        cc, cp = np.concatenate([end, end[-1:]]), np.append(seg.params, seg.params[-1])
        cs, ccut = np.vstack([seg.shared, seg.shared[-1:]]), np.append(seg.cut, 0.0)
        ends = np.zeros(d + 1, dtype=bool)
        ends[d - 1] = seg is self.segs[-1]
        return self._stage_intervals(self._stages(pc[:, None], pp[:, None], ps[:, None], pcut[:, None],
                                                  cc[None], cp[None], cs[None], ccut[None],
                                                  (ids == 0)[:, None], ends[None, :]), T)

    def _inside(self, seg: Segment, off: int, T: float, dev, src_b, rest=None) -> None:
        """Stages with both ends in this segment, level by level (``_levels``): every pair once
        (``rest``: see ``_from_pool``)."""
        K, G = self.opts.devices, self.G
        j = seg.sub_j
        st = self._near_intervals(seg, off, T)
        src = Sources(dev, G, K)  # rows of a level are final before any later level reads them
        for pairs, starts, ends in self._levels(seg):
            s, some = j[pairs], st.take(pairs)
            val = targets(src, s, some, G, K, crossing=False)
            key = val * (1 << 32) + np.arange(pairs.size)[:, None]
            mins = np.minimum.reduceat(key, starts, axis=0)  # (targets, G)
            # crossing stages unbounded above: the least start per target spreads over every offset
            start, _ = crossing_start(src, s, some.lo2, some.hi2, G, K)
            first = np.minimum.reduceat(start * (1 << 32) + np.arange(pairs.size), starts)
            cross = every_offset(first >> 32, G)
            use = cross < (mins >> 32)
            best_val = np.where(use, cross, mins >> 32)
            idx = np.where(use, (first & ((1 << 32) - 1))[:, None], mins & ((1 << 32) - 1))
            best_val = np.where(best_val <= K, best_val, K + 1)
            rows, ms = np.nonzero(best_val < dev[ends])
            if not rows.size:
                continue
            x, k = ends[rows], idx[rows, ms]
            got, from_m, reps = targets(src, s[k], some.take(k), G, K, want_from=True)
            pick = np.arange(k.size)
            dev[x, ms] = got[pick, ms]
            src_b[x, ms, 0] = off + s[k]
            src_b[x, ms, 1] = from_m[pick, ms]
            src_b[x, ms, 2] = reps[pick, ms]
            src.refresh(np.unique(x))

    def _near_pairs(self, seg: Segment, off: int):
        """``_stages`` of the pairs (j, i) with both ends in ``seg`` (the same for every T); segments
        of repeated blocks give equal arrays and share one tuple (``_near_intervals``)."""
        key = id(seg)
        if key not in self._near_stages:
            j, i = seg.sub_j, seg.sub_i
            compute, params = self._own_sums(seg)  # equal in repeated blocks (``ChainSolver._own_sums``)
            stages = self._stages(self._own_start(seg)[j], params[j], seg.shared[j], seg.cut[j],
                                  compute[i], params[i], seg.shared[i], seg.cut[i],
                                  (j == 0) & (off == 0), (i == len(seg.compute) - 1) & (seg is self.segs[-1]))
            self._near_stages[key] = self._canon.get(stages)
        return self._near_stages[key]

    def _near_intervals(self, seg: Segment, off: int, T: float):
        """``_stage_intervals`` of ``_near_pairs``, once per T for all segments with equal pairs."""
        stages = self._near_pairs(seg, off)
        if self._intervals_at[0] != (T, self.holders):
            self._intervals_at = ((T, self.holders), {})
        found = self._intervals_at[1]
        if id(stages) not in found:
            found[id(stages)] = self._stage_intervals(stages, T)
        return found[id(stages)]

    def _levels(self, seg: Segment):
        """The pairs of ``seg`` grouped by the size of their end point, smallest first: (pair indices,
        where each target's run starts, the targets). A pair's start is a strict subset of its end, so
        every start sits on a lower level and is final when its level comes: one sweep does what
        repeating all pairs until nothing improves did, touching each pair once."""
        if id(seg) not in self._levels_of:
            i = seg.sub_i
            size = seg.member.sum(axis=1)[i]
            same = self._canon.get((seg.sub_j, i, size))  # an equal earlier segment's arrays, if any
            if id(same) not in self._levels_of:
                order = np.argsort(size, kind="stable")  # within a level the ends stay sorted
                bounds = np.r_[0, np.nonzero(np.diff(size[order]))[0] + 1, order.size]
                out = []
                for a, b in zip(bounds[:-1], bounds[1:]):
                    pairs = order[a:b]
                    ends = i[pairs]
                    starts = np.r_[0, np.nonzero(np.diff(ends))[0] + 1]
                    out.append((pairs, starts, ends[starts]))
                self._levels_of[id(same)] = out
            self._levels_of[id(seg)] = self._levels_of[id(same)]
        return self._levels_of[id(seg)]

    def _next_pool_placed(self, pool, reach, seg: Segment, off: int, dev, dev_all):
        """Earlier points that may still start a stage: dropped when they can no longer reach, or when a
        later point holds them with no more devices at every offset and no more bytes cut."""
        K = self.opts.devices
        keep = (dev <= K).any(axis=1)
        if seg.sub_j.size:
            if id(seg) not in self._narrower:  # the same for every T
                narrower = np.nonzero(seg.cut[seg.sub_i] <= seg.cut[seg.sub_j])[0]
                self._narrower[id(seg)] = (seg.sub_j[narrower], seg.sub_i[narrower])
            j, i = self._narrower[id(seg)]
            beaten = (dev[i] <= dev[j]).all(axis=1)
            keep[j[beaten]] = False
        new = (off + np.nonzero(keep)[0], self.start_of(seg)[keep], seg.params[keep], seg.shared[keep], seg.cut[keep])
        if pool is None or not pool[0].size:
            return new
        old_dev, new_dev = dev_all[pool[0]], dev_all[new[0]]
        beaten = ((new_dev[None, :, :] <= old_dev[:, None, :]).all(axis=2)
                  & (new[4][None, :] <= pool[4][:, None])).any(axis=1)
        alive = ~beaten & reach
        return tuple(np.concatenate([old[alive], fresh]) for old, fresh in zip(pool, new))

    def _walk(self, back: np.ndarray) -> Tuple[List[int], List[int]]:
        chain, reps = [], []
        x, m = self.offsets[-1] - 1, self.end_offset
        while True:
            chain.append(x)
            if x == 0:
                break
            j, mj, r = (int(v) for v in back[x, m])
            reps.append(r)
            x, m = j, mj
        return chain[::-1], reps[::-1]

    def pad(self, stage_of: List[int], replicas: List[int], T: float) -> Optional[List[int]]:
        """Whole nodes added to stages (so no later stage moves within its node) until K devices are
        used, each to the slowest stage it speeds up without passing T (the next allowed count that
        adds whole nodes); None if none can take one."""
        return pad_placed(self.units, stage_of, replicas, self.opts, T)


def _placed_times(comp, par, reps: np.ndarray, opts: CostOptions) -> np.ndarray:
    firsts = np.concatenate([[0], np.cumsum(reps)[:-1]])
    return np.array([c / r + allreduce_at(p, int(f), int(r), opts) for c, p, r, f in zip(comp, par, reps, firsts)])


def pad_placed(units: Units, stage_of: List[int], replicas: List[int], opts: CostOptions,
               T: float) -> Optional[List[int]]:
    reps = np.array(replicas, dtype=np.int64)
    left = opts.devices - int(reps.sum())
    if left == 0 or opts.fewer_devices:
        return [int(r) for r in reps]
    G = int(opts.gpus_per_node)
    if left % G:
        return None
    comp, par = _stage_sums(units, stage_of, len(reps))
    allowed = np.asarray(opts.allowed_replicas(), dtype=np.int64)
    while left > 0:
        now = _placed_times(comp, par, reps, opts)
        best, pick = None, None
        for s in range(len(reps)):
            grown = allowed[(allowed > reps[s]) & ((allowed - reps[s]) % G == 0) & (allowed - reps[s] <= left)]
            if not grown.size:  # pow2: only counts of at least G grow by whole nodes
                continue
            trial = reps.copy()
            trial[s] = grown[0]
            then = _one_time(comp[s], par[s], trial, s, opts)
            if then > T * (1 + 1e-12):
                continue
            key = (0, -now[s]) if then < now[s] else (1, then - now[s])
            if best is None or key < best:
                best, pick = key, (s, int(grown[0]))
        if pick is None:
            return None
        s, count = pick
        left -= count - int(reps[s])
        reps[s] = count
    return [int(r) for r in reps]


def _one_time(c: float, p: float, reps: np.ndarray, s: int, opts: CostOptions) -> float:
    first = int(reps[:s].sum())
    return c / int(reps[s]) + allreduce_at(p, first, int(reps[s]), opts)


