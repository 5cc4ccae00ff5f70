"""The order DP (``heuristic.order_dp``) by parametric search on the bottleneck T, for large device counts;
``best_order_dp``, the planner's entry to both.

``order_dp`` tries every replica count of every stage against every device
count: O(n^2 · R · K) for n units and R allowed counts. With any count on
many devices that is the whole search: gnmt_large (93 units) on 256 devices
took 1 s per order, 3 s for the three orders, and twice that when the same
units came back from coarsening; on 1,024 devices 16 s per order, past any
time limit. For a given T the same order needs only
``dev[i] = min over j < i of dev[j] + r(j, i, T)``, with ``r`` the fewest
replicas that bring the range under T (``costmodel.min_replicas``, exact for
the cut charged ``2A / (B · min(r_before, r_after))``, as ``order_dp``
charges it). T is feasible iff ``dev[n] <= K``, and ``dev`` only falls as T
grows, so the least feasible T is bisected (geometrically, within
``TOLERANCE``) over O(n^2) pairs per step, whatever K is. The plan found
there is padded to exactly K devices as the segment DP's are
(``chain.pad``); where that fails, rows of the device counts each prefix can
use exactly find the plan (``_exactly``), and past their size the caller
falls back to ``order_dp``.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions, fastest_index, min_replicas, stage_time_s
from passes.partition.chain import DeadlineExceeded, pad
from passes.partition.heuristic import Solution, order_dp, order_sums, topo_orders
from passes.partition.memory_guard import past
from passes.partition.offsets import least_fitting

TOLERANCE = 1e-4  # the bisection stops with its plan this close to the order's least feasible T
ORDER_CELLS = 1 << 22  # n^2 · R · K / 2 above which an order is bisected rather than tabled (``order_dp``)


def best_order_dp(units: Units, opts: CostOptions, deadline: float = math.inf) -> Optional[Solution]:
    """The best plan over a few topological orders (``heuristic.topo_orders``), each by ``order_dp``'s
    table where it is small, else bisected (the table where bisection finds no plan)."""
    found = [s for s in (_one_order(units, opts, o, deadline) for o in topo_orders(units)) if s is not None]
    return min(found, key=lambda s: s.objective) if found else None


def _one_order(units: Units, opts: CostOptions, order: Sequence[int], deadline: float) -> Optional[Solution]:
    n, K, R = len(order), opts.devices, len(opts.allowed_replicas())
    if R > 1 and n * n * R * K / 2 > ORDER_CELLS:
        found = bisected(units, opts, order, deadline)
        if found is not None or past(deadline):
            return found
    return order_dp(units, opts, order, deadline)


def bisected(units: Units, opts: CostOptions, order: Sequence[int],
             deadline: float = math.inf) -> Optional[Solution]:
    """Best contiguous partition of ``order`` (within ``TOLERANCE``), or None where the deadline comes
    first or the plan cannot be padded to exactly K devices."""
    n, K = len(order), opts.devices
    comp, par, work, cut, first_cut = order_sums(units, order)
    jj, ii = np.triu_indices(n + 1, k=1)  # every range [j, i) of the order, sorted by i
    by_end = np.lexsort((jj, ii))
    jj, ii = jj[by_end], ii[by_end]
    keep = (work[ii] - work[jj] >= 1) & ((jj == 0) | (jj >= first_cut))
    jj, ii = jj[keep], ii[keep]
    if not (ii == n).any():
        return None
    sums = (comp[ii] - comp[jj], par[ii] - par[jj], cut[jj], cut[ii])
    ends = np.searchsorted(ii, np.arange(n + 2))  # the ranges ending at i: ends[i] .. ends[i + 1]

    def fewest(T: float):
        """(devices, chosen range per end) of the best plan with every stage within T."""
        if past(deadline):  # a pass over a few thousand units takes seconds
            raise DeadlineExceeded()
        r = np.asarray(min_replicas(*sums, T, opts), dtype=float)
        dev, took = np.full(n + 1, math.inf), np.full(n + 1, -1)
        dev[0] = 0.0
        for i in range(1, n + 1):
            a, b = ends[i], ends[i + 1]
            if a == b:
                continue
            total = dev[jj[a:b]] + r[a:b]
            k = int(np.argmin(total))
            dev[i], took[i] = total[k], a + k
        return dev[n], took, r

    lo = float(comp[n]) / K  # every plan spends sum C over at most K devices
    if not lo > 0:
        return None  # nothing to bisect on: the table answers
    try:  # a pass past the deadline raises: the search has no plan in time
        used, took, r = fewest(lo)
        if used > K:
            hi = float(stage_time_s(comp[n], par[n], 0.0, 0.0, 1, opts))  # one stage on one device
            used, took, r = fewest(hi)
        if used > K:
            return None
        best = _ranges(took, r, ii, jj, n)
        hi = _bottleneck(best, sums, opts)
        while hi > lo * (1 + TOLERANCE):
            T = math.sqrt(lo * hi)
            used, took, r = fewest(T)
            if used <= K:
                best = _ranges(took, r, ii, jj, n)
                hi = min(T, _bottleneck(best, sums, opts))
            else:
                lo = T
    except DeadlineExceeded:
        return None
    padded = _padded(units, opts, order, best, sums, hi)
    if padded is not None or opts.fewer_devices:
        return padded
    return _exactly(units, opts, order, sums, ii, jj, ends, hi, deadline)


def _ranges(took: np.ndarray, r: np.ndarray, ii: np.ndarray, jj: np.ndarray, n: int) -> List[Tuple[int, int, int]]:
    """(pair index, first position, replicas) per stage, first stage first, walked back from the end."""
    out, i = [], n
    while i > 0:
        k = int(took[i])
        out.append((k, int(jj[k]), int(r[k])))
        i = int(jj[k])
    return out[::-1]


def _bottleneck(ranges: List[Tuple[int, int, int]], sums, opts: CostOptions, replicas=None) -> float:
    """The slowest stage of ``ranges`` (with ``replicas`` where given), each cut charged with its own count."""
    k = np.array([pair for pair, _, _ in ranges])
    reps = np.array([r for _, _, r in ranges] if replicas is None else replicas, dtype=float)
    return float(np.max(stage_time_s(*(s[k] for s in sums), reps, opts)))


def _stage_of(order: Sequence[int], ranges: List[Tuple[int, int, int]]) -> List[int]:
    """Stage per unit of the plan whose stages start at ``ranges``' first positions along ``order``."""
    stage_of = [0] * len(order)
    starts = [j for _, j, _ in ranges] + [len(order)]
    for s in range(len(ranges)):
        for p in range(starts[s], starts[s + 1]):
            stage_of[order[p]] = s
    return stage_of


