"""Exact dynamic program over the downsets of a graph, for graphs that have few.

A downset (every predecessor of a member is a member) is what all stages up to
some boundary hold, so a pipeline is a chain of nested downsets and a stage is
the difference of two of them. This is the exact search PipeDream's optimizer
performs; it is only cheap while the graph has few downsets (chains, residual
networks: a few hundred), and it explodes on branchy graphs (Inception, NASNet:
tens of thousands), which is why CP-SAT is the general method. When it fits
under ``limit`` downsets, it is exact for the cost model (compute, weights,
cuts are additive over a stage), so its answer is a proof of optimality that
CP-SAT would need long to find on graphs with many stages; memory limits and
shared (tied) weights are not modelled here, so callers use it as a warm
start only in those cases. On a two-level machine (``gpus_per_node``) the
devices used so far are the next stage's first rank, and the state also
keeps the last stage's replicas, so placed costs stay exact (``_topology_dp``).
"""
from __future__ import annotations

import math
import time
from typing import List, Optional

import numpy as np

from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions, allreduce_coeff_at, combine_stage_time, cut_at, stage_time_s
from passes.partition.heuristic import Solution
from passes.partition.memory_guard import past


def enumerate_downsets(units: Units, limit: int, deadline: float = math.inf) -> Optional[List[int]]:
    """Bitmasks of the downsets the DP may use, by size; None when there are more than ``limit``
    (or past ``deadline``).

    The smallest holds the inputs (they sit in stage 0); the output unit only
    appears in the full set (it must be in the last stage).
    """
    n = len(units)
    pred = [0] * n
    for a, b in units.edges:
        pred[b] |= 1 << a
    start = sum(1 << u for u in range(n) if units.is_input[u])
    outputs = sum(1 << u for u in range(n) if units.is_output[u])
    return downsets_from(pred, start, outputs, limit, deadline)


def downsets_from(pred: List[int], start: int, outputs: int, limit: int,
                  deadline: float = math.inf) -> Optional[List[int]]:
    """Every downset containing ``start`` (bitmasks over ``len(pred)`` nodes, ``pred[v]`` the mask of
    v's predecessors), smallest first, the full set last; a set holding an ``outputs`` node is
    only the full one. None when there are more than ``limit``, the full set is out of reach, or
    ``deadline`` has passed."""
    n, full = len(pred), (1 << len(pred)) - 1
    succ: List[List[int]] = [[] for _ in range(n)]
    for v in range(n):
        rest = pred[v]
        while rest:
            bit = rest & -rest
            rest ^= bit
            succ[bit.bit_length() - 1].append(v)
    # each downset keeps the mask of the nodes that can join it (every predecessor inside), updated
    # from its parent's through the new member's successors: a step costs the antichain's width, not n
    first = sum(1 << v for v in range(n) if not (start >> v) & 1 and not pred[v] & ~start)
    seen, level, ordered = {start}, [(start, first)], [start]
    while level:
        nxt = []
        for s, can in level:
            if past(deadline):
                return None
            rest = can
            while rest:
                bit = rest & -rest
                rest ^= bit
                t = s | bit
                if t in seen or (t & outputs and t != full):
                    continue
                seen.add(t)
                joins = can & ~bit
                for w in succ[bit.bit_length() - 1]:
                    if not pred[w] & ~t:
                        joins |= 1 << w
                nxt.append((t, joins))
                if len(seen) > limit:
                    return None
        ordered += [t for t, _ in nxt]
        level = nxt
    return ordered if full in seen else None


