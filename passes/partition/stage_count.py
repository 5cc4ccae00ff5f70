"""The segment DP for ``--replication none`` on exactly K devices: which stage counts reach each point.

Without replication a plan on K devices has exactly K stages, and fewer
stages cannot be padded with replicas, so the fewest-devices DP of
``chain.py`` does not answer it. Here, for a bottleneck T, every point x of
the lattice (``segments.py``) gets the set of counts k such that some plan of
k stages, each within T on one device, ends at x
(``reach[x, k]``): a stage (j, x) that meets T adds one to every count of j.
T is feasible iff K is in the set of the full point, which is also necessary
for any plan, so an infeasible T is a proof as in ``chain.py``; the same
bisection (``chain.solve``) runs on it.

Earlier points that may still start a stage form a pool as in ``chain.py``
(dropped when no stage from them to the current segment's last point meets T,
or when a later point reaches every count they reach and cuts no more bytes),
and a count that leaves more compute than its remaining stages can hold
within T (``ceil(rest / T)`` of them) is dropped. The plan is read back
from the full point with count K, one stage at a time, choosing any earlier
point that reaches k - 1 and starts a stage that meets T.
"""
from __future__ import annotations

import math
import time
from typing import List, Tuple

import numpy as np

from passes.partition.chain import ChainSolver
from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions
from passes.partition.segments import Segment


def applies(opts: CostOptions, units: Units) -> bool:
    """At least as many units with compute as the K stages that replication none on exactly K needs."""
    return sum(units.has_compute) >= opts.devices


def _shift(bits: np.ndarray) -> np.ndarray:
    """Counts one higher: the bit sets (last axis: 64-bit words, lowest count first) shifted by one."""
    out = bits << np.uint64(1)
    out[..., 1:] |= bits[..., :-1] >> np.uint64(63)
    return out


