"""Warm start: an exact dynamic program over ONE topological order of the units.

Stages are then contiguous ranges of that order (a range of a topological order
is always convex, so the result is a valid plan). For a graph whose topological
order is unique (a chain) this is the optimum; on branchy graphs it is a good
incumbent for CP-SAT to start from. Like PipeDream's dynamic program, a cut is
charged once with the replicas of the stage before it and once with those of
the stage after it, which is exactly ``2A / (B·min(r_before, r_after))``.

Memory and shared (tied) weights are ignored here; CP-SAT checks them.
Cost: O(n · |allowed r|) numpy operations on n × K arrays; ``order_bisect.best_order_dp``
bisects on T instead where that is large.
"""
from __future__ import annotations

import math
from typing import Callable, List, NamedTuple, Optional, Sequence

import networkx as nx
import numpy as np

from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions, stage_time_s
from passes.partition.memory_guard import past

class Solution(NamedTuple):
    """A plan on units, as the DPs return it."""

    stage_of: List[int]  # stage per unit
    replicas: List[int]  # per stage
    objective: float  # the plan's bottleneck (s)


def topo_orders(units: Units) -> List[List[int]]:
    """A few topological orders: the profile's own, and depth-first ones that keep branches together."""
    g = nx.DiGraph()
    g.add_nodes_from(range(len(units)))
    g.add_edges_from(units.edges)
    orders = [list(range(len(units)))]
    if not all(u < v for u, v in units.edges):
        orders = [list(nx.lexicographical_topological_sort(g))]
    rooted = g.copy()
    rooted.add_edges_from((-1, n) for n in g if g.in_degree(n) == 0)
    orders.append([n for n in reversed(list(nx.dfs_postorder_nodes(rooted, -1))) if n != -1])
    sinks = g.reverse(copy=True)
    sinks.add_edges_from((-1, n) for n in g if g.out_degree(n) == 0)
    orders.append([n for n in nx.dfs_postorder_nodes(sinks, -1) if n != -1])
    valid = []
    for order in orders:
        pos = {u: i for i, u in enumerate(order)}
        if len(order) == len(units) and all(pos[u] < pos[v] for u, v in units.edges):
            order = _inputs_first_output_last(order, units)
            if order not in valid:
                valid.append(order)
    return valid


def _inputs_first_output_last(order: List[int], units: Units) -> List[int]:
    inputs = [u for u in order if units.is_input[u]]
    outputs = [u for u in order if units.is_output[u]]
    rest = [u for u in order if not units.is_input[u] and not units.is_output[u]]
    return inputs + rest + outputs


def order_dp(units: Units, opts: CostOptions, order: Sequence[int], deadline: float = math.inf,
             times: Optional[Callable] = None) -> Optional[Solution]:
    """Best contiguous partition of ``order``; None if no plan uses the devices as required
    or the deadline (``time.monotonic()``) passes first. Its table holds the best bottleneck of every
    prefix on every device total: where that is large, ``order_bisect`` finds the same optimum.
    ``times(compute, params, cut_in, cut_out, r, width)``: the stage times of the ranges ending at a
    position (one row each) for r replicas and each of the ``width`` device totals before the stage,
    or one column for all (the default: ``stage_time_s``; ``order_placed`` charges the ranks)."""
    if times is None:
        def times(c, p, cut_in, cut_out, r, width):
            return stage_time_s(c, p, cut_in, cut_out, r, opts)[:, None]
    n, K = len(order), opts.devices
    comp, par, work, cut, first_cut = order_sums(units, order)
    best = np.full((n + 1, K + 1), np.inf)
    best[0, 0] = 0.0
    choice = np.zeros((n + 1, K + 1, 2), dtype=np.int64)
    for i in range(1, n + 1):
        if past(deadline):
            return None
        js = np.arange(i)
        ok = (work[i] - work[:i] >= 1) & ((js == 0) | (js >= first_cut))
        if not ok.any():
            continue
        for r in opts.allowed_replicas():
            g = np.array(times(comp[i] - comp[:i], par[i] - par[:i], cut[:i], cut[i], r, K + 1 - r), dtype=float)
            g[~ok] = np.inf
            cand = np.maximum(best[:i, : K + 1 - r], g)
            arg = np.argmin(cand, axis=0)
            val = cand[arg, np.arange(K + 1 - r)]
            better = val < best[i, r:]
            best[i, r:][better] = val[better]
            choice[i, r:][better] = np.stack([arg, np.full_like(arg, r)], axis=1)[better]
    devices = [K] if not opts.fewer_devices else range(1, K + 1)
    m = min(devices, key=lambda d: best[n, d])
    if not np.isfinite(best[n, m]):
        return None
    return _walk_back(choice, order, n, m, float(best[n, m]))


def order_sums(units: Units, order: Sequence[int]):
    """Prefix sums along ``order`` (compute, weight bytes, units with compute), the bytes crossing each
    position (``_cut_bytes``), and the first position a stage may start at after position 0 (every
    input lies in the first stage)."""
    comp = np.concatenate([[0.0], np.cumsum([units.compute[u] for u in order])])
    par = np.concatenate([[0.0], np.cumsum([units.param_bytes[u] for u in order])])
    work = np.concatenate([[0], np.cumsum([int(units.has_compute[u]) for u in order])])
    first_cut = 1 + max([i for i, u in enumerate(order) if units.is_input[u]], default=-1)
    return comp, par, work, _cut_bytes(units, order), first_cut


def _cut_bytes(units: Units, order: Sequence[int]) -> np.ndarray:
    """cut[j]: bytes produced before position j and used at or after it (cut[0] = cut[n] = 0)."""
    pos = {u: i for i, u in enumerate(order)}
    diff = np.zeros(len(order) + 2)
    for unit, nbytes, consumers in units.producers:
        start, end = pos[unit] + 1, max(pos[c] for c in consumers)
        if end >= start:
            diff[start] += nbytes
            diff[end + 1] -= nbytes
    return np.cumsum(diff)[: len(order) + 1]


def _walk_back(choice: np.ndarray, order: Sequence[int], n: int, m: int, value: float) -> Solution:
    ranges, replicas = [], []
    i = n
    while i > 0:
        j, r = (int(x) for x in choice[i, m])
        ranges.append((j, i))
        replicas.append(r)
        i, m = j, m - r
    ranges.reverse()
    replicas.reverse()
    stage_of = [0] * len(order)
    for s, (j, i) in enumerate(ranges):
        for p in range(j, i):
            stage_of[order[p]] = s
    return Solution(stage_of, replicas, value)