def _padded(units: Units, opts: CostOptions, order: Sequence[int], ranges, sums, T: float) -> Optional[Solution]:
    """The plan on exactly K devices (``chain.pad``), scored as ``order_dp`` scores its plans."""
    stage_of = _stage_of(order, ranges)
    replicas = pad(units, stage_of, [r for _, _, r in ranges], opts, T)
    if replicas is None:
        return None
    return Solution(stage_of, replicas, _bottleneck(ranges, sums, opts, replicas))


EXACT_CELLS = 1 << 26  # range-by-count cells up to which a plan that padding missed is searched on exactly K


def _exactly(units: Units, opts: CostOptions, order: Sequence[int], sums, ii, jj, ends, T: float,
             deadline: float) -> Optional[Solution]:
    """The least T (within ``TOLERANCE``, from the fewest-device T up) with a plan on exactly K devices.

    Padding only adds replicas; where every stage of the fewest-device plan slows with more (an
    all-reduce that outgrows the compute it splits, or a power-of-two step too large) the devices
    left need more stages: gnmt on 16 devices under fxpipe's charges is 7 stages on 7 devices at its
    optimum and 10 stages on 16 at the same T. For a given T the set of device counts each prefix can
    use exactly is a bit row (``_counts``); T is doubled until the full order can use K, then bisected.
    """
    n, K = len(order), opts.devices
    if len(ii) * (K + 1) > EXACT_CELLS:
        return None
    lo, hi, rows = T, T, None
    for _ in range(64):
        rows = _counts(sums, ii, jj, ends, n, hi, opts, deadline)
        if rows is None:
            return None
        if rows[0][n, K]:
            break
        lo, hi = hi, 2 * hi
    else:
        return None
    while hi > lo * (1 + TOLERANCE):
        mid = math.sqrt(lo * hi)
        got = _counts(sums, ii, jj, ends, n, mid, opts, deadline)
        if got is None:
            return None
        if got[0][n, K]:
            hi, rows = mid, got
        else:
            lo = mid
    ranges = _walk_counts(rows, ii, jj, ends, n, K, opts)
    return Solution(_stage_of(order, ranges), [r for _, _, r in ranges], _bottleneck(ranges, sums, opts))


