"""The uniform layout a person would pick by hand, scored as a candidate plan.

Megatron-style PP x DP: the graph's topological order (a ``CostGraph`` keeps
its nodes in one) cut into PP pieces of about equal compute, each replicated
DP = K / PP times. A contiguous run of a
topological order is convex (a path between two of its nodes runs through
nodes ordered between them), so every such layout is a valid plan. Each cut is
moved, within a small window around its equal-compute point, to where the
fewest bytes are live (between transformer blocks, the residual stream alone);
a second layout per PP takes the cuts, among positions no wider than those,
that make the heaviest stage lightest (a stack of equal blocks after a heavier
embedding: equal blocks per stage, as by hand).

The partitioner scores every PP under the same cost model and keeps the best
one when it beats what its search found (``driver.partition``): a search cut
short by the time limit should not hand back less than this. The layouts say
nothing about the bound.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from passes.costgraph import CostGraph
from passes.partition.costmodel import CostOptions, Evaluation, evaluate

WINDOW = 0.25  # of a stage's share of compute: how far a cut may move to find fewer live bytes


def _live_bytes(graph: CostGraph, order: List[str]) -> np.ndarray:
    """``live[p]``: bytes of values made before position p and read at p or later."""
    at = {n: k for k, n in enumerate(order)}
    last = {n: at[n] for n in order}
    for u, v in graph.edges:
        last[u] = max(last[u], at[v])
    delta = np.zeros(len(order) + 1)
    for n in order:
        if last[n] > at[n]:
            delta[at[n] + 1] += graph.nodes[n].out_bytes
            delta[last[n] + 1] -= graph.nodes[n].out_bytes
    return np.cumsum(delta)[:len(order)]


def layouts(graph: CostGraph, opts: CostOptions):
    """Every uniform layout (stage per node, replicas) allowed by ``opts``: PP stages of K / PP replicas."""
    order = graph.order()  # a CostGraph keeps its nodes in a topological order
    compute = np.array([graph.nodes[n].compute_s for n in order])
    before = np.concatenate([[0.0], np.cumsum(compute)])  # compute before each position
    live = _live_bytes(graph, order)
    allowed = set(opts.allowed_replicas())
    K = opts.devices
    for pp in range(1, K + 1):
        if K % pp or K // pp not in allowed or pp > max(1, int(np.count_nonzero(compute))):
            continue
        seen = set()
        near = _cuts(before, live, pp)
        for cuts in (near, _balanced_cuts(before, live, pp, near)):
            if cuts is None or tuple(cuts) in seen:
                continue
            seen.add(tuple(cuts))
            stage = np.searchsorted(np.array(cuts), np.arange(len(order)), side="right") - 1
            yield {n: int(stage[k]) for k, n in enumerate(order)}, [K // pp] * pp


def _cuts(before: np.ndarray, live: np.ndarray, pp: int) -> Optional[List[int]]:
    """Where the pp stages start: each cut near the point that splits what the earlier cuts left over
    the stages left, at the fewest live bytes within ``WINDOW`` of a stage's share, then the nearest;
    None where a stage finds no cut."""
    total, cuts = before[-1], [0]
    for s in range(1, pp):
        share = (total - before[cuts[-1]]) / (pp - s + 1)  # what is left, spread over the stages left
        target = before[cuts[-1]] + share
        near = np.nonzero(np.abs(before[:-1] - target) <= WINDOW * share)[0]
        near = near[near > cuts[-1]]
        if not near.size:
            return None
        near = near[live[near] <= live[near].min() * 1.01]  # the fewest live bytes, then the nearest
        cuts.append(int(near[np.argmin(np.abs(before[near] - target))]))
    return cuts


def _balanced_cuts(before: np.ndarray, live: np.ndarray, pp: int, near: Optional[List[int]]) -> Optional[List[int]]:
    """Where the pp stages start when every cut crosses no more live bytes than the widest of ``near``
    (``_cuts``; between transformer blocks: the residual stream alone), chosen so the heaviest stage
    computes least.

    ``_cuts`` places each cut near an equal-compute point, so a first stage that also holds the
    embedding ends a fraction of a block early and pushes that fraction down the pipeline, until
    one stage runs a block's worth over the rest. Here the cuts may sit at any position no wider
    than those, and the least heaviest stage over them is bisected: at a bound, cutting as late as
    it allows makes the fewest stages (a split short of pp stages halves its heaviest ones). None without ``near`` or with fewer such positions than cuts."""
    if near is None or pp == 1:
        return None
    total = before[-1]
    inner = np.arange(1, len(live))
    cand = inner[live[inner] <= max(live[c] for c in near[1:]) * (1 + 1e-9)]
    if cand.size < pp - 1:
        return None
    at = before[cand]

    def greedy(bound: float) -> Optional[List[int]]:
        cuts = [0]
        while total - before[cuts[-1]] > bound:
            k = int(np.searchsorted(at, before[cuts[-1]] + bound, side="right")) - 1
            if k < 0 or cand[k] <= cuts[-1] or len(cuts) == pp:
                return None
            cuts.append(int(cand[k]))
        return cuts

    lo, hi = total / pp, total
    best = greedy(hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        found = greedy(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    while best is not None and len(best) < pp:  # fewer stages than pp: halve the heaviest that has a cut inside
        best = _halved(best, before, cand)
    return best


def _halved(cuts: List[int], before: np.ndarray, cand: np.ndarray) -> Optional[List[int]]:
    """``cuts`` with the heaviest stage that holds a candidate cut split at the one nearest its middle."""
    ends = cuts[1:] + [len(before) - 1]
    for s in sorted(range(len(cuts)), key=lambda s: before[cuts[s]] - before[ends[s]]):
        inside = cand[(cand > cuts[s]) & (cand < ends[s])]
        if inside.size:
            mid = (before[cuts[s]] + before[ends[s]]) / 2
            return sorted(cuts + [int(inside[np.argmin(np.abs(before[inside] - mid))])])
    return None


def best_layout(graph: CostGraph, opts: CostOptions) -> Optional[Tuple[Evaluation, Dict[str, int], List[int]]]:
    """The fastest uniform layout under ``opts`` (within its memory limit, if any), or None."""
    best = None
    for assignment, replicas in layouts(graph, opts):
        ev = evaluate(graph, assignment, replicas, opts)
        if opts.memory is not None and ev.peak_memory_bytes > opts.memory:
            continue
        if best is None or ev.bottleneck_s < best[0].bottleneck_s:
            best = (ev, assignment, replicas)
    return best
