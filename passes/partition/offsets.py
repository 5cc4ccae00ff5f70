"""Replica intervals and per-offset look-up tables of the placed segment DP (``placed.py``).

For one bottleneck T, the replica counts of a stage that meet T form an
interval at each bandwidth (``intervals``; ``tied_intervals`` where a tied
weight's ring makes the time fall and then rise; ``least_fitting`` finds an
interval's lower end by bisection where no closed form settles it, starting
from a near one where the caller has it), and each cut needs at least
``cut_floors`` replicas by placement. ``Sources`` holds, for the points a
stage may start from, the least devices over ranges of offsets within a node,
so ``targets`` turns a batch of (start point, stage) pairs into the fewest
devices after the stage at every end offset with a handful of array look-ups.
``cut_load_table`` gives the exact-cut DP (``charged.py``) the placed cut per
byte between two stages of given counts meeting at a given offset.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional, Tuple

import numpy as np

from passes.partition.costmodel import CostOptions, fastest_index
from passes.partition.topology import pair_load, span

EPS = 1e-12
CLEAR = 1e-7  # how far (relative) a closed form's count must lie from an integer to be read without asking


def intervals(C, P, T: float, bandwidth: float, K: int):
    """Per stage (arrays), the replica counts ``[lo, hi]`` whose compute and ring (at ``bandwidth``)
    meet T (``lo > hi``: none); ``hi`` is K when unbounded. Stages without tied weights
    (``tied_intervals`` has those)."""
    a = 2.0 * P / bandwidth
    with np.errstate(divide="ignore", invalid="ignore"):
        falling = C >= a  # (C - a)/r + a falls with r (r = 1 gives C)
        need = np.where(T > a, (C - a) / (T - a), np.inf)
        lo = np.where(falling, np.where(C <= T, 1.0, need), np.where(C <= T, 1.0, np.inf))
        most = np.where(T >= a, np.inf, (a - C) / (a - T))
        hi = np.where(falling, np.inf, np.where(C <= T, most, -np.inf))
    hi = np.floor(np.minimum(hi * (1 + EPS), K))
    return count(lo, K), np.maximum(hi, -1.0).astype(np.int64)


def tied_intervals(time_at, n: int, T: float, K: int):
    """``[lo, hi]`` per stage (``lo > hi``: none) of the counts 1..K whose ``time_at(counts, which)``
    meets T, for times that fall and then rise in r (a tied weight's ring of r + partners ranks; see
    ``costmodel.min_replicas``): the fastest count, then bisection on each side of it."""
    every = np.arange(n)
    peak = fastest_index(lambda idx, k: time_at(idx + 1, k), np.zeros(n, dtype=np.int64),
                         np.full(n, K - 1, dtype=np.int64))
    fits = time_at(peak + 1, every) <= T * (1 + EPS)
    lo, hi = np.zeros(n, dtype=np.int64), peak.copy()  # first fit in [lo, hi]: the time falls there
    top, end = peak.copy(), np.full(n, K - 1, dtype=np.int64)  # last fit in [top, end]: it rises there
    while True:
        k = np.nonzero(fits & ((lo < hi) | (top < end)))[0]
        if not k.size:
            break
        left = lo[k] < hi[k]
        mid = (lo[k] + hi[k]) // 2
        good = time_at(mid + 1, k) <= T * (1 + EPS)
        hi[k] = np.where(left & good, mid, hi[k])
        lo[k] = np.where(left & ~good, mid + 1, lo[k])
        right = top[k] < end[k]
        mid = (top[k] + end[k] + 1) // 2
        good = time_at(mid + 1, k) <= T * (1 + EPS)
        top[k] = np.where(right & good, mid, top[k])
        end[k] = np.where(right & ~good, mid - 1, end[k])
    return np.where(fits, lo + 1, K + 1), np.where(fits, top + 1, -1)


def least_fitting(time_at, lo: np.ndarray, hi: np.ndarray, T: float,
                  guess: Optional[np.ndarray] = None) -> np.ndarray:
    """Per stage, the least count in ``[lo, hi]`` whose ``time_at(counts, which)`` meets T, for times that
    fall over that range and meet T at ``hi``: bisection. ``guess``: per stage a count near the answer
    (a closed form that leaves some term out); it and the neighbour that decides it are asked first,
    which settles every stage whose guess is within one in two asks instead of log2 of the range."""
    lo, hi = lo.astype(np.int64, copy=True), hi.astype(np.int64, copy=True)
    ask = None if guess is None else np.asarray(guess, dtype=np.int64)
    step = 0
    while True:
        k = np.nonzero(lo < hi)[0]
        if not k.size:
            return hi
        guessing = ask is not None and step < 2  # the guess, then its neighbour on the side it left open
        at = np.clip(ask[k], lo[k], hi[k]) if guessing else (lo[k] + hi[k]) // 2
        good = time_at(at, k) <= T * (1 + EPS)
        hi[k] = np.where(good, at, hi[k])
        lo[k] = np.where(good, lo[k], at + 1)
        if guessing:
            ask = ask.copy()
            ask[k] = np.where(good, at - 1, at + 1)
        step += 1


def clear_of_integer(x) -> np.ndarray:
    """Where a closed form's count ``x`` (elementwise) lies more than ``CLEAR`` (relative) from an
    integer, so its ceiling is the answer whatever the rounding of the stage times it stands for;
    elsewhere the caller asks those times."""
    x = np.asarray(x, dtype=float)
    return np.abs(x - np.rint(x)) > CLEAR * np.maximum(x, 1.0)


def count(x, K: int) -> np.ndarray:
    """``ceil(x)`` as replica counts, K + 1 standing for none."""
    return np.minimum(np.ceil(np.maximum(x, 1.0) * (1 - EPS)), float(K + 1)).astype(np.int64)


class Stages(NamedTuple):
    """Replica counts that meet T for a set of stages, by where they sit (see ``cut_floors``).

    In one node: ``[lo1, hi1]``, at least ``lo1_end`` when the stage ends on a
    node boundary and at least ``in_start`` when it starts on one. Across
    nodes: ``[lo2, hi2]``.
    """

    lo1: np.ndarray
    lo1_end: np.ndarray
    in_start: np.ndarray
    hi1: np.ndarray
    lo2: np.ndarray
    hi2: np.ndarray

    def take(self, idx) -> "Stages":
        return Stages(*(x[idx] for x in self))


def cut_floors(A_in, A_out, T: float, opts: CostOptions):
    """Fewest replicas a stage needs for its cuts to meet T, by placement: (in and out at B1, in at
    B2, out at B2), each ``ceil(2A/(B·T))``.

    A rank whose partners across a cut all sit in other nodes carries 1/r of
    the microbatches at B2, so the cut takes at least ``2A/(B2·r)`` on that side
    (``topology.pair_load``). The ranks of a stage before a cut have such a rank
    when the stage crosses a node boundary or ends on one; those after it when
    their stage crosses one or starts on one. Otherwise B1 is the least charge.
    """
    edge = lambda A, B: count(2.0 * A / (B * T), opts.devices)  # noqa: E731
    return (np.maximum(edge(A_in, opts.intra_bw), edge(A_out, opts.intra_bw)), edge(A_in, opts.bandwidth),
            edge(A_out, opts.bandwidth))


class Sources:
    """Look-up tables of a set of source points' rows ``dev[:, m]`` (see the module docstring).

    ``prefix[s, w, hi]``: min over offsets w <= m <= hi (w = 0 or 1) of
    ``dev - m`` (the first rank of the node the prefix ends in), with its
    offset; a stage in one node from there ends at that rank plus its end offset.
    ``cross[s, q]`` (q = 1 .. G+1): fewest devices after a node-crossing stage of at
    least q replicas, ``min_m max(dev_m + q, node_m + G + 1)``, with its offset.
    """

    def __init__(self, dev: np.ndarray, G: int, K: int) -> None:
        self.dev, self.G, self.K = dev, G, K
        self.inf = np.int64(4 * K + 4 * G + 8)
        n = dev.shape[0]
        self.base = np.empty((n, G), dtype=np.int64)
        self.cross_at = np.empty((n, G + 1), dtype=np.int64)
        self.cross = np.empty((n, G + 1), dtype=np.int64)
        self.prefix = np.full((n, 2, G), self.inf * G, dtype=np.int64)
        self.refresh(slice(None))

    def refresh(self, rows) -> None:
        """Recompute the tables of ``rows`` from ``dev`` (a live array: the DP fills it in place)."""
        G, dev = self.G, self.dev[rows]
        base = np.where(dev <= self.K, dev - np.arange(G)[None, :], self.inf)
        self.base[rows] = base
        q = np.arange(1, G + 2)
        after = np.maximum(dev[:, None, :] + q[None, :, None], base[:, None, :] + G + 1)
        after = np.where((dev <= self.K)[:, None, :], after, self.inf)
        at = after.argmin(axis=2)
        self.cross_at[rows] = at
        self.cross[rows] = np.take_along_axis(after, at[:, :, None], axis=2)[:, :, 0]

        # prefix[s, w, hi]: least (dev - m) over offsets w <= m <= hi (w = 0, 1), as (value · G + m)
        key = base * G + np.arange(G)[None, :]
        prefix = np.full((dev.shape[0], 2, G), self.inf * G, dtype=np.int64)
        prefix[:, 0] = np.minimum.accumulate(key, axis=1)
        prefix[:, 1, 1:] = np.minimum.accumulate(key[:, 1:], axis=1)
        self.prefix[rows] = prefix


def crossing_start(src: Sources, s, lo2, hi2, G: int, K: int):
    """Per pair, the fewest devices after a node-crossing stage whose counts are unbounded above
    (every larger count is reached too; ``src.inf`` where there is none), and its source offset."""
    q = np.clip(lo2, 1, G + 1) - 1
    cidx = s * (G + 1) + q
    start = np.where((hi2 >= K) & (lo2 <= K), src.cross.reshape(-1)[cidx] + np.maximum(lo2 - (G + 1), 0), src.inf)
    return start, src.cross_at.reshape(-1)[cidx]


def every_offset(start, G: int):
    """The fewest counts at least ``start`` at each offset m' (last axis)."""
    shift = (np.arange(G)[None, :] - np.arange(G)[:, None]) % G  # shift[v, m'] = (m' - v) mod G
    return start[:, None] + shift[start % G]