def fitting(sums, T: float, opts: CostOptions):
    """Per range: whether one replica fits T, and the interval [first, last] of indices into the allowed
    counts from 2 on whose time fits T (first > last where none does). From two replicas on a stage's
    time falls and then rises (``costmodel.min_replicas`` says why), so the counts that fit are one run
    of them: the fastest is found by bisection on the slope (``costmodel.fastest_index``), each end of
    the run by bisection (``offsets.least_fitting``, within its ``EPS``)."""
    allowed = np.asarray(opts.allowed_replicas(), dtype=np.int64)
    top = len(allowed) - 1

    def time_at(idx, which=slice(None)):
        return stage_time_s(*(s[which] for s in sums), allowed[idx].astype(float), opts)

    one = np.asarray(stage_time_s(*sums, 1.0, opts)) <= T
    m = len(sums[0])
    if top < 1:
        return one, np.ones(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    fast = fastest_index(time_at, np.ones(m, dtype=np.int64), np.full(m, top, dtype=np.int64))
    fits = time_at(fast) <= T
    # the first fit where the time falls, [1, fast]; the last where it rises, [fast, top], read backwards
    # (index fast + top - j falls as j grows) so the same bisection finds it (``offsets.least_fitting``)
    first = least_fitting(time_at, np.ones(m, dtype=np.int64), fast, T)
    back = least_fitting(lambda j, k: time_at(fast[k] + top - j, k), fast, np.full(m, top, dtype=np.int64), T)
    return one, np.where(fits, first, top + 1), np.where(fits, fast + top - back, 0)


def _counts(sums, ii, jj, ends, n: int, T: float, opts: CostOptions, deadline: float = math.inf):
    """(rows, fits): ``rows[i, k]`` whether the first i positions of the order split into stages
    within T on exactly k devices; ``fits`` as ``fitting`` answers for T. None once the deadline
    passes (a call on 300 units and 1,024 devices takes about a second)."""
    K = opts.devices
    allowed = np.asarray(opts.allowed_replicas(), dtype=np.int64)
    one, first, last = fits = fitting(sums, T, opts)
    contiguous = len(allowed) == allowed[-1]  # any count: a run of indices is a run of counts
    rows = np.zeros((n + 1, K + 1), dtype=bool)
    rows[0, 0] = True
    csum = np.zeros((n + 1, K + 2), dtype=np.int64)  # csum[j, k]: counts below k prefix j can use
    csum[0] = np.concatenate([[0], np.cumsum(rows[0])])
    ks = np.arange(K + 1)
    for i in range(1, n + 1):
        if past(deadline):
            return None
        a, b = ends[i], ends[i + 1]
        if a < b:
            j = jj[a:b]
            row = (rows[j[one[a:b]]][:, :K] if one[a:b].any() else np.zeros((0, K), dtype=bool)).any(axis=0)
            rows[i, 1:] |= row
            live = np.nonzero(first[a:b] <= last[a:b])[0]
            if live.size and contiguous:
                lo_r, hi_r = allowed[first[a:b][live]], allowed[last[a:b][live]]  # k - hi_r .. k - lo_r
                top = np.clip(ks[None, :] - lo_r[:, None] + 1, 0, K + 1)
                bottom = np.clip(ks[None, :] - hi_r[:, None], 0, K + 1)
                rows[i] |= ((csum[j[live]][np.arange(live.size)[:, None], top] -
                             csum[j[live]][np.arange(live.size)[:, None], bottom]) > 0).any(axis=0)
            elif live.size:
                for idx in range(1, len(allowed)):
                    on = live[(first[a:b][live] <= idx) & (idx <= last[a:b][live])]
                    r = int(allowed[idx])
                    if on.size and r <= K:
                        rows[i, r:] |= rows[j[on]][:, :K + 1 - r].any(axis=0)
        csum[i] = np.concatenate([[0], np.cumsum(rows[i])])
    return rows, fits


def _walk_counts(got, ii, jj, ends, n: int, K: int, opts: CostOptions) -> List[Tuple[int, int, int]]:
    """The stages of a plan on exactly K devices that ``_counts``'s rows say exists, last stage first
    found, returned first stage first."""
    rows, (one, first, last) = got
    allowed = np.asarray(opts.allowed_replicas(), dtype=np.int64)
    out, i, k = [], n, K
    while i > 0:
        for pair in range(ends[i], ends[i + 1]):
            j = int(jj[pair])
            counts = allowed[first[pair]:last[pair] + 1]
            counts = np.concatenate([[1], counts]) if one[pair] else counts
            counts = counts[counts <= k]
            hit = np.nonzero(rows[j, k - counts])[0]
            if hit.size:
                r = int(counts[hit[0]])
                out.append((pair, j, r))
                i, k = j, k - r
                break
        else:
            raise RuntimeError("order_bisect: the count rows promised a plan the walk cannot find")
    return out[::-1]