def default_limit(units: Units) -> int:
    """How many downsets the exact DP takes on by default: 2500, fewer on big graphs (6e5
    unit-downset pairs: 2000 on 300 units); measured, 6800 downsets (GNMT) take 15-20 s here
    on a flat machine, where CP-SAT needs 2, and 90-115 s on a two-level one."""
    return max(200, min(2500, 600_000 // max(len(units), 1)))


def downset_dp(units: Units, opts: CostOptions, limit: Optional[int] = None,
               upper: float = float("inf"), deadline: float = math.inf,
               masks: Optional[List[int]] = None) -> Optional[Solution]:
    """Optimal (stage per unit, replicas, bottleneck), or None if the graph has too many downsets.

    ``limit`` defaults to ``default_limit``. ``upper``: the bottleneck
    of a known plan; stages that cannot beat it are skipped (a plan at most
    that slow is still found, so the answer stays exact). ``masks``: the
    downsets, when the caller enumerated them already (``limit`` is then not applied).
    """
    if masks is None:
        masks = enumerate_downsets(units, default_limit(units) if limit is None else limit)
    if masks is None:
        return None
    return _search(masks, len(units), _Lattice.of(units, masks), opts, upper, deadline)


def cheap_cut_plan(units: Units, opts: CostOptions, masks: List[int], upper: float, deadline: float,
                   first: int = 256, most: Optional[int] = None) -> Optional[Solution]:
    """A plan from the DP over the downsets with the smallest cuts, for lattices too large for the exact one.

    Any subset of the downsets holding the first and the full one is a
    lattice of plans (a stage is still the difference of two nested
    downsets), so the DP on it answers the best plan among those whose
    boundaries all lie in it: a restriction, never a bound. Stage
    boundaries sit where little data crosses when communication matters
    (GNMT on 8 nodes of 2 GPUs: the optimum of its 6,820 downsets is among
    the 300 with the smallest cuts, found in about a second instead of 90 s);
    where compute decides instead, the balanced boundaries may be left out, so
    the plan is only a candidate beside the others.
    Sizes double from ``first`` up to ``most`` (default ``default_limit``) while the next run
    (about three times the last) fits before ``deadline``; each run starts
    from the best plan so far as its upper bound. None when no run found a plan under ``upper``
    in time.
    """
    lattice = _Lattice.of(units, masks)
    most = default_limit(units) if most is None else most
    inner = np.argsort(lattice.cut[1:-1], kind="stable") + 1  # the first and full downsets always stay
    best, size = None, min(first, len(masks))
    while True:
        began = time.monotonic()
        keep = np.sort(np.concatenate(([0], inner[: size - 2], [len(masks) - 1])))
        found = _search([masks[i] for i in keep], len(units), lattice.take(keep), opts,
                        best.objective if best is not None else upper, deadline)
        if found is not None and (best is None or found.objective < best.objective):
            best = found
        took = time.monotonic() - began
        if size >= min(most, len(masks)) or time.monotonic() + 3 * took > deadline:
            return best
        size = min(2 * size, most, len(masks))


class _Lattice:
    """Per downset: compute, weight bytes and units with compute it holds, the bytes crossing the
    boundary after it (both ways), and its members packed as bits (subset tests of the DP)."""

    def __init__(self, comp, par, work, cut, packed) -> None:
        self.comp, self.par, self.work, self.cut, self.packed = comp, par, work, cut, packed

    @classmethod
    def of(cls, units: Units, masks: List[int]) -> "_Lattice":
        n, D = len(units), len(masks)
        member = np.array([[(m >> u) & 1 for u in range(n)] for m in masks], dtype=bool)
        cut = np.zeros(D)  # one way
        for unit, nbytes, consumers in units.producers:
            cmask = sum(1 << c for c in consumers)
            cut += np.array([bool((m >> unit) & 1) and bool(cmask & ~m) for m in masks]) * float(nbytes)
        cut[0] = 0.0
        return cls(member @ np.asarray(units.compute, dtype=float), member @ np.asarray(units.param_bytes, dtype=float),
                   member @ np.asarray(units.has_compute, dtype=float), 2.0 * cut, np.packbits(member, axis=1))

    def take(self, idx: np.ndarray) -> "_Lattice":
        return _Lattice(self.comp[idx], self.par[idx], self.work[idx], self.cut[idx], self.packed[idx])


def _search(masks: List[int], n: int, lat: _Lattice, opts: CostOptions, upper: float,
            deadline: float) -> Optional[Solution]:
    """The DP over ``masks`` (smallest first, the first downset first and the full one last)."""
    comp, par, work, packed = lat.comp, lat.par, lat.work, lat.packed
    D, K = len(masks), opts.devices
    if opts.gpus_per_node is not None:
        return _topology_dp(masks, n, comp, par, work, lat.cut, packed, opts, upper, deadline)
    cut = lat.cut / 2.0  # the flat model's stage time takes the one-way bytes
    best = np.full((D, K + 1), np.inf)
    best[0, 0] = 0.0
    choice = np.zeros((D, K + 1, 2), dtype=np.int64)
    for i in range(1, D):
        if past(deadline):
            return None
        js = np.nonzero(~(packed[:i] & ~packed[i]).any(axis=1) & (work[i] - work[:i] >= 1))[0]
        if js.size:
            _relax(i, js, comp, par, cut, best, choice, opts, upper * (1 + 1e-9))
    last = D - 1
    devices = range(1, K + 1) if opts.fewer_devices else [K]
    m = min(devices, key=lambda d: best[last, d])
    if not np.isfinite(best[last, m]):
        return None
    return _walk_back(choice, masks, n, last, m, float(best[last, m]))


def _relax(i, js_all, comp, par, cut, best, choice, opts: CostOptions, upper: float) -> None:
    """Best ways to end a stage at downset i, for every replica count r and device total."""
    K = opts.devices
    for r in opts.allowed_replicas():
        if stage_time_s(0.0, 0.0, 0.0, cut[i], r, opts) > upper:
            continue
        js = js_all[stage_time_s(comp[i] - comp[js_all], 0.0, cut[js_all], 0.0, r, opts) <= upper]
        if not js.size:
            continue
        g = stage_time_s(comp[i] - comp[js], par[i] - par[js], cut[js], cut[i], r, opts)
        cand = np.maximum(best[js, : K + 1 - r], g[:, None])
        arg = np.argmin(cand, axis=0)
        val = cand[arg, np.arange(K + 1 - r)]
        better = val < best[i, r:]
        best[i, r:][better] = val[better]
        choice[i, r:][better] = np.stack([js[arg], np.full_like(arg, r)], axis=1)[better]


def _walk_back(choice, masks, n, i, m, value) -> Solution:
    stages, replicas = [], []
    while i > 0:
        j, r = (int(x) for x in choice[i, m])
        stages.append(masks[i] & ~masks[j])
        replicas.append(r)
        i, m = j, m - r
    stages.reverse()
    replicas.reverse()
    stage_of = [0] * n
    for s, mask in enumerate(stages):
        for u in range(n):
            if (mask >> u) & 1:
                stage_of[u] = s
    return Solution(stage_of, replicas, value)


# ------------------------------------------------------------ two-level machine

MAX_PLACED_CELLS = 1 << 23  # states (downsets x device totals x last counts) the placed DP keeps at most:
# 8 bytes each, and 16 more for the choices (about 200 MB); any count on 256 devices of a 256-downset lattice
# has 16.8 million


def _topology_dp(masks, n, comp, par, work, cut, packed, opts: CostOptions, upper: float,
                 deadline: float = math.inf) -> Optional[Solution]:
    """The same search when costs depend on where a stage sits (``opts.gpus_per_node``).

    A stage's all-reduce depends on its first rank, which is the devices used
    before it (the state's count); a cut depends on both stages' replicas and
    the first rank of the one before it, so the state also keeps the last
    stage's replica count: ``best[downset, devices used, last r]``. Each cut is
    charged when the stage after it is added, so the answer is exact for
    ``costmodel.evaluate`` under the contiguous placement (``topology.py``).
    None past ``deadline`` or where its states pass ``MAX_PLACED_CELLS``: with any count on
    many devices (K counts per state) the tables alone took the time and the memory (a 2-block GPT on
    256 devices: 110 s of a 10-s limit in the placement tables, 2.8 million cut charges).
    """
    D, K, R = len(masks), opts.devices, opts.allowed_replicas()
    if D * (K + 1) * len(R) > MAX_PLACED_CELLS:
        return None
    tables = _placement_tables(opts, R, deadline)
    if tables is None:
        return None
    coeff, load = tables
    best = np.full((D, K + 1, len(R)), np.inf)
    choice = np.zeros((D, K + 1, len(R), 2), dtype=np.int64)
    bound = upper * (1 + 1e-9)
    fewest, most = _devices_within(comp, K, bound)
    low = np.full(D, np.inf)  # each downset's best over its states, final once it is relaxed
    low[0] = 0.0
    for i in range(1, D):
        if past(deadline):
            return None
        js = np.nonzero(~(packed[:i] & ~packed[i]).any(axis=1) & (work[i] - work[:i] >= 1))[0]
        js = js[low[js] <= bound]
        for ri, r in enumerate(R):
            keep = js[(comp[i] - comp[js]) / r <= bound]
            if keep.size and max(r, fewest[i]) <= most[i]:
                _relax_placed(i, ri, r, keep, comp, par, cut, coeff, load, best, choice, R, K,
                              max(r, fewest[i]), most[i])
        low[i] = best[i].min()
    last = D - 1
    devices = range(1, K + 1) if opts.fewer_devices else [K]
    m, ri = min(((d, q) for d in devices for q in range(len(R))), key=lambda x: best[last, x[0], x[1]])
    if not np.isfinite(best[last, m, ri]):
        return None
    value = float(best[last, m, ri])
    stages, replicas, i = [], [], last
    while i > 0:
        j, prev = (int(x) for x in choice[i, m, ri])
        stages.append(masks[i] & ~masks[j])
        replicas.append(R[ri])
        i, m, ri = j, m - R[ri], prev
    stage_of = [0] * n
    for s, mask in enumerate(reversed(stages)):
        for u in range(n):
            if (mask >> u) & 1:
                stage_of[u] = s
    return Solution(stage_of, list(reversed(replicas)), value)


def _placement_tables(opts: CostOptions, R: List[int], deadline: float = math.inf):
    """By offset m in a node (``first mod G``): coeff[m, r], the all-reduce weight of a stage starting
    there; load[m, r_prev, r], a cut's seconds per byte when the stage before it starts there (0
    where no stages of those counts fit from such an offset); None past ``deadline``.

    A stage a whole node later crosses the same links, so the offset is all the tables need (the DP
    reads them at ``first % G``; a pair that fits at no such first is never read: its states stay
    infinite). A cut where each side has a rank whose partners all sit on other nodes (a rank on a
    node the other side does not touch) loads that rank most, ``1 / (B2 min(r_prev, r))``
    (``topology.pair_load``: its partners carry ``1 / r`` of its microbatches between them, all at B2,
    and a rank with a partner nearby carries less where B1 >= B2); only cuts with a side inside the
    node the two share are counted rank by rank. On 256 devices with any count: 2.8 million rank-by-rank
    charges before (110 s), 14 thousand now, and tables of G rows instead of K + 1."""
    K, G = opts.devices, int(opts.gpus_per_node)
    counts = np.asarray(R, dtype=np.int64)
    n = len(R)
    coeff, load = np.zeros((G, n)), np.zeros((G, n, n))
    rp, r = counts[:, None], counts[None, :]
    for m in range(min(G, K)):
        fits = m + rp + r <= K
        b0 = m + rp  # the first rank after the cut
        node = b0 // G
        alone = (b0 % G == 0) | ((m < node * G) & (b0 + r > (node + 1) * G))  # each side has a rank alone
        # the closed form's premise besides: a partner nearby costs no more
        closed = fits & alone & (opts.intra_bw >= opts.bandwidth)
        load[m] = np.where(closed, 1.0 / (opts.bandwidth * np.minimum(rp, r)), 0.0)
        for ri in range(n):
            if past(deadline):
                return None
            if m + R[ri] <= K:
                coeff[m, ri] = allreduce_coeff_at(m, R[ri], opts)
            for pi in np.nonzero(fits[:, ri] & ~closed[:, ri])[0]:
                load[m, pi, ri] = cut_at(0.5, m, R[pi], R[ri], opts)  # seconds per byte, as the cut array counts both ways
    return coeff, load


def _devices_within(comp, K: int, bound: float):
    """Per downset, the fewest and most devices its stages can use in a plan no slower than ``bound``.

    A stage takes at least its compute over its replicas (both cost models), so
    stages holding compute C on m devices take at least C / m at their slowest:
    the stages up to a downset need ``comp / bound`` devices, and those after it
    ``(total - comp) / bound`` of the rest. With ``bound`` near the optimum and
    compute setting it, a few device totals per downset remain instead of K (a
    16-device read-chain block: the DP 12.7 -> 3.6 s); where cuts set it (gnmt on
    8 nodes of 2: 6 of 16 totals left), little is gained.
    """
    if not math.isfinite(bound):
        return np.zeros(len(comp), dtype=np.int64), np.full(len(comp), K, dtype=np.int64)
    before = np.ceil(comp / bound - 1e-9).clip(0).astype(np.int64)
    after = np.ceil((comp[-1] - comp) / bound - 1e-9).clip(0).astype(np.int64)
    return before, K - after


def _relax_placed(i, ri, r, js, comp, par, cut, coeff, load, best, choice, R, K, d_lo, d_hi) -> None:
    """Best ways to end a stage with r replicas at downset i, for every device total d from ``d_lo`` to
    ``d_hi`` (first rank d - r)."""
    d = np.arange(d_lo, d_hi + 1)
    first = d - r
    compute = (comp[i] - comp[js])[:, None]
    G = coeff.shape[0]  # the tables hold one node's offsets (``_placement_tables``)
    allreduce = coeff[first % G, ri][None, :] * (par[i] - par[js])[:, None] / r  # allreduce_at, per (j, first)
    stage = combine_stage_time(compute, r, allreduce, 0.0)  # no cut before it (the first stage)
    prev_first = first[:, None] - np.asarray(R)[None, :]
    ld = load[np.clip(prev_first, 0, None) % G, np.arange(len(R))[None, :], ri]  # prev_first < 0: best is inf there
    timed = combine_stage_time(compute[:, :, None], r, allreduce[:, :, None], cut[js][:, None, None] * ld[None])
    cand = np.maximum(best[js][:, first, :], timed)
    start = js == 0  # the first stage: no cut before it, and it starts at rank 0
    if start.any():
        cand[start, :, :] = np.inf
        if d_lo == r:
            cand[start, 0, 0] = stage[start, 0]
    flat = cand.reshape(len(js), -1)
    arg = np.argmin(flat, axis=0)
    val = flat[arg, np.arange(flat.shape[1])].reshape(len(d), len(R))
    j_best = js[arg].reshape(len(d), len(R))
    p_best = np.argmin(val, axis=1)
    v = val[np.arange(len(d)), p_best]
    better = v < best[i, d, ri]
    best[i, d[better], ri] = v[better]
    choice[i, d[better], ri] = np.stack([j_best[np.arange(len(d)), p_best], p_best], axis=1)[better]