def targets(src: Sources, s, st: Stages, G: int, K: int, want_from: bool = False, crossing: bool = True):
    """For pairs (source row s, their ``Stages``): per end offset m' (last axis), the fewest
    devices after the stage (> K: unreachable); with ``want_from`` also the source offset and replicas.
    ``crossing=False`` leaves the unbounded crossing stages out (``PlacedChainSolver._from_pool`` takes
    them on its own)."""
    inf = src.inf
    lo1, hi1, lo2, hi2 = st.lo1, st.hi1, st.lo2, st.hi2
    # one node: from offset m, r = t - m for the end t (t = m' but G for m' = 0), lo1 <= r <= hi1;
    # ending on the boundary (t = G) needs lo1_end, starting on one (m = 0, r = t) in_start
    t = np.r_[G, np.arange(1, G)][None, :]
    mhi = t - np.concatenate([st.lo1_end[:, None], np.broadcast_to(lo1[:, None], (lo1.size, G - 1))], axis=1)
    mlo = np.maximum(t - hi1[:, None], 0)
    mlo = np.where(t < st.in_start[:, None], np.maximum(mlo, 1), mlo)
    idx = (s * (2 * G))[:, None] + np.minimum(mlo, 1) * G + np.maximum(mhi, 0)
    key = src.prefix.reshape(-1)[idx]
    val = np.where(mhi >= mlo, key // G + t, inf)
    if want_from:
        from_m = key % G
    narrow = np.nonzero(hi1 < G - 1)[0]  # some mlo > 1 (fewer than G - 1 replicas in a node): rare
    if narrow.size:
        m = np.arange(G)[None, None, :]
        inside = (m >= mlo[narrow][:, :, None]) & (m <= mhi[narrow][:, :, None])
        k = np.where(inside, src.base[s[narrow]][:, None, :] * G + m, inf * G).min(axis=2)
        val[narrow] = np.where(mhi[narrow] >= mlo[narrow], k // G + t, inf)
        if want_from:
            from_m[narrow] = k % G
    # across nodes, unbounded above: every count from the first one that crosses
    if crossing:
        start, start_m = crossing_start(src, s, lo2, hi2, G, K)
        cross = every_offset(start, G)
        if want_from:
            from_m = np.where(cross < val, start_m[:, None], from_m)
        val = np.minimum(val, cross)
    # across nodes, bounded (more replicas slow the stage down): each source offset on its own
    closed = np.nonzero((hi2 < K) & (lo2 <= hi2))[0]
    if closed.size:
        dev = src.dev[s[closed]][:, None, :]  # (c, 1, G over the source offset m)
        m = np.arange(G)[None, None, :]
        mp = np.arange(G)[None, :, None]
        low = np.maximum(lo2[closed, None, None], G - m + 1)
        r = low + (mp - m - low) % G
        v = np.where((r <= hi2[closed, None, None]) & (dev <= K), dev + r, inf)  # (c, m', m)
        k = v.argmin(axis=2)
        best = np.take_along_axis(v, k[:, :, None], axis=2)[:, :, 0]
        better = best < val[closed]
        val[closed] = np.where(better, best, val[closed])
        if want_from:
            from_m[closed] = np.where(better, k, from_m[closed])
    val = np.where(val <= K, val, K + 1)
    if not want_from:
        return val
    return val, from_m, val - src.dev[s[:, None], from_m]


@lru_cache(maxsize=16)
def cut_load_table(counts: Tuple[int, ...], G: int, intra: float, inter: float) -> np.ndarray:
    """``[p, q, m]``: seconds per byte cut (forward and backward) between a stage of ``counts[p]``
    replicas that ends at offset m of a node and the stage of ``counts[q]`` that starts there, under
    the contiguous placement (``topology.pair_load``; only the offsets within a node matter)."""
    R = len(counts)
    out = np.empty((R, R, G))
    for p, rp in enumerate(counts):
        for q, rq in enumerate(counts):
            for m in range(G):
                first = (m - rp) % G
                out[p, q, m] = 2.0 * pair_load(span(first, rp), span(first + rp, rq), G, intra, inter)
    return out
