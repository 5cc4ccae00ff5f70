"""Flat graphs whose segments the DP cannot take whole (inception_v3): a bound that charges the cuts,
and a plan from a restriction of the same lattices, beside CP-SAT's.

inception_v3's modules run four branches of convolutions side by side (up to
9,201 downsets a module, past ``segments.build_segments``' limit), and its
auxiliary classifier hangs off the middle of the network and ends in a result of
its own, so no node after it is a separator and its last 96 units are one
segment of 204,457 downsets. The planner runs CP-SAT there, whose bound on
coarsened units is no bound of the graph: the answer was bounded by Σ compute / K
alone, which leaves out what the cuts cost. At 1.25 GB/s a cut there carries up
to 110 MB, and the plans read 30-49 % above that bound on 16 and 32 devices.

``relaxed`` builds a graph every plan maps to with no stage slower:

* *side branches* (``side_branch``): the nodes the main result does not depend
  on (the auxiliary classifier) cost nothing, send nothing and hold no weights,
  so they fold into the node they branch from; every plan still runs their
  compute, so it counts in the devices of the whole graph (the full prefix, the
  only one that must hold it: a plan may run the branch in stages of its own
  after the rest, which ``ChainSolver._late`` counts like any stage of a branch
  alone);
* the weightless nodes of segments still too wide (ReLUs, pools, concatenations)
  cost nothing but still *send* their values, unlike ``wide_segments.relaxed``
  (whose freed nodes fall silent, so a cut through a branch would cost
  nothing): most read one value that goes to them alone and fold into its
  producer exactly, so a branch's chain is about a third shorter; their compute
  counts in every prefix that must run it (``branches.forced_compute``), and in
  the stage itself where that stage holds the units they run between
  (``pins.py``). With ``light`` (the planner's ``LIGHT``) the nodes with tiny
  weights go too (batch norms): the branches halve, a bisection costs 0.3-0.8 s,
  and the bound is within 0.4 % of the one without (pins keep the freed compute
  where it runs).

The segment DP on that graph bounds the optimum with the cuts charged
(``bound``), before CP-SAT runs. Its own plans run the freed nodes where folding
put them and score far above their T on the graph. Plans come from CP-SAT and,
after it, from the restriction ``plan_units`` (the side branch in the stage it
leaves from, each weightless unit of a wide segment with its producer), whose
lattices are as small: inception_v3 at 1.25 GB/s, 10 s, 16 and 32 devices:
2.1-5.3 and 9.6-10.3 % open under fxpipe's charges, 2.3-2.6 and 3.4-5.3 % under
PipeDream's (Σ compute / K had left 24-49 %).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from passes.costgraph import CostGraph, closure
from passes.partition import branches, wide_segments
from passes.partition.coarsen import Units, model_nodes
from passes.partition.costmodel import CostOptions
from passes.partition.memory_guard import past
from passes.partition.segment_plan import segment_dp
from passes.partition.segments import MAX_DOWNSETS, folded_units

LIGHT = 1e-3  # the planner's relaxation frees nodes with weights up to this share of the heaviest's (``relaxed``)
TOLERANCE = 2e-3  # where the bisections stop (the bound's, the restriction's plan's)


@dataclass
class Relaxed:
    """The relaxed graph and what it freed."""

    graph: CostGraph
    side: List[str]  # side-branch nodes: free, silent, weightless
    freed: List[str]  # light nodes of wide segments: free, still sending


def side_branch(graph: CostGraph, opts: CostOptions) -> List[str]:
    """Placed nodes the main result does not depend on: those that are not ancestors of the result
    with the most compute upstream. The results are what the output node reads (an fx graph), or
    the nodes nobody reads (a PipeDream profile); with one result there is no side branch."""
    names = model_nodes(graph, opts)
    placed = set(names)
    preds: Dict[str, List[str]] = {n: [] for n in names}
    readers: Dict[str, int] = {n: 0 for n in names}
    for u, v in graph.edges:
        if u in placed and v in placed:
            preds[v].append(u)
            readers[u] += 1
    outputs = [n for n in names if graph.nodes[n].op == "output"]
    results = sorted({p for o in outputs for p in preds[o]}) if outputs else [n for n in names if not readers[n]]
    if len(results) < 2:
        return []
    upstream = {r: closure(r, preds) for r in results}
    main = max(results, key=lambda r: (sum(graph.nodes[n].compute_s for n in upstream[r]), len(upstream[r])))
    keep = upstream[main] | set(outputs)
    return [n for n in names if n not in keep and not graph.nodes[n].is_input]


def side_joined(units: Units, side: List[str]) -> Optional[Units]:
    """``units`` with every unit made of side-branch nodes alone merged into the group of its latest
    producer (a restriction: the branch runs in the stage it leaves the network from), so the lattice
    splits where the branch no longer runs beside the rest; None where no unit is such, or the groups
    would form a cycle (checked, not expected)."""
    quiet = set(side)
    preds = units.predecessors()
    head = list(range(len(units)))
    for u, members in enumerate(units.members):  # in topological order: a producer's head is known
        if members and all(m in quiet for m in members) and preds[u]:
            head[u] = head[max(preds[u])]
    if head == list(range(len(units))):
        return None
    return wide_segments.joined(units, head)


def plan_units(units: Units, side: List[str]) -> Optional[Units]:
    """The units a restricted search plans on (``segment_plan.segment_dp``'s ``widen``): side branches
    joined to where they leave (``side_joined``), then each weightless unit of a segment still too
    wide joined to its producer (``wide_segments.narrowed``); None where neither changes anything."""
    joined = side_joined(units, side) if side else None
    return wide_segments.narrowed(joined or units) or joined


def relaxed(graph: CostGraph, opts: CostOptions, deadline: float = math.inf, light: float = 0.0,
            narrow: int = wide_segments.NARROW) -> Optional[Relaxed]:
    """The relaxation (see the module docstring), or None where it frees nothing, its segments still do
    not build, or the deadline passes. ``light``: in the wide segments free too the nodes whose weights
    are at most this share of the heaviest node's (inception_v3's batch norms: up to 6 KB against its
    classifier's 8 MB), their weights dropped: a coarser relaxation whose passes cost a fraction.
    ``narrow``: segments of more downsets than this are wide here."""
    side = side_branch(graph, opts)
    quiet = set(side)
    nodes = {n: dataclasses.replace(node, fwd_s=0.0, bwd_s=0.0, out_bytes=0, param_bytes=0, params=())
             if n in quiet else node for n, node in graph.nodes.items()}
    stripped = CostGraph(nodes=nodes, edges=list(graph.edges), info=dict(graph.info),
                         param_sizes=dict(graph.param_sizes))
    units, _ = folded_units(stripped, opts, keep_dead=True)
    runs = wide_segments.wide_runs(units, narrow, deadline)
    if runs is None:
        return None
    heaviest = max((node.param_bytes for node in graph.nodes.values()), default=0)
    light_enough = lambda node: node.param_bytes <= light * heaviest and (light > 0 or not node.params)  # noqa: E731
    freed = [n for run in runs for u in run[:-1] for n in units.members[u]
             if n not in quiet and light_enough(stripped.nodes[n])]
    if not side and not freed:
        return None
    free = set(freed)  # their weights (none, or light ones) dropped too
    nodes = {n: dataclasses.replace(node, fwd_s=0.0, bwd_s=0.0, param_bytes=0, params=()) if n in free else node
             for n, node in stripped.nodes.items()}
    out = Relaxed(CostGraph(nodes=nodes, edges=list(graph.edges), info=dict(graph.info),
                            param_sizes=dict(graph.param_sizes)), side, freed)
    # the segment DP folds at least as much as this (tiny nodes too): its lattices are no larger
    still, _ = folded_units(out.graph, opts, keep_dead=True)
    if wide_segments.wide_runs(still, MAX_DOWNSETS, deadline) != []:
        return None
    return out


def hidden(graph: CostGraph, relax: Relaxed, units: Units) -> List[Tuple[float, List[int], int]]:
    """``Units.hidden`` of the relaxed units: the freed nodes' compute where it is forced in, and the side
    branches' in the whole graph alone (held by the one unit every other unit runs before, if any;
    else left out, which only lowers the bound)."""
    out = branches.forced_compute(graph, units, relax.freed)
    last = _only_sink(units)
    side_compute = sum(graph.nodes[n].compute_s for n in relax.side)
    if side_compute > 0 and last is not None:
        out.append((side_compute, [last], -1, []))
    return out


def _only_sink(units: Units) -> Optional[int]:
    """The unit every other unit is an ancestor of (only the whole graph holds it), or None."""
    if not len(units):
        return None
    succ: List[List[int]] = [[] for _ in range(len(units))]
    for a, b in units.edges:
        succ[a].append(b)
    last = len(units) - 1
    reaches = [False] * len(units)
    reaches[last] = True
    for u in range(last - 1, -1, -1):  # units are in a topological order
        reaches[u] = any(reaches[v] for v in succ[u])
    return last if all(reaches) else None


def bound(graph: CostGraph, opts: CostOptions, relax: Relaxed, deadline: float, floor: float,
          ceiling: float = math.inf) -> Optional[float]:
    """The relaxation's bound on the optimum of ``graph`` (at least ``floor``), its bisection started
    under ``ceiling`` (a plan's time, if known) and cut off at ``deadline``; None if no pass finished."""
    if past(deadline):
        return None
    lower = segment_dp(relax.graph, opts, deadline, hidden=lambda units: hidden(graph, relax, units),
                       floor=floor, ceiling=ceiling, bound_only=True, tolerance=TOLERANCE)
    if lower is None:
        return None
    _, found, margin = lower
    return max(floor, found.bound - margin)