def _has(bits: np.ndarray, k: int) -> np.ndarray:
    return ((bits[..., k // 64] >> np.uint64(k % 64)) & np.uint64(1)).astype(bool)


class StageCountSolver(ChainSolver):
    """``ChainSolver`` whose state is the set of stage counts reaching each point (see the module docstring).

    A set is a row of 64-bit words (bit k: count k), so one stage is a shift
    and many sources are an OR.
    """

    def __init__(self, units: Units, segments: List[Segment], opts: CostOptions) -> None:
        super().__init__(units, segments, opts)
        cat = lambda name: np.concatenate([getattr(s, name) for s in segments])  # noqa: E731
        self.compute, self.params, self.cut = cat("compute"), cat("params"), cat("cut")
        self.shared = np.vstack([s.shared for s in segments])
        K = opts.devices
        self.words = K // 64 + 1
        bits = np.arange(self.words * 64)[None, :] < np.arange(K + 2)[:, None]  # up to count n - 1
        self.below = np.packbits(bits.reshape(K + 2, self.words, 64)[..., ::-1], axis=2,
                                 bitorder="big").view(">u8").astype(np.uint64).reshape(K + 2, self.words)

    def _fits(self, j, i, T: float) -> np.ndarray:
        """Whether stages (j, i) (global point ids, broadcastable) run within T on one device."""
        return self._r(self.compute[j], self.params[j], self.shared[j], self.cut[j],
                       self.compute[i], self.params[i], self.shared[i], self.cut[i], T) == 1

    def devices_needed(self, T: float, deadline: float = math.inf, soft: float = math.inf):
        """(K if a plan of exactly K stages meets T, else K + 1; no back-pointers: ``plan`` reads ``reach``);
        past ``soft`` the pass goes on to ``deadline`` only at a pace that ends by then
        (``memory_guard.pass_deadline``)."""
        began = time.monotonic()
        K = self.opts.devices
        total_compute = self.segs[-1].compute[-1]
        reach = np.zeros((self.offsets[-1], self.words), dtype=np.uint64)
        pool = np.zeros(0, dtype=np.int64)
        for a, seg in enumerate(self.segs):
            self._segment_deadline(a, began, soft, deadline)
            d, off = len(seg.compute), self.offsets[a]
            mine = reach[off:off + d]
            if a == 0:
                mine[0, 0] = np.uint64(1)
            alive = np.zeros(0, dtype=bool)
            if pool.size:
                fits = self._fits(pool[:, None], off + np.arange(d)[None, :], T)
                # the segment's last point with no cut after it: a pool point that cannot end a stage
                # there cannot end one later either
                last = self._r(self.compute[pool], self.params[pool], self.shared[pool], self.cut[pool],
                               seg.compute[-1], seg.params[-1], seg.shared[-1], 0.0, T)
                alive = last == 1
                src = np.where(fits[:, :, None], reach[pool][:, None, :], np.uint64(0))
                mine |= _shift(np.bitwise_or.reduce(src, axis=0))
            # at most as many counts as leave room for the rest: ceil(rest / T) more stages
            rest = np.ceil((total_compute - seg.compute) / T * (1 - 1e-12)).astype(np.int64)
            room = self.below[np.clip(K + 1 - rest, 0, K + 1)]
            mine &= room
            if seg.sub_j.size:
                self._inside(seg, off, T, mine, room)
            pool = self._next(pool, alive, seg, off, mine, reach)
            if not pool.size and a < len(self.segs) - 1:
                return K + 1, None
        return (K if _has(reach[-1], K) else K + 1), (reach, T)

    def _inside(self, seg: Segment, off: int, T: float, mine, room) -> None:
        """Stages inside the segment, one size of point at a time (a stage's start is a smaller point)."""
        ok = self._fits(off + seg.sub_j, off + seg.sub_i, T)
        j, i = seg.sub_j[ok], seg.sub_i[ok]  # sorted by i
        if not j.size:
            return
        size = seg.member.sum(axis=1)
        for z in np.unique(size[i]):
            sel = np.nonzero(size[i] == z)[0]
            starts = np.r_[0, np.nonzero(np.diff(i[sel]))[0] + 1]
            x = i[sel][starts]
            mine[x] |= _shift(np.bitwise_or.reduceat(mine[j[sel]], starts, axis=0)) & room[x]

    def _next(self, pool, alive, seg: Segment, off: int, mine, reach) -> np.ndarray:
        keep = mine.any(axis=1)
        if seg.sub_j.size:  # a point containing j that reaches every count j does, cutting no more bytes
            j, i = seg.sub_j, seg.sub_i
            beaten = ~(mine[j] & ~mine[i]).any(axis=1) & (seg.cut[i] <= seg.cut[j])
            keep[j[beaten]] = False
        new = off + np.nonzero(keep)[0]
        if not pool.size:
            return new
        beaten = (~(reach[pool][:, None, :] & ~reach[new][None, :, :]).any(axis=2)
                  & (self.cut[new][None, :] <= self.cut[pool][:, None])).any(axis=1)
        return np.concatenate([pool[alive & ~beaten], new])

    def _walk(self, back) -> Tuple[List[int], List[int]]:
        """Back from the full point with K stages: any earlier point reaching k - 1 that starts a stage
        meeting T (earlier segments' points are all subsets; in the same segment, its subsets)."""
        (reach, T), K = back, self.opts.devices
        chain, x = [self.offsets[-1] - 1], self.offsets[-1] - 1
        for k in range(K, 0, -1):
            a = int(self.point_seg[x])
            earlier = np.arange(self.offsets[a])
            seg = self.segs[a]
            inside = self.offsets[a] + seg.sub_j[seg.sub_i == x - self.offsets[a]]
            cand = np.concatenate([earlier, inside])
            cand = cand[_has(reach[cand], k - 1) & (self.compute[cand] >= self.compute[x] - T * (1 + 1e-9))]
            cand = cand[self._fits(cand, np.full(cand.size, x), T)]
            x = int(cand[-1])
            chain.append(x)
        return chain[::-1], [1] * K
