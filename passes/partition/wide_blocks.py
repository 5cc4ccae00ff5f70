"""Wide blocks: a plan from a coarser lattice first, then the exact lattice proves it.

A node that sends nothing (a shape read, integer arithmetic on it) may sit in
any stage from its producer's to its consumer's, so each one that folding
keeps doubles its block's downsets. In a CPU profile they cost well under
1e-3 of sum C / K and fold away (``segments.folded_units``); in a GPU profile
every node costs about a kernel launch, so they stay: a block of the benchmark
GPT has 1,600 downsets instead of 108 (the bundled H100 profile), a flat DP
pass over 96 blocks takes about a second, and the bisection, which starts far
from the optimum, did not close in 10 s (13 % gap at K = 64). (The placed and node-floor DPs of a
two-level machine, whose passes cost far more, fold every one of them instead, their compute charged
where a stage holds both ends of a read: ``segment_plan.QUIET_PLACED``, ``Units.bridged``.)

``first_plan`` folds those nodes into their producers with their compute
charged there (a restriction: its plans are real plans), runs the chain DP
on that narrow lattice, and scores its plan on the graph; its bound, less
what the folding may cost (``fold_margin``), bounds the optimum too. The exact
search then starts from both (``chain.solve``'s ``floor`` and ``ceiling``):
its first pass sits 1 % under that plan, so one infeasible pass proves it
within 1 %, and it bisects on from there. ``better`` keeps the faster plan
and the higher bound.

``exact_plan`` is the same search on the lattice where only free nodes fold:
no compute is dropped, so its bound is the optimum's own. ``chain_plan`` runs
it where the usual one, which drops the compute of cheap shape reads, leaves
a gap (8 H100-profiled blocks on 2 devices: 2.1 %, dropping lost 1.9 % of
the bound and folding cost the plan 0.2 %).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from passes.costgraph import CostGraph
from passes.partition.chain import ChainSolution, solve as chain_solve, unit_bottleneck
from passes.partition.coarsen import Hidden, Units, to_nodes
from passes.partition.costmodel import CostOptions, evaluate
from passes.partition.segments import Segment, build_segments, fold_margin, folded_units

WIDE = 400  # a segment with more points than this: the coarse lattice goes first
SILENT = 0.01  # the coarse lattice folds nodes that send nothing up to this x sum C / K
SHARE = 0.5  # most of the time left that the coarse search may take


@dataclass
class FirstPlan:
    """The coarse search's answer."""

    units: Units  # the coarse units its plan is given on
    found: ChainSolution
    margin: float  # ``fold_margin`` of those units
    real_s: float  # the plan's bottleneck on the graph
    bound_s: float  # proven: no plan of the graph is faster


def wide(segments: List[Segment]) -> bool:
    return max((len(s.compute) for s in segments), default=0) > WIDE


def first_plan(graph: CostGraph, opts: CostOptions, deadline: float, floor: float, fold: Dict[str, float],
               hidden: Optional[Callable[[Units], List[Hidden]]] = None) -> Optional[FirstPlan]:
    """The chain DP on the coarse lattice within ``SHARE`` of the time left; None if that lattice is
    still wide or no plan comes in time. ``fold``: ``folded_units``' other thresholds, as the exact
    search uses them; ``floor``: a bound known already."""
    by = time.monotonic() + SHARE * max(0.0, deadline - time.monotonic())
    ideal = graph.total_compute_s() / opts.devices
    units, folded = folded_units(graph, opts, tiny_silent=SILENT * ideal, keep_dead=True, **fold)
    if hidden is not None:
        units.hidden += hidden(units)
    segs = build_segments(units, deadline=by)
    if segs is None or wide(segs):
        return None
    found = chain_solve(units, segs, opts, by, lambda so, r: unit_bottleneck(units, so, r, opts), floor=floor)
    if found is None or found.stage_of is None:
        return None
    margin = fold_margin(units, folded)
    real = evaluate(graph, to_nodes(graph, units, found.stage_of), found.replicas, opts).bottleneck_s
    return FirstPlan(units, found, margin, real, max(floor, found.bound - margin))


def better(graph: CostGraph, opts: CostOptions, first: FirstPlan, units: Units, found: Optional[ChainSolution],
           margin: float) -> Tuple[Units, ChainSolution, float]:
    """(units, answer, margin) as ``segment_dp`` gives them: the exact search's plan where it is faster
    on the graph, else the coarse one; the bound (answer's less margin) the higher of the two."""
    bound = max(first.bound_s, found.bound - margin) if found is not None else first.bound_s
    if found is not None and found.stage_of is not None:
        real = evaluate(graph, to_nodes(graph, units, found.stage_of), found.replicas, opts).bottleneck_s
        if real < first.real_s:
            return units, dataclasses.replace(found, bound=bound + margin), margin
    return first.units, dataclasses.replace(first.found, bound=bound + first.margin), first.margin


def exact_plan(graph: CostGraph, opts: CostOptions, deadline: float, floor: float, ceiling: float,
               tiny_input: float) -> Optional[Tuple[Dict[str, int], List[int], float]]:
    """(assignment, replicas, proven bound) from the chain DP on the units where only free nodes fold,
    the coarse lattice first where it is wide; plans only if faster than ``ceiling``; None past the
    deadline or the limit. Cheap input-only nodes stay units (placed with their first consumer they
    cost the 8-block plan above 0.19 %), unless that lattice is over the limit (an attention mask
    read by every block): then they are left out like inputs (``tiny_input``), which only lowers the
    bound and restricts the plans."""
    units, _ = folded_units(graph, opts, keep_dead=True)
    segs = build_segments(units, deadline=deadline)
    if segs is None:
        units, _ = folded_units(graph, opts, tiny_input=tiny_input, keep_dead=True)
        segs = build_segments(units, deadline=deadline)
    if segs is None:
        return None
    first = None
    if wide(segs):
        first = first_plan(graph, opts, deadline, floor, dict(tiny=0.0, tiny_input=tiny_input))
        if first is not None and first.real_s < ceiling:
            ceiling = first.real_s
        floor = max(floor, first.bound_s) if first is not None else floor
    found = chain_solve(units, segs, opts, deadline, lambda so, r: unit_bottleneck(units, so, r, opts),
                        floor=floor, ceiling=ceiling, trust_ceiling=first is not None)
    if found is None:
        return None
    if found.stage_of is not None:
        return to_nodes(graph, units, found.stage_of), found.replicas, found.bound
    if first is not None and first.real_s <= ceiling:
        return to_nodes(graph, first.units, first.found.stage_of), first.found.replicas, max(found.bound, floor)
    return {}, [], max(found.bound, floor)  # a bound, no faster plan
