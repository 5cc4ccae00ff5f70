"""Segments too wide for their lattice: plans from narrower units, a bound from a relaxation.

A Llama attention block runs the query, key and value projections side by
side, each with its own reshapes, and the query and key their own rotary
products; the downsets of such a segment are the product of the branches'
(6,790 on a tiny HF Llama, past ``segments.build_segments``' limit of 4,000;
3,220 where its rotary reads are left out like inputs, past ``LIMIT``), so
the segment DP had no lattice, or none it could search in time, and the
planner fell back to CP-SAT on coarsened units (24 layers on 512 devices: no
plan in 10 s, the uniform layout answered, 41 % open).

Four restrictions give plans (each a plan of the graph, scored there; their
DP bound is no bound, and the caller drops it):

* ``narrowed``: in every wide segment each unit without weights joins its
  latest producer's group (one not computed from the inputs alone), so the
  lattice is about that of the weighted units: a Llama block's norm, its three
  projections with their reshapes and rotary products, then attention;
* ``merged``: every wide segment one unit, cut only at its separators (the
  residual stream before and after it);
* ``chained``: every wide segment a chain of its units in their order, so a
  stage may end between any two of them, inside a branch too (with it the
  24-layer Llama's plans came out 0.06-2.4 % faster on 8-1,024 devices);
* ``paired``: every wide segment two chains, its heaviest path and the rest,
  so a stage may cut the two at different places (a lattice of at most the
  product of their lengths plus one each: 136-142 points a Llama block, where
  the whole block has 6,791); it holds every ``chained`` plan, and the Llama's
  plans came out up to 0.5 % faster on 32-512 devices, never slower (a third
  chain, the next heaviest path, took 8.6-10.6 s a search instead of 2).

``relaxed`` is the bound's side: in every segment of more than ``NARROW``
downsets the weightless nodes (reshapes, rotary products, the norm's
arithmetic; not the segment's last unit, whose value the next segment reads)
cost nothing and send nothing. Any plan is a plan there and no slower (less
compute, no cut larger), and such nodes fold into their producers
(``segments.folded_units``). The compute taken off still counts in the
devices of every prefix holding a unit that runs after it (``branches.forced_compute``):
the bound gives up how it splits between stages, which on the Llama is about
a fifth of the compute, so the bound rarely rises above sum C / K
(``segment_plan.finer_bound`` keeps a segment whole up to
``segments.MAX_DOWNSETS`` and past it frees only the side chains that make it
wide, ``side_chains.py``).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Dict, List, Optional, Tuple

from passes.costgraph import CostGraph
from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions
from passes.partition.memory_guard import past
from passes.partition.segments import Segment, _Lattices, folded_units, separators

LIMIT = 2000  # a segment of more downsets is wide here: a flat DP pass over 24 Llama layers of 3,220 each
# (the rotary reads left out like inputs) took the whole 10 s and 1.6 GB; the H100-profiled GPT's 1,588 are
# narrowed by ``wide_blocks.first_plan`` and proven in seconds
NARROW = 400  # ``relaxed`` frees the segments wider than this, as ``wide_blocks.WIDE``: freeing only those
# over ``LIMIT`` left the Llama blocks of the relaxed graph (rotary reads free) at 3,220 downsets each, and
# its DP took the whole 10 s


def merged(units: Units, limit: int = LIMIT, deadline: float = math.inf) -> Optional[Units]:
    """``units`` with each separator-bounded segment whose downsets exceed ``limit`` as one unit; None
    where none does (nothing to merge), or past ``deadline``."""
    runs = wide_runs(units, limit, deadline)
    return merge_runs(units, runs) if runs else None


def relaxed(graph: CostGraph, opts: CostOptions, limit: int = NARROW,
            deadline: float = math.inf) -> Optional[Tuple[CostGraph, List[str]]]:
    """(the relaxed graph, the nodes made free) (see the module docstring) in every segment of more
    than ``limit`` downsets; None where there is none, or past ``deadline``."""
    units, _ = folded_units(graph, opts, keep_dead=True)
    runs = wide_runs(units, limit, deadline)
    if not runs:
        return None
    freed = [name for run in runs for u in run[:-1] for name in units.members[u] if weightless(graph, name)]
    return free_nodes(graph, freed), freed


def weightless(graph: CostGraph, name: str) -> bool:
    """Whether node ``name`` holds no weight: a relaxation may make it free (``relaxed``, ``side_chains``)."""
    node = graph.nodes[name]
    return not node.params and node.param_bytes == 0


def free_nodes(graph: CostGraph, names: List[str]) -> CostGraph:
    """``graph`` with ``names`` costing nothing and sending nothing (they then fold into their producers)."""
    nodes = dict(graph.nodes)
    for name in names:
        nodes[name] = dataclasses.replace(nodes[name], fwd_s=0.0, bwd_s=0.0, out_bytes=0)
    return CostGraph(nodes=nodes, edges=list(graph.edges), info=dict(graph.info),
                     param_sizes=dict(graph.param_sizes))


def too_wide(segments: List[Segment]) -> bool:
    """Whether some segment has more than ``LIMIT`` points (see there)."""
    return max((len(s.compute) for s in segments), default=0) > LIMIT


def wide_runs(units: Units, limit: int = LIMIT, deadline: float = math.inf) -> Optional[List[range]]:
    """The separator-bounded segments of ``units`` whose downsets exceed ``limit``; None past
    ``deadline``."""
    n = len(units)
    cuts = [sum(units.is_input)] + separators(units) + [n]
    lattices = _Lattices(units, limit)
    runs: List[range] = []
    for a, b in zip(cuts, cuts[1:]):
        if past(deadline):
            return None
        if b - a > 1 and lattices.downsets(list(range(a, b)), b == n) is None:
            runs.append(range(a, b))
    return runs


def merge_runs(units: Units, runs: List[range]) -> Units:
    """``units`` with each run of consecutive units as one (see ``merge_groups``)."""
    group_of, k, i = [0] * len(units), 0, 0
    starts = {r.start: r for r in runs}
    while i < len(units):
        run = starts.get(i, range(i, i + 1))
        for u in run:
            group_of[u] = k
        k, i = k + 1, run.stop
    return merge_groups(units, group_of)


def merge_groups(units: Units, group_of: List[int]) -> Units:
    """``units`` with the units of each group as one unit: ``group_of[u]`` numbers u's group, the groups
    in a topological order. Costs are summed; edges and values between members are dropped; a weight
    all of whose users merge is owned by the merged unit."""
    k = max(group_of, default=-1) + 1
    groups: List[List[int]] = [[] for _ in range(k)]
    for u, g in enumerate(group_of):
        groups[g].append(u)
    new = group_of
    shared, owned = {}, [0] * k
    for p, (nbytes, users) in units.shared.items():
        now = sorted({new[u] for u in users})
        if len(now) > 1:
            shared[p] = (nbytes, now)
        else:
            owned[now[0]] += nbytes
    producers = []
    for u, nbytes, consumers in units.producers:
        outside = sorted({new[c] for c in consumers} - {new[u]})
        if outside:
            producers.append((new[u], nbytes, outside))
    return Units(
        members=[sum((units.members[u] for u in g), []) for g in groups],
        compute=[math.fsum(units.compute[u] for u in g) for g in groups],
        param_bytes=[sum(units.param_bytes[u] for u in g) + owned[j] for j, g in enumerate(groups)],
        act_bytes=[sum(units.act_bytes[u] for u in g) for g in groups],
        has_compute=[any(units.has_compute[u] for u in g) for g in groups],
        is_input=[all(units.is_input[u] for u in g) for g in groups],
        is_output=[any(units.is_output[u] for u in g) for g in groups],
        edges=sorted({(new[a], new[b]) for a, b in units.edges if new[a] != new[b]}),
        producers=producers,
        shared=shared,
        hidden=[(s, sorted({new[u] for u in forcing}), new[home] if home >= 0 else -1, sorted({new[u] for u in after}))
                for s, forcing, home, after in units.hidden],
        hidden_sends=[(nbytes, sorted({new[u] for u in holders}), sorted({new[u] for u in needers}),
                       sorted({new[u] for u in blockers}))
                      for nbytes, holders, needers, blockers in units.hidden_sends],
        bridged=[(s, new[a], new[b], new[j]) for s, a, b, j in units.bridged],
    )


def chained(units: Units, limit: int = LIMIT, deadline: float = math.inf) -> Optional[Units]:
    """``units`` with every segment whose downsets exceed ``limit`` made a chain in the units' order (an
    edge from each of its units to the next): a restriction whose stages are runs of that order, so a
    stage boundary may fall between any two of its nodes, inside a branch too, where ``narrowed`` cuts only
    between groups; what a cut sends is still what crosses it in the graph. None where no segment is
    wide, or past the deadline."""
    runs = wide_runs(units, limit, deadline)
    if not runs:
        return None
    return _linked(units, [list(run) for run in runs])


def _linked(units: Units, chains: List[List[int]]) -> Units:
    """``units`` with an edge from each unit of every chain to the next one in it."""
    links = {link for chain in chains for link in zip(chain, chain[1:])}
    return dataclasses.replace(units, edges=sorted(set(units.edges) | links))


def paired(units: Units, limit: int = LIMIT, deadline: float = math.inf) -> Optional[Units]:
    """``units`` with every segment whose downsets exceed ``limit`` made two chains: the units on its
    heaviest path (by compute, ending at its last unit) and the rest, each in the units' order, so a stage
    boundary may cross the heaviest branch and the others at different places. The units' order is still
    a linear extension, so every ``chained`` plan is one of these. None where no segment is wide, or
    past the deadline."""
    runs = wide_runs(units, limit, deadline)
    if not runs:
        return None
    preds = units.predecessors()
    chains: List[List[int]] = []
    for run in runs:
        heaviest: Dict[int, float] = {}
        back: Dict[int, int] = {}
        for u in run:
            inside = [p for p in preds[u] if p >= run.start]
            back[u] = max(inside, key=heaviest.__getitem__) if inside else -1
            heaviest[u] = units.compute[u] + (heaviest[back[u]] if inside else 0.0)
        path, u = set(), run[-1]
        while u >= 0:
            path.add(u)
            u = back[u]
        chains += [sorted(path), [u for u in run if u not in path]]
    return _linked(units, chains)


def narrowed(units: Units, limit: int = LIMIT, deadline: float = math.inf) -> Optional[Units]:
    """``units`` with, in every segment whose downsets exceed ``limit``, each unit that holds no weights
    merged into its latest producer's group in that segment (a restriction, like ``merged``, whose
    lattice is about that of the weighted units alone); None where no segment is wide, past the
    deadline, or where the groups' graph has a cycle (checked, not expected: each unit joins the group
    of an earlier one)."""
    runs = wide_runs(units, limit, deadline)
    if not runs:
        return None
    preds = units.predecessors()
    shared = {u for _, users in units.shared.values() for u in users}
    weightless = [units.param_bytes[u] == 0 and u not in shared for u in range(len(units))]
    free = [False] * len(units)  # weightless and computed from the inputs alone: such a producer (a
    # rotary table read) would pull its readers out of their layer
    for u in range(len(units)):
        free[u] = weightless[u] and all(free[p] for p in preds[u])
    head = list(range(len(units)))  # the unit whose group each unit joins
    for run in runs:
        for u in run[:-1]:  # the last unit is the separator the next segment reads
            inside = [p for p in preds[u] if p >= run.start and not free[p]]
            if inside and weightless[u]:
                head[u] = head[max(inside)]
    return joined(units, head)


def joined(units: Units, head: List[int]) -> Optional[Units]:
    """``units`` with each unit merged into the group of ``head[u]`` (a unit heading its own group maps to
    itself), the groups numbered in a topological order; None where the groups' graph has a cycle."""
    order = topological({(head[a], head[b]) for a, b in units.edges if head[a] != head[b]}, sorted(set(head)))
    if order is None:
        return None
    number = {h: k for k, h in enumerate(order)}
    return merge_groups(units, [number[head[u]] for u in range(len(units))])


def topological(edges, nodes: List[int], lifo: bool = False) -> Optional[List[int]]:
    """``nodes`` in a topological order of ``edges``, the smallest ready node first (so groups keep their
    units' order where they can), or with ``lifo`` the node made ready last (a branch finished before the
    next, ``polish.py``'s second order); None if the edges have a cycle."""
    succ: Dict[int, List[int]] = {n: [] for n in nodes}
    waiting = {n: 0 for n in nodes}
    for a, b in edges:
        succ[a].append(b)
        waiting[b] += 1
    ready = [n for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    out: List[int] = []
    while ready:
        n = ready.pop() if lifo else heapq.heappop(ready)
        out.append(n)
        for m in succ[n]:
            waiting[m] -= 1
            if waiting[m] == 0:
                if lifo:
                    ready.append(m)
                else:
                    heapq.heappush(ready, m)
    return out if len(out) == len(nodes) else None
