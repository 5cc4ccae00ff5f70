"""PipeDream's hierarchical optimizer, level by level, as it computes it.

PipeDream (msr-fiddle/pipedream, ``optimizer/optimizer_graph_hierarchical.py``,
run as ``-n n_1 n_2 ... -b B_1 B_2 ...``) plans for a machine built in levels:
n_1 GPUs joined at B_1 form a node, n_2 nodes joined at B_2 form the next
level, and so on. What it computes, restated here (fxpipe's own code):

* States are the downsets of the graph in a topological order (PipeDream
  reaches them as antichains; on a chain they are the prefixes). A segment
  ``(a, b)`` is what downset b holds beyond downset a. Inputs are removed
  first: no compute, no weights, no activation.
* Level 1 runs PipeDream's flat dynamic program on ``T_0(a, b)`` = the
  segment's compute (forward + backward) for EVERY start a, with n_1 machines
  at B_1, giving ``A_1(a, b, m)``: the best time per minibatch of the segment
  on m machines of this level.
* Level l uses ``T_{l-1}(a, b) = A_{l-1}(a, b, n_{l-1})`` (the segment on one
  whole machine of the level below, already optimised) as the "compute" of a
  segment, and runs the same program with n_l machines at B_l. The last level
  only needs segments starting at the empty downset.
* The program (``A(a, b, m)``, m machines): either the whole segment as one
  stage replicated m times, ``(T(a, b) + 4(m-1)P/(B·m) / w) / m``, where
  ``w`` is the machine count of the level below (1 at level 1; PipeDream
  divides only this, the first stage's, all-reduce by it), or a split at a
  downset k, a ⊂ k ⊂ b, giving m' machines to the last stage ``(k, b)``:
  ``max(A(a, k, m - m'), (T(k, b) + 4(m'-1)P_kb/(B·m')) / m')`` and, when
  activations are counted (PipeDream's ``--activation_compression_ratio 1``),
  ``2·out(k)/(B·m')`` and, unless b is the last state, ``2·out(b)/(B·m')``.
  Ties keep the one-stage option; among splits of equal time the latest k
  wins, then the fewest m'. (PipeDream visits k in the order of a Python
  set of objects, i.e. by memory address, so its pick among ties is not
  reproducible; this rule gives its published layouts. On vgg16 with
  ``-n 4 4`` the last node's 1-1-1-1 ties with 2-1-1 at 7.05 ms.)
* The time per minibatch PipeDream reports is ``A_L(empty, all, n_L)`` of the
  last level. The plan is read top down: the last level's stages get whole
  machines of the level below; each is split again by the level below's
  answer on its segment with all of that level's machines, and so on. A flat
  stage's GPU count is the product of its counts at every level; its ranks
  are the same sub-block of every node of its top-level stage, listed with
  the node varying fastest, so that round robin (replica m mod r) keeps every
  microbatch on one node, as PipeDream's per-node pipelines do.

Because each level takes the levels below as already solved (and the flat
stages of one top-level stage must be identical on every node), this is not
the optimum of a two-level machine; ``partition(..., gpus_per_node=G)``
searches that exactly (see ``costmodel.allreduce_at`` for its charges).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from passes.costgraph import CostGraph
from passes.errors import FxpipeError
from passes.partition.coarsen import build_units
from passes.partition.costmodel import CostOptions
from passes.partition.downsets import enumerate_downsets
from passes.partition.memory_guard import past


@dataclass
class HierarchicalResult:
    time_s: float  # PipeDream's reported time per minibatch
    replicas: List[int]  # GPUs per flat stage, e.g. [12, 1, 1, 1, 1]
    ranks: List[List[int]]  # PipeDream's placement of every flat stage
    assignment: Dict[str, int]  # node -> flat stage (inputs in stage 0)


@dataclass
class _States:
    masks: List[int]  # masks[0] is the empty (inputs-only) downset
    sub: np.ndarray  # sub[a, b]: masks[a] strictly inside masks[b]
    comp: np.ndarray
    par: np.ndarray
    out: np.ndarray  # activation bytes leaving each downset


def pipedream_hierarchical(graph: CostGraph, machines: Sequence[int], bandwidths: Sequence[float],
                           activations: bool = True, limit: int = 5000,
                           deadline: float = math.inf) -> HierarchicalResult:
    """PipeDream's answer for ``-n machines... -b bandwidths...`` (innermost level first).

    ``deadline`` (``time.monotonic()``): raise ``OutOfTime`` past it. Its tables grow with the square
    of the downsets (resnext101's ~1,000 took 3.7 s), and ``partition`` runs it after its search,
    for comparison, inside the same time limit."""
    if len(machines) != len(bandwidths) or not machines:
        raise FxpipeError(f"hierarchical: one bandwidth per level, got {list(machines)} and {list(bandwidths)}")
    st, units = _states(graph, limit)
    _check(deadline)
    D = len(st.masks)
    C = np.where(st.sub, st.comp[None, :] - st.comp[:, None], np.inf)
    P = np.where(st.sub, st.par[None, :] - st.par[:, None], 0.0)
    T, tables, within = C, [], 1
    for level, (n, B) in enumerate(zip(machines, bandwidths)):
        starts = [0] if level == len(machines) - 1 else list(range(D))
        A, choice = _level(T, P, st, n, B, within, starts, activations, deadline)
        tables.append((A, choice, n))
        T, within = A[:, :, n - 1], n
    time_s = float(tables[-1][0][0, D - 1, machines[-1] - 1])
    if not np.isfinite(time_s):
        raise FxpipeError("hierarchical: no plan (the graph has fewer stages than levels need)")
    segments = _read_plan(tables, 0, D - 1, len(tables) - 1)
    return _flatten(graph, units, st, segments, machines, time_s)


def _states(graph: CostGraph, limit: int) -> Tuple[_States, object]:
    units = build_units(graph, CostOptions(devices=1, cost_model="pipedream"), [[n] for n in graph.nodes])
    masks = enumerate_downsets(units, limit)
    if masks is None:
        raise FxpipeError(f"hierarchical: the graph has more than {limit} downsets; PipeDream's optimizer "
                          "needs its branch compression there, which fxpipe does not reproduce")
    n = len(units)
    member = np.array([[(m >> u) & 1 for u in range(n)] for m in masks], dtype=bool)
    real = ~np.asarray(units.is_input)
    comp = member @ np.where(real, units.compute, 0.0)
    par = member @ np.where(real, np.asarray(units.param_bytes, dtype=float), 0.0)
    out = np.zeros(len(masks))
    for unit, nbytes, consumers in units.producers:
        if not units.is_input[unit]:
            cmask = sum(1 << c for c in consumers)
            out += np.array([bool((m >> unit) & 1) and bool(cmask & ~m) for m in masks]) * float(nbytes)
    packed = np.packbits(member, axis=1)
    sub = np.array([~(packed & ~packed[b]).any(axis=1) for b in range(len(masks))]).T
    np.fill_diagonal(sub, False)
    return _States(masks, sub, comp, par, out), units


class OutOfTime(FxpipeError):
    """The reproduction did not finish by its deadline."""


def _check(deadline: float) -> None:
    if past(deadline):
        raise OutOfTime("hierarchical: PipeDream's optimizer did not finish within the time limit "
                        "(or the planner's memory budget)")


def _level(T, P, st: _States, n: int, B: float, within: int, starts, activations: bool,
           deadline: float = math.inf):
    """``A[a, b, m-1]`` for m = 1..n machines of this level, and the split chosen (k, m') or (-1, 0)."""
    D = len(st.masks)
    m = np.arange(1, n + 1)
    A = np.full((D, D, n), np.inf)
    A[starts] = ((T[starts][:, :, None] + 4 * (m - 1) * P[starts][:, :, None] / (B * m) / within) / m)
    A[~st.sub] = np.inf
    choice = np.full((D, D, n, 2), -1, dtype=np.int64)
    last_bytes = np.where(np.arange(D) == D - 1, 0.0, st.out)
    mp = np.arange(1, n)
    for a in starts:
        _check(deadline)
        after = np.nonzero(st.sub[a])[0]
        ks, bs = after[::-1], after  # ties: the latest split first
        if not ks.size or n < 2:
            continue
        inside = st.sub[np.ix_(ks, bs)]  # k strictly inside b
        last = (T[np.ix_(ks, bs)][:, :, None] + 4 * (mp - 1) * P[np.ix_(ks, bs)][:, :, None] / (B * mp)) / mp
        if activations:
            sent = 2 * np.maximum(st.out[ks][:, None], last_bytes[bs][None, :])
            last = np.maximum(last, sent[:, :, None] / (B * mp))
        last[~inside] = np.inf
        for mm in range(2, n + 1):  # A(a, ., mm) only needs fewer machines: all b at once
            cand = np.maximum(A[a, ks][:, mm - mp[: mm - 1] - 1][:, None, :], last[:, :, : mm - 1])
            per_b = cand.transpose(1, 0, 2).reshape(len(bs), -1)  # per b: (k latest first, m' ascending)
            pick = np.argmin(per_b, axis=1)
            val = per_b[np.arange(len(bs)), pick]
            better = val < A[a, bs, mm - 1]
            A[a, bs[better], mm - 1] = val[better]
            choice[a, bs[better], mm - 1] = np.stack([ks[pick // (mm - 1)], mp[pick % (mm - 1)]], axis=1)[better]
    return A, choice


def _read_plan(tables, a: int, b: int, level: int) -> List[Tuple[int, int, List[int]]]:
    """Flat stages of segment (a, b) on one machine of ``level``: (start, end, count per level, outer first)."""
    A, choice, n = tables[level]
    stages, mm = [], n
    while True:
        k, mp = (int(x) for x in choice[a, b, mm - 1])
        start, count = (a, mm) if k < 0 else (k, mp)
        inner = _read_plan(tables, start, b, level - 1) if level > 0 else [(start, b, [])]
        stages = [(s, e, [count] + counts) for s, e, counts in inner] + stages
        if k < 0:
            return stages
        b, mm = k, mm - mp


def _flatten(graph: CostGraph, units, st: _States, stages, machines: Sequence[int], time_s: float) -> HierarchicalResult:
    """GPU counts, PipeDream's ranks (a sub-block of every machine) and the node assignment."""
    replicas = [int(np.prod(counts)) for _, _, counts in stages]
    sizes = [int(np.prod(machines[:i])) for i in range(len(machines))]  # ranks per machine of each level
    ranks, offset = [], [0] * len(machines)
    for _, _, counts in stages:
        blocks = [0]
        for level in range(len(machines) - 1, -1, -1):  # replica order: the outermost level varies fastest
            c = counts[len(machines) - 1 - level]
            blocks = [base + (offset[level] + i) * sizes[level] for i in range(c) for base in blocks]
        ranks.append(blocks)
        _advance(offset, counts, machines)
    stage_of = {}
    for s, (start, end, _) in enumerate(stages):
        for u in range(len(units)):
            if (st.masks[end] >> u) & 1 and not (st.masks[start] >> u) & 1:
                for name in units.members[u]:
                    stage_of[name] = s
    assignment = {name: stage_of.get(name, 0) for name in graph.nodes}
    return HierarchicalResult(time_s=time_s, replicas=replicas, ranks=ranks, assignment=assignment)


def _advance(offset: List[int], counts: Sequence[int], machines: Sequence[int]) -> None:
    """Move past a flat stage: its innermost block; a level whose machines are all used starts the next block up."""
    L = len(machines)
    offset[0] += counts[L - 1]
    for level in range(L - 1):
        if offset[level] < machines[level]:
            return
        offset[level] = 0
        offset[level + 1] += counts[L - 2 - level]
