"""``partition(graph, devices, **options)``: segment DP, else downset DP or CP-SAT; map back, score.

This module holds the order in which the solvers run and how their answers combine; the segment DP's
own steps (folding, mask branches, loose ends, re-tying) are in ``segment_plan.py``, what a search
answers in ``result.py``.

A two-level machine (``gpus_per_node``) takes its own path (``_placed``):
the segment DP with the offset within a node in its state (``placed.py``;
both cost models, replication any or pow2), else on the two flat models that
bracket the machine; then the placement-aware downset DP or CP-SAT.

The answer is always scored again with the floating-point cost model
(``costmodel.evaluate``) on the ORIGINAL nodes, so the reported bottleneck
does not depend on the solver's integer scaling or on coarsening.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple


from passes.costgraph import CostGraph
from passes.errors import FxpipeError
from passes.partition.coarsen import Units, build_units, coarsen, ideal_s, model_nodes, to_nodes
from passes.partition.downsets import cheap_cut_plan, default_limit, downset_dp, enumerate_downsets
from passes.partition.costmodel import CostOptions, evaluate, flat_bound, tied_weights
from passes.partition.heuristic import Solution, topo_orders
from passes.partition.order_bisect import best_order_dp
from passes.partition.order_memory import Walk, least_memory, memory_order_dp, range_count
from passes.partition.memory_guard import MemoryGuard, past, planning
from passes.partition.result import OPTIMAL_GAP, InfeasibleError, PartitionResult, SolveResult
from passes.partition.segment_plan import QUIET, QUIET_PLACED, chain_plan
from passes.partition.work_floor import work_floor
from passes.partition import (anchors, branchy, memory_bound, memory_plan, node_floor, order_placed, placed, polish,
                              segment_plan, stash_counts, stash_ties, uniform)
from passes.partition.model_nodes import slots_of, walls_modelled

GENERAL_SHARE = 0.5  # of the time left after an unproven segment DP plan, for CP-SAT on coarsened units: it
# improved no such plan in the scale benchmark's rows (24 Llama layers on 8-1,024 devices, HF GPT-2, deep GPTs);
# the rest goes to the polish, whose splits made the 24-layer Llama's plan on 32 devices 0.24 % faster with it
FLOOR_SHARE = 0.2  # of the time, for the node-count floor DP under pow2 (``_placed_chain``)
RELAXED_SHARE = 0.1  # of the time, for the ``any`` placed DP whose bound holds under pow2 (``_placed_chain``)
RELAXED_TOLERANCE = 5e-3  # ... where it stops: the charged DP's one pass 1 % under a plan needs the time
CHARGED_SHARE = 0.9  # of the time the flat bracket leaves, for the charged placed DP (CP-SAT gets the rest)
POW2_SHARE = 0.75  # ... under pow2, where the exact-cut pass follows it (``_cuts_exact``)
FAST_SHARE = 0.2  # of the time left, for bisecting the bracket's faster model when the charged DP follows
SLOW_SHARE = 0.3  # of the time left, for bisecting the bracket's slower model when the charged DP follows
SLOW_TOLERANCE = 5e-3  # ... and where its bisection stops then (the charged DP that follows decides the answer)
UNIFORM_NEAR = 1.05  # ... and the uniform layout lies within this ratio of the bound (``_bracketed``)
EXACT_SHARE = 0.6  # of the time left, for the charged DP with exact cuts (pow2) where no answer within 1 % is proven
FINE_LEFT = 0.5  # seconds left at least for the charged DP's pass on the lattice that keeps the shape reads
FINE_ABOVE = 0.01  # ... and the gap above which it runs (within 1 % it cost CPU rows 7 s and 500 MB for nothing)
FINE_CPSAT_MAX = 600  # units up to which a coarsened CP-SAT run is followed by one on every node (``_general``)
EXACT_ROOM = 0.5  # of the time, for the segment DP where the exact downset DP could follow (``_placed``)
CHEAP_CUTS_CAP = 8  # lattices up to this many times the exact downset DP's limit get its restriction (``_placed``, ``_placed_general``)
CHEAP_CUTS_WORK = 1_000_000  # ... and within this many downset-unit pairs (its per-downset tables are built in Python, a step per pair)
CHEAP_CUTS_SHARE = 0.4  # ... and this share of the time left for it (CP-SAT gets the rest)
WIDE_SHARE = 0.5  # of the time, for the flat segment DP's wide path where the placed DPs have no lattice (``_flat_wide``)
BRANCHY_BOUND_SHARE = 0.15  # of the time at most, before CP-SAT, where the segment DP has no lattice, for a
# relaxation's bound (``branchy.py``; its whole bisection on inception_v3: 0.3-0.8 s)
BRANCHY_PLAN_SHARE = 0.1  # ... and at most, after CP-SAT, for a plan on a restriction of its lattices
PLAN_SHARE = 0.75  # of the time, for the interval placed DP (fxpipe's charges, any count) to find a first plan
BOUND_SHARE = 0.3  # ... past which its bisection stops if its plans score far above their T (``_resumed``)


def _chains(opts: CostOptions) -> bool:
    """Whether the placed DPs chain the shape reads of one unit (``read_chains.py``): with any count and
    under PipeDream's charges. Not under ``pow2`` with fxpipe's charges: the chained lattice is about
    twice the plain one, and there the plain passes and the exact-cut pass that follows need the time
    (H100-profiled GPT, 32 blocks on 1,024 devices: 0.99 -> 12 % with chains in every pass); there one
    chained pass runs last, where more than 1 % is left (``_finer``)."""
    return opts.cost_model == "pipedream" or opts.replication == "any"


def _cp_sat(units: Units, opts: CostOptions, minimise_memory: bool = False, machine: Optional[CostOptions] = None):
    """The CP-SAT model, imported here: OR-Tools loads pandas (most of a second), and plans
    the segment DP answers never need it. ``machine``: the two-level machine ``opts`` bounds
    (``model_nodes.py``)."""
    from passes.partition.model import PartitionModel
    return PartitionModel(units, opts, minimise_memory=minimise_memory, machine=machine)


def partition(graph: CostGraph, devices: int, *, time_limit: float = 60.0, workers: int = 2,
              coarsen_above: int = 300, solver: str = "auto", downset_limit: Optional[int] = None,
              progress: Optional[Callable[[str], None]] = None, **options) -> PartitionResult:
    """Best pipeline of ``graph`` on ``devices`` devices; ``options`` are ``CostOptions`` fields.

    ``solver``: ``"auto"`` tries the segment DP first (``segment_plan.chain_plan``); if it does
    not prove its plan, the downset DP when the graph has at most
    ``downset_limit`` downsets (default: a budget by graph size, see
    ``downsets.downset_dp``) and neither memory nor tied weights are involved,
    else CP-SAT; the better plan and the higher bound are kept. ``"cpsat"``
    always uses CP-SAT. ``time_limit`` caps the whole call (every phase checks
    the deadline; the answer is the best plan and bound found by then).
    ``progress``: called with one line per improving CP-SAT solution (the CLI
    passes a stderr printer); ``coarsen_above``: unit count above which nodes merge. A plan for
    ``schedule="1f1b-stash"`` gives stages sharing a tied weight equal replicas (``stash_ties.py``).
    """
    opts = CostOptions(devices=devices, **options)
    if solver not in ("auto", "cpsat"):
        raise FxpipeError(f"partition: solver must be 'auto' or 'cpsat', not {solver!r}")
    start = time.monotonic()
    polish_by = start + time_limit - finish_reserve(time_limit)
    deadline = polish_by - polish.reserve(time_limit)
    with planning() as budget:  # the searches stop once they have grown the process by LIMIT_MB
        fine = build_units(graph, opts, [[n] for n in model_nodes(graph, opts)])
        _check_devices(fine, opts)
        until = _searches_until(fine, opts, start, deadline)
        try:
            # the bound pass that can prove the plan within 1 % may run into the polish's time (``chain_plan``),
            # not into the time of the searches under 1f1b-stash's rule (``_searches_until``)
            found = _searched_plan(graph, fine, opts, start, until, time_limit, workers, coarsen_above, solver,
                                   downset_limit, progress, prove_by=polish_by if until >= deadline else until)
        except InfeasibleError:
            found = _uniform_only(graph, opts, start)
            if found is None:
                raise
            return _answered(graph, opts, found, budget, progress, start)
        kept = _uniform_kept(graph, opts, found, start)
        found = stash_ties.evened(graph, opts, kept, _evened_until(fine, opts, start + time_limit, deadline))
        broke = found is not kept  # the searches' plan broke the stash rule (evened chose its replicas again)
        # under 1f1b-stash the tied stages share one replica count: the segment DP searches each count
        found = stash_counts.searched(graph, opts, found, deadline, progress)
        if broke:  # and CP-SAT under the rule, in the time left
            found = _stash_searched(graph, fine, opts, found, start, deadline, workers, coarsen_above, progress)
        found = polish.result(graph, found, polish_by, progress)  # the boundaries moved on single nodes
        return _answered(graph, opts, found, budget, progress, start)


STASH_SHARE = 0.5  # under 1f1b-stash with tied weights, the searches' share of the time: the rest is the rule's
EVENED_SHARE = 0.3  # ... and of what they leave, evening's (``stash_ties.evened``): the per-count DP takes the rest


def _searches_until(fine: Units, opts: CostOptions, start: float, deadline: float) -> float:
    """When the searches for the unconstrained plan stop: ``deadline``, or under ``1f1b-stash`` with
    tied weights where the per-count search can run (``stash_counts.may_apply``) at ``STASH_SHARE`` of
    the time, since their plan then mostly breaks the stash rule and the searches under it
    (``stash_counts.py``) need the rest. HF GPT-2 with its head tied, 10 s:
    at 256-1,024 devices they took the whole limit and the per-count DP none (14-33 % open); with half
    (and evening capped, ``_evened_until``) 7.0, 1.8 and 13.7 %, 32-128 devices unchanged (3.8, 1.8 and
    12.3 % once the per-count plans had their loose nodes placed, ``stash_counts._kept``). On the
    benchmark's profile of it 256 devices read 4.1 % against 2.3 % with the whole limit."""
    if stash_counts.may_apply(opts, bool(fine.shared)):
        return start + (deadline - start) * STASH_SHARE
    return deadline


def _evened_until(fine: Units, opts: CostOptions, end: float, deadline: float) -> float:
    """When ``stash_ties.evened`` stops: at ``end`` (the call's limit), or where the per-count search
    follows at ``EVENED_SHARE`` of the time the searches left (it took 4.7 of 10 s at 1,024 devices, an
    evaluation per replica step per count)."""
    if stash_counts.may_apply(opts, bool(fine.shared)):
        return min(end, time.monotonic() + EVENED_SHARE * max(0.0, deadline - time.monotonic()))
    return end


def _stash_searched(graph: CostGraph, fine: Units, opts: CostOptions, evened: PartitionResult, start: float,
                    deadline: float, workers: int, coarsen_above: int, progress) -> PartitionResult:
    """``evened`` (``stash_ties.evened``: the searches' stages, replicas chosen again under the stash
    rule), or CP-SAT's plan under the rule itself (``PartitionModel._stash_rule``) where it is faster, with
    CP-SAT's bound where that is higher: on every node it bounds the plans the runtime can run, which
    the other searches' bounds (of the looser problem) are too, so the higher one holds. Flat machines
    only (two-level ones keep ``evened``), and only in the time the searches and the per-count segment DP
    (``stash_counts.py``) left. Tied chains of four blocks on 6-8 devices: ``evened`` read FEASIBLE with
    7.6-9.7 % open, this search proved them in 0.1-0.6 s (now the per-count DP mostly does, first);
    examples/gpt.py on 8 devices (five profiles): 0.9-7.5 % faster plans, proven."""
    if evened.status == "OPTIMAL" or opts.gpus_per_node is not None:
        return evened
    units = fine if len(fine) <= coarsen_above else coarsen(graph, opts, target=coarsen_above, deadline=deadline)
    if not _time_for_cpsat(units, opts, deadline):
        return evened
    model = _cp_sat(units, opts)
    stage_of = _on_units(evened.assignment, units)
    if stage_of is not None:
        model.hint(stage_of, evened.replicas)
    model.upper_bound(evened.bottleneck_s)  # the model's objective never exceeds a plan's real time
    solved = model.solve(max(0.05, deadline - time.monotonic()), workers=workers, report=progress)
    if solved.stage_of is None:
        return evened
    if len(units) < len(fine):
        solved = _restricted(solved, ideal_s(graph, opts))
    searched = _result(graph, units, opts, solved, start, evened.heuristic_s, "CP-SAT under the stash rule")
    if not stash_ties.runnable(graph, searched.assignment, searched.replicas):
        return evened  # placing loose nodes moved a tied weight: the evened plan stands
    before = evened.bound_s
    best = _better(evened, searched)
    if best is evened and best.bound_s > before:
        best.method = f"{best.method}, proven by CP-SAT under the stash rule"
    return best


def _on_units(assignment: Dict[str, int], units: Units) -> Optional[List[int]]:
    """A plan's stage per unit, or None where it splits a unit (the units cannot express it)."""
    stage_of = [assignment[names[0]] for names in units.members]
    whole = all(assignment[n] == s for s, names in zip(stage_of, units.members) for n in names)
    return stage_of if whole else None


def _answered(graph: CostGraph, opts: CostOptions, found: PartitionResult, budget: MemoryGuard, progress,
              start: float) -> PartitionResult:
    """``partition``'s answer: floored, its memory stop noted, and its wall time the whole call's (each
    search stamps its own when it answers; the polish and the branchy searches' finish came after:
    inception_v3 on 256 devices said 1.1 s of a 9-s call)."""
    found = _floored(graph, opts, _budget_noted(found, budget, progress))
    found.wall_s = time.monotonic() - start
    return found


def _budget_noted(found: PartitionResult, budget: MemoryGuard, progress) -> PartitionResult:
    """``found`` with the memory the searches reached, where they stopped at the planning budget."""
    if budget.tripped:
        found.memory_stop_mb = budget.peak_mb
        if progress is not None:
            progress(f"partition: the searches stopped at {budget.peak_mb:.0f} MB of memory, "
                     f"{budget.peak_mb - budget.start_mb:.0f} MB more than when planning began (limit "
                     f"{budget.limit_mb:.0f} MB more); answering with the best plan and bound found by then")
    return found


def _floored(graph: CostGraph, opts: CostOptions, found: PartitionResult) -> PartitionResult:
    """``found`` with its bound raised to ``work_floor`` where that is higher (every search's bound
    starts from sum C / K; the all-reduce of replicated weights lifts it on many devices), and
    OPTIMAL where that proves the plan, even one no search finished (HEURISTIC): its gap is then 0."""
    floor = work_floor(graph, opts)
    if floor > found.bound_s:
        found.bound_s = min(floor, found.bottleneck_s)
        if found.status in ("FEASIBLE", "HEURISTIC") and found.gap <= OPTIMAL_GAP:
            found.status = "OPTIMAL"  # proven, whether or not a search finished
    return found


def _uniform_only(graph: CostGraph, opts: CostOptions, start: float) -> Optional[PartitionResult]:
    """The best uniform PP x DP layout (``uniform.py``) where no search found a plan within the time (each
    pass too slow for the limit on a deep graph and many devices): status HEURISTIC, bounded by
    sum C / K only. None where no uniform layout fits (the search's error then stands)."""
    best = uniform.best_layout(graph, opts)
    if best is None:
        return None
    return _uniform_result(graph, opts, best, "HEURISTIC", ideal_s(graph, opts), time.monotonic() - start,
                           "uniform layout (no search finished a plan in the time)")


def _uniform_result(graph: CostGraph, opts: CostOptions, best, status: str, bound_s: float, wall_s: float,
                    method: str) -> PartitionResult:
    """``uniform.best_layout``'s (evaluation, assignment, replicas) as a ``PartitionResult``."""
    ev, assignment, replicas = best
    return PartitionResult(assignment=assignment, replicas=list(replicas), stages=ev.stages,
                           bottleneck_s=ev.bottleneck_s, options=opts, status=status, objective_s=ev.bottleneck_s,
                           bound_s=min(bound_s, ev.bottleneck_s), wall_s=wall_s, units=len(graph.nodes),
                           method=method)


def _searched_plan(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float,
                   time_limit: float, workers: int, coarsen_above: int, solver: str,
                   downset_limit: Optional[int], progress, prove_by: Optional[float] = None) -> PartitionResult:
    """``partition``'s search: the segment DP, then the downset DP or CP-SAT (see ``partition``);
    ``prove_by``: see ``segment_plan.chain_plan``."""
    if opts.gpus_per_node is not None:
        return _placed(graph, fine, opts, start, deadline, workers, coarsen_above, solver, downset_limit,
                       progress, prove_by)
    if opts.memory is not None and solver == "auto":
        return _within_memory(graph, fine, opts, start, deadline, time_limit, workers, coarsen_above,
                              downset_limit, progress, prove_by)[0]
    chained = chain_plan(graph, opts, start, deadline, prove_by=prove_by, progress=progress) \
        if solver == "auto" else None
    if chained is not None and (chained.status == "OPTIMAL" or deadline - time.monotonic() < 0.5):
        return chained
    if chained is not None:  # CP-SAT on coarsened units after the segment DP's plan: a share of the time left,
        # the rest to the polish (``polish.result``: boundaries on single nodes, replicated stages split)
        deadline = time.monotonic() + GENERAL_SHARE * (deadline - time.monotonic())
    # no segment DP answer (segments too wide): a relaxation that still charges the cuts bounds CP-SAT's plans
    relax = branchy.relaxed(graph, opts, deadline, light=branchy.LIGHT) if chained is None and solver == "auto" \
        and opts.memory is None and opts.replication != "none" else None
    began = time.monotonic()
    early = branchy.bound(graph, opts, relax, began + BRANCHY_BOUND_SHARE * max(0.0, deadline - began),
                          ideal_s(graph, opts)) if relax else None
    # the restriction's plan gets at most twice the bound's time (inception_v3: 0.3-0.8 s, its passes 0.6-1.2 s)
    reserve = min(BRANCHY_PLAN_SHARE * max(0.0, deadline - time.monotonic()), 2 * (time.monotonic() - began))
    searched_by = deadline - reserve if relax else deadline
    try:
        other = _general(graph, fine, opts, start, searched_by, time_limit, workers, coarsen_above, solver,
                         downset_limit, progress, chained)
    except InfeasibleError:
        if chained is None:
            raise
        return chained
    if relax is not None:
        return _branchy_finish(graph, opts, other, relax, early, start, deadline)
    return _better(chained, other)


def _branchy_finish(graph: CostGraph, opts: CostOptions, found: PartitionResult, relax: "branchy.Relaxed",
                    early: Optional[float], start: float, deadline: float) -> PartitionResult:
    """CP-SAT's answer ``found`` where the segment DP has no lattice, unless proven: the plan of a
    restriction on the relaxation's lattices where it is faster (``_branchy_plan``), and the bound
    ``early`` of the relaxation where it is higher. CP-SAT's bound on coarsened units is no bound of
    the graph, and Σ compute / K leaves out the cuts, which the relaxation charges."""
    if found.status == "OPTIMAL":
        return found
    found = _better(_branchy_plan(graph, opts, relax, start, deadline, found), found)
    if early is not None and early > found.bound_s:
        found.bound_s = min(early, found.bottleneck_s)
        found.status = "OPTIMAL" if found.gap <= OPTIMAL_GAP else "FEASIBLE"
        found.method = f"{found.method}, bound from a relaxation (segment DP)"
    found.wall_s = time.monotonic() - start
    return found


def _branchy_plan(graph: CostGraph, opts: CostOptions, relax: "branchy.Relaxed", start: float, by: float,
                  found: PartitionResult) -> Optional[PartitionResult]:
    """The segment DP's plan on ``branchy.plan_units`` (a restriction) where it is faster than ``found``'s
    (its first pass, 1 % under that, says whether it can be), with ``found``'s bound; None if none
    came by ``by``. inception_v3 on 32 devices at 1.25 GB/s: 39.3 ms, where CP-SAT's plans read
    37.9-42.8 ms from run to run."""
    restricted = segment_plan.searched(graph, opts, by, [], keep_dead=True, tolerance=branchy.TOLERANCE,
                                       ceiling=found.bottleneck_s,
                                       widen=lambda units: branchy.plan_units(units, relax.side))
    if restricted is None or restricted[0] is None:
        return None
    (assignment, replicas), _, _, size = restricted
    ev = evaluate(graph, assignment, replicas, opts)
    return PartitionResult(assignment=assignment, replicas=list(replicas), stages=ev.stages,
                           bottleneck_s=ev.bottleneck_s, options=opts, status="FEASIBLE",
                           objective_s=ev.bottleneck_s, bound_s=min(found.bound_s, ev.bottleneck_s),
                           wall_s=time.monotonic() - start, units=size, method="segment DP on a restriction")


def _uniform_kept(graph: CostGraph, opts: CostOptions, found: PartitionResult, start: float) -> PartitionResult:
    """``found``, or the hand-made uniform PP x DP layout where that is faster (``uniform.py``): a search
    cut short by the time limit still answers at least as well as a person would by hand. The bound
    is the search's. An OPTIMAL answer is within 0.1 % of its bound, so no layout can matter there."""
    if found.status == "OPTIMAL":
        return found
    best = uniform.best_layout(graph, opts)
    if best is None or best[0].bottleneck_s >= found.bottleneck_s * (1 - 1e-12):
        return found
    ev, assignment, replicas = best
    out = dataclasses.replace(found, assignment=assignment, replicas=list(replicas), stages=ev.stages,
                              bottleneck_s=ev.bottleneck_s, objective_s=ev.bottleneck_s,
                              bound_s=min(found.bound_s, ev.bottleneck_s), method=f"{found.method}, uniform layout",
                              wall_s=time.monotonic() - start)
    if out.status != "HEURISTIC":
        out.status = "OPTIMAL" if out.gap <= OPTIMAL_GAP else "FEASIBLE"
    return out


def finish_reserve(time_limit: float) -> float:
    """Seconds of ``time_limit`` kept back from the search for the work that must follow it.

    Every phase stops at the search deadline, but the answer still has to be
    scored on the original nodes (``evaluate``), its loose ends placed, and the
    two answers compared; that takes a few evaluations, which a loaded machine
    slows down. Keeping a tenth of the limit (at most 0.3 s) for it is what lets
    ``partition`` return within the limit rather than a little after it.
    """
    return min(0.3, 0.1 * time_limit)


def _better(chained: Optional[PartitionResult], other: PartitionResult) -> PartitionResult:
    """The faster plan, with the higher of the two proven bounds (both are bounds of the same problem)."""
    if chained is None:
        return other
    best = chained if chained.bottleneck_s <= other.bottleneck_s else other
    best.bound_s = min(max(chained.bound_s, other.bound_s), best.bottleneck_s)
    # HEURISTIC only where neither search proved anything: a CP-SAT run without an answer beside a segment
    # DP plan with its bound is FEASIBLE (the bound is the DP's)
    searched = chained.status != "HEURISTIC" or other.status != "HEURISTIC"
    best.status = "OPTIMAL" if best.gap <= OPTIMAL_GAP else ("FEASIBLE" if searched else "HEURISTIC")
    best.wall_s = max(chained.wall_s, other.wall_s)
    return best


# Under --memory (``_within_memory``, ``_memory_walk``): the order DP's walk (``order_memory``) gets at most
MEMORY_WALK_SHARE = 0.5  # of the search time (MEMORY_WALK_READ_SHARE, and on coarse units alone, where the bound's
MEMORY_WALK_READ_SHARE = 0.1  # DP reads plans too, ``memory_plan``: on the 96-block GPT under 256 MiB on 256 devices
# its plans were 20 % faster), first on coarse units:
MEMORY_UNITS = 800  # at most about this many (``coarsen``'s target; a step of T walks every range of them),
MEMORY_UNIT_MOST = 3.2  # each of up to this many x sum C / K of compute (the 96-layer Llama on 256 devices under
# 600 MB: 842 units, 0.15 s a step, plan 1.3 % slower than on 2,514 units, 0.6 s a step; 435 units 3.4 %);
MEMORY_COARSE_SHARE = 0.3  # that pass gets this share of the walk's time where finer units follow: CP-SAT's,
MEMORY_RANGES = 1_500_000  # where they hold at most this many ranges (~115 bytes each at the peak: the 96-layer
# Llama on 1,024 devices under 600 MB, 4.3 M ranges, stopped the searches at the planning budget), else units
# coarsened to about sqrt(2 x this),
MEMORY_FINER = 1.2  # and at least this many times the coarse units (else the coarse pass gets all the time);
MEMORY_SLOW_SHARE = 0.6  # on a two-level machine, the walk under the slower flat model gets this share of its time;
MEMORY_LOOSE = 0.9  # no finer pass where the coarse plan's peak stays under this share of the limit (it did not
# bind: the segment DP without it, whose plan then fits, gets the time)
MEMORY_FEWER_SHARE = 0.25  # of the time the bound leaves, for the walk's plan on fewer devices (``_fewer_hint``),
MEMORY_FEWER_GAIN = 0.05  # shown where it is this much faster than the plan on all K
MEMORY_READ_FIRST = 256  # up to this many devices (on more, its passes took 2x as long and its reads under 1F1B-flush
# failed more often, the windows rounding up over many replicas: the 96-block GPT on 1,024 devices read 6.05 ms
# where the walk on finer units finds 3.33; there it reads plans after the walk, as a bound)
MEMORY_FREE_SHARE = 0.15  # of the time the walk leaves, for the segment DP without the limit where the bound's DP
# reads plans within it (the limit binds where they are read: the plan without it seldom fits)
MEMORY_BOUND_SHARE = 0.8  # of the time the segment DP without the limit leaves, for the bound that knows the limit
# (``memory_bound``) where it binds; CP-SAT gets the rest
MEMORY_READ_SHARE = 0.9  # ... and where its DP reads plans (``MEMORY_READ_FIRST``): they are the plans there


def _within_memory(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float,
                   time_limit: float, workers: int, coarsen_above: int, downset_limit: Optional[int], progress,
                   prove_by: Optional[float]) -> Tuple[Optional[PartitionResult], Optional[int]]:
    """Under ``--memory``: the order DP's walk from the end (``order_memory``: a plan within the limit in a
    second or two, where no other search scales), then the segment DP without the limit (flat, or placed
    on a two-level machine), whose bound holds under it (a limit only removes plans) and whose plan, where
    it fits, competes (an optimal one that fits is the answer); where the limit binds, the bound that knows
    it (``memory_bound``) from there up; on a flat machine CP-SAT, warm-started by the walk's plan, in the
    time left. The faster plan within the limit and the higher bound are kept,
    with None beside it, and the walk's plan on fewer devices where that is faster (``_fewer_hint``); on a
    two-level machine where the walk found no plan, (None, the least memory it fits a plan in) (``_placed``
    then searches as before, and says that memory if it finds none)."""
    built = memory_bound.lattice(graph, opts, deadline) \
        if memory_plan.reads(opts) and opts.devices <= MEMORY_READ_FIRST else None  # (reads: a flat machine)
    walk_by = start + (MEMORY_WALK_READ_SHARE if built is not None else MEMORY_WALK_SHARE) * (deadline - start)
    walked, units = _memory_walk(graph, opts, start, walk_by, coarsen_above, progress, finer=built is None)
    if walked is None and built is not None:  # none on coarse units: the finer ones, in the time the walk had
        walked, units = _memory_walk(graph, opts, start, start + MEMORY_WALK_SHARE * (deadline - start),
                                     coarsen_above, progress)
    placed_machine = opts.gpus_per_node is not None
    # for the message if none fits (the bandwidths change no plan's memory: the flat model's walk says it)
    least = least_memory(units, flat_bound(opts, fast=False), start + MEMORY_WALK_SHARE * (deadline - start)) \
        if walked is None else None
    if walked is None and placed_machine:
        return None, least
    walked = _chained_and_bounded(graph, opts, start, deadline, progress, prove_by, walked, built)
    fewer = _fewer_hint(graph, units, opts, walked, start,
                        time.monotonic() + MEMORY_FEWER_SHARE * (deadline - time.monotonic()))
    found = walked
    if walked is None or not (placed_machine or walked.status == "OPTIMAL" or deadline - time.monotonic() < 0.5):
        try:
            other = _general(graph, fine, opts, start, deadline, time_limit, workers, coarsen_above, "auto",
                             downset_limit, progress, walked)
            found = _better(walked, other)
        except InfeasibleError as err:
            if walked is None:
                raise _with_least(err, opts, least) from None
    if fewer is not None and fewer[1] < found.bottleneck_s * (1 - MEMORY_FEWER_GAIN):
        found.fewer = fewer
    return found, None


def _fewer_hint(graph: CostGraph, units: Units, opts: CostOptions, walked: Optional[PartitionResult], start: float,
                deadline: float) -> Optional[Tuple[int, float]]:
    """(devices, bottleneck s) of the walk's plan on at most K devices (``fewer_devices``) within the limit,
    where ``--fewer-devices`` is not given: on K devices every device must take replicas, which raise the
    microbatches in flight of the stages before them, and where no stage can take them the plan slows
    (gnmt_large on 256 devices under 4 GB: 211 ms, the walk's plan on 10 devices 76.8 ms). None where it
    is not asked or finds none on fewer devices."""
    if opts.fewer_devices or walked is None:
        return None
    loose = dataclasses.replace(opts, fewer_devices=True)
    plan = memory_order_dp(units, flat_bound(loose, fast=False), deadline)
    scored = _walk_scored(graph, units, loose, plan, start)
    if scored is None or sum(scored.replicas) >= opts.devices:
        return None
    return sum(scored.replicas), scored.bottleneck_s


def _chained_and_bounded(graph: CostGraph, opts: CostOptions, start: float, deadline: float, progress,
                         prove_by: Optional[float], walked: Optional[PartitionResult],
                         built: Optional[tuple] = None) -> Optional[PartitionResult]:
    """The walk's plan (``walked``, None where it found none) after the segment DP without the limit (its
    bound, and its plan where that fits and is faster) and, where the limit binds, the bound that knows it
    (on ``built``, ``memory_bound.lattice``'s answer where the caller has it), with the plans its DP reads."""
    free = dataclasses.replace(opts, memory=None, microbatches=opts.num_microbatches)
    if opts.gpus_per_node is not None:
        chained = _placed_chain(graph, free, start, deadline, progress, prove_by)
        if chained is None and segment_plan.is_deep(graph, free):
            chained = _flat_wide(graph, free, start, deadline)
    else:  # where the bound's DP reads plans within the limit, a share of the time: its floor is all it adds
        by = deadline if built is None else time.monotonic() + MEMORY_FREE_SHARE * (deadline - time.monotonic())
        chained = chain_plan(graph, free, start, by, prove_by=prove_by if built is None else None, progress=progress)
    if chained is not None:
        bound = chained.bound_s
        if walked is not None:  # the bound without the limit bounds every plan within it
            walked.bound_s = min(max(walked.bound_s, bound), walked.bottleneck_s)
            walked.status = "OPTIMAL" if walked.gap <= OPTIMAL_GAP else "FEASIBLE"
        fits = None
        if chained.status != "BOUND":  # a plan too (BOUND: the bound alone)
            ev = evaluate(graph, chained.assignment, chained.replicas, opts)  # its memory under the limit's options
            if ev.peak_memory_bytes <= opts.memory:
                fits = dataclasses.replace(chained, options=opts, stages=ev.stages, bottleneck_s=ev.bottleneck_s)
        if fits is not None:
            walked = _better(fits, walked) if walked is not None else fits  # ties: the segment DP's plan
    if walked is not None and walked.status != "OPTIMAL" and _peak(walked) >= MEMORY_LOOSE * opts.memory:
        # the limit binds: a bound that knows it, from the one without it up
        share = MEMORY_BOUND_SHARE if built is None else MEMORY_READ_SHARE
        memory_bound.raise_bound(graph, opts, walked, time.monotonic() + share * (deadline - time.monotonic()),
                                 progress, built)
    return walked


def _with_least(err: InfeasibleError, opts: CostOptions, least: Optional[int]) -> InfeasibleError:
    """``err``, or the memory error with the walk's least memory where that is below what the search
    found (or the search said only that it found no plan)."""
    if least is not None and least < getattr(err, "fits_in", math.inf):
        return _no_fit(opts, least, getattr(err, "at_least", None), "the order DP's plans")
    return err


def _memory_walk(graph: CostGraph, opts: CostOptions, start: float, deadline: float, coarsen_above: int,
                 progress, finer: bool = True) -> tuple:
    """(plan, units): the order DP's plan within ``opts.memory`` (``order_memory``), scored on ``graph``
    under ``opts``, and the coarse units it walked first; the plan None where it finds none, or where
    ``evaluate`` finds it over the limit (the units' sums are the DP's).

    First every order on coarse units (``MEMORY_UNITS``), then the first order on the units CP-SAT
    would get (``coarsen``'s default size, finer by up to 16x), its bisection started at the coarse
    plan's T, until ``deadline``: a tight limit wants small stages (the 96-block GPT under 256 MiB on 64
    devices: 107.6 ms on 296 units, 60.3 ms on 2,598). On a two-level machine both run under both flat
    models (``flat_bound``: every link at the slower, then at the faster bandwidth), and the plan scored
    faster on the machine is kept."""
    flat = flat_bound(opts, fast=False)  # a two-level machine's units would keep its node walls: 2,598 for 1,314
    units = coarsen(graph, flat, target=max(coarsen_above, MEMORY_UNITS), deadline=deadline, most=MEMORY_UNIT_MOST)
    if finer:  # (not where the bound's DP reads plans: its lattice is finer still)
        fine = coarsen(graph, flat, target=coarsen_above, deadline=deadline)
        order = topo_orders(fine)[0]
        if range_count(fine, flat, order) > MEMORY_RANGES:  # as many units as that holds
            fine = coarsen(graph, flat, target=int(math.sqrt(2 * MEMORY_RANGES)), deadline=deadline,
                           most=MEMORY_UNIT_MOST)
            order = topo_orders(fine)[0]
        finer = len(fine) > MEMORY_FINER * len(units) and range_count(fine, flat, order) <= MEMORY_RANGES
    # a two-level machine: the slower flat model first (its plans cost no more placed than it charges them), with
    # MEMORY_SLOW_SHARE of the time, then the faster one (its plans can be faster placed: the 96-block GPT on
    # 1,024 devices, 3.23 against 3.36 ms)
    models = [(opts, 1.0)] if opts.gpus_per_node is None else \
        [(flat_bound(opts, fast=False), MEMORY_SLOW_SHARE), (flat_bound(opts, fast=True), 1.0)]
    best = None
    for model, part in models:
        by = time.monotonic() + part * (deadline - time.monotonic())
        share = MEMORY_COARSE_SHARE if finer else 1.0  # no finer units (the 96-block GPT on 1,024 devices): all of it
        walked = memory_order_dp(units, model, time.monotonic() + share * (by - time.monotonic()))
        coarse = _walk_scored(graph, units, opts, walked, start)
        best = _faster(best, coarse)
        if not finer or past(by) or (coarse is not None and  # a loose limit: the unlimited DP's turn
                                     _peak(coarse) < MEMORY_LOOSE * opts.memory):
            continue
        plan = Walk(fine, model, order).bisected(by, hi=walked.objective if walked else None)
        best = _faster(best, _walk_scored(graph, fine, opts, plan, start))
    if best is not None and progress is not None:
        progress(f"partition: order DP within {_fmt_bytes(opts.memory)} per device: "
                 f"{best.bottleneck_s * 1e3:.3f} ms per microbatch ({time.monotonic() - start:.2f} s)")
    return best, units


def _walk_scored(graph: CostGraph, units: Units, opts: CostOptions, plan: Optional[Solution],
                 start: float) -> Optional[PartitionResult]:
    """A walk's plan on ``units`` scored on ``graph`` under ``opts``; None where there is none or it does
    not fit ``opts.memory`` as ``evaluate`` counts it."""
    if plan is None:
        return None
    solved = SolveResult("HEURISTIC", *plan, ideal_s(graph, opts), time.monotonic() - start)
    scored = _result(graph, units, opts, solved, start, plan.objective, "order DP within memory")
    return scored if _peak(scored) <= opts.memory else None


def _peak(found: PartitionResult) -> int:
    """The most memory one device of ``found`` holds."""
    return max(st.memory_bytes for st in found.stages)


def _faster(a: Optional[PartitionResult], b: Optional[PartitionResult]) -> Optional[PartitionResult]:
    """The faster of two plans, either of which may be missing (``a`` on a tie)."""
    return b if a is None or (b is not None and b.bottleneck_s < a.bottleneck_s) else a


def _general(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float, time_limit: float,
             workers: int, coarsen_above: int, solver: str, downset_limit: Optional[int], progress,
             chained: Optional[PartitionResult]) -> PartitionResult:
    """The downset DP on small lattices, else CP-SAT on coarsened units (warm-started by ``chained``)."""
    exact = quick = None
    if solver == "auto":
        quick = best_order_dp(fine, opts, deadline) if len(fine) <= coarsen_above else None
        exact = downset_dp(fine, opts, downset_limit, upper=quick.objective if quick else float("inf"), deadline=deadline)
    if exact is not None and opts.memory is None and not fine.shared:
        solved = SolveResult("OPTIMAL", *exact, exact.objective, time.monotonic() - start)
        return _result(graph, fine, opts, solved, start, exact.objective, "downset DP")
    if quick is not None and chained is not None and opts.memory is None and not fine.shared \
            and quick.objective <= chained.bound_s * (1 + OPTIMAL_GAP):
        # the order DP's plan meets the segment DP's bound: proven, nothing left for CP-SAT (gnmt_large on
        # 256 devices: its plan is the optimum the segment DP's restricted plans missed by 5 %), where the
        # graph scores it as the DP charged it
        solved = SolveResult("FEASIBLE", *quick, ideal_s(graph, opts), time.monotonic() - start)
        ordered = _result(graph, fine, opts, solved, start, quick.objective, "order DP")
        if ordered.bottleneck_s <= chained.bound_s * (1 + OPTIMAL_GAP):
            return ordered
    units = coarsen(graph, opts, target=coarsen_above, deadline=deadline)
    known = exact if exact is not None else quick  # found on ``fine``: still good where coarsening kept it
    if known is not None and len(units) == len(fine):
        warm = known
    elif opts.memory is not None and chained is not None:  # the walk's plan starts it (below): the order DP
        # knows no memory, and on units coarsened under a limit (2,600 for the 96-block GPT on 256 devices) one
        # pass of it took seconds past the deadline
        warm = None
    else:
        warm = best_order_dp(units, opts, deadline)
    heuristic_s, warm_fits = None, True
    if warm is not None:
        ev = evaluate(graph, to_nodes(graph, units, warm.stage_of), warm.replicas, opts)
        heuristic_s, warm_fits = ev.bottleneck_s, opts.memory is None or ev.peak_memory_bytes <= opts.memory
    if not _time_for_cpsat(units, opts, deadline):
        if warm is None or not warm_fits:  # the order DP does not check memory: its plan may not fit
            raise InfeasibleError(f"partition: no plan found within the time limit ({time_limit:g}s); "
                                  "raise --time-limit")
        # no search ran: the plan is the order DP's, bounded by sum C / K (every plan is at least that slow)
        return _result(graph, units, opts, SolveResult("HEURISTIC", *warm, ideal_s(graph, opts), 0.0),
                       start, heuristic_s, "CP-SAT")
    model = _cp_sat(units, opts)
    if chained is not None:  # the segment DP's plan, if the units can express it and it beats the order DP's
        stage_of = _on_units(chained.assignment, units)
        if stage_of is not None and (warm is None or chained.bottleneck_s < (heuristic_s or math.inf)):
            warm = Solution(stage_of, chained.replicas, chained.bottleneck_s)
    if warm is not None:
        model.hint(warm.stage_of, warm.replicas)
        if opts.memory is None and not units.shared:
            model.upper_bound(warm.objective)
    # a tied weight's sync is only floored in the model, so its objective meeting the bound proves nothing
    stop_at = chained.bound_s * (1 + OPTIMAL_GAP) - model.margin if chained is not None and not units.shared \
        else -math.inf
    solved = model.solve(max(0.05, deadline - time.monotonic()), workers=workers, report=progress, stop_at=stop_at)
    if solved.stage_of is None:
        _raise_infeasible(units, opts, solved, warm, deadline, workers, restricted=len(units) < len(fine))
        solved = SolveResult("HEURISTIC", *warm, ideal_s(graph, opts), solved.wall_s)
    elif len(units) < len(fine):  # with a memory limit too: its bound is still the coarsened problem's
        solved = _restricted(solved, ideal_s(graph, opts))
    coarse = _result(graph, units, opts, solved, start, heuristic_s, "CP-SAT")
    # the coarsened run stops early once its restricted optimum is proven: the time left goes to every node
    if not len(units) < len(fine) <= FINE_CPSAT_MAX or opts.memory is not None or \
            not _time_for_cpsat(fine, opts, deadline):
        return coarse
    return _better(coarse, _refined(graph, fine, opts, coarse, start, deadline, workers, progress, heuristic_s))


def _refined(graph: CostGraph, fine: Units, opts: CostOptions, coarse: PartitionResult, start: float,
             deadline: float, workers: int, progress, heuristic_s: Optional[float]) -> PartitionResult:
    """CP-SAT on the uncoarsened units in the time the coarsened run left, started from its plan: its
    bound holds for the graph (the coarsened one's holds only for plans that keep every group together),
    and it may move the nodes a group held. inception_v3 (325 units) on 8 devices at 1.25 GB/s: the
    coarsened run proved its restricted optimum in 2 s, a plan 10 % above the graph's optimum, bounded
    by sum C / K only (20.7 % open); on every node CP-SAT proves the optimum in the rest."""
    model = _cp_sat(fine, opts)
    model.hint([coarse.assignment[names[0]] for names in fine.members], coarse.replicas)
    solved = model.solve(max(0.05, deadline - time.monotonic()), workers=workers, report=progress)
    if solved.stage_of is None:
        return coarse
    return _result(graph, fine, opts, solved, start, heuristic_s, "CP-SAT on every node")


def _restricted(solved: SolveResult, ideal: float) -> SolveResult:
    """A CP-SAT answer on coarsened units: its plan is a plan, but its bound holds only for plans that
    keep every group in one stage, not for the graph (on 8 GPT blocks profiled on an H100 it lay above
    a plan the exact chain DP found). The bound left is sum C / K; ``_better`` raises it to the segment
    DP's where there is one, and the status follows from that."""
    status = "FEASIBLE" if solved.status == "OPTIMAL" else solved.status
    return dataclasses.replace(solved, status=status, bound=min(solved.bound, ideal))


def _placed(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float, workers: int,
            coarsen_above: int, solver: str, downset_limit: Optional[int], progress,
            prove_by: Optional[float] = None) -> PartitionResult:
    """A two-level machine (``opts.gpus_per_node``): where a stage sits changes its cost.

    First the segment DP (``_placed_chain``); if that does not prove its plan, the downset DP, which
    keeps the devices used (the next stage's first rank) and the last stage's
    replicas in its state and is exact under the contiguous placement (its upper
    bound from a warm start on the flat model at the slower bandwidth, scored
    placed); otherwise CP-SAT on the two bracketing flat models. The better plan
    and the higher bound are kept. Where the lattice is small enough for the
    exact DP, the segment DP gets ``EXACT_ROOM`` of the time, so that the exact
    DP has room when the segment DP cannot prove its plan (resnext101 on 4 nodes
    of 4 under PipeDream's charges: the charged segment DP took the whole 10 s
    and left 6.5 % open; the exact DP proves a 2.2 % faster plan in 2-4 s).
    ``prove_by``: until when the finer lattice's pass 1 % under the plan may run (``_finer``).
    """
    least = None
    if opts.memory is not None and solver == "auto":
        found, least = _within_memory(graph, fine, opts, start, deadline, deadline - start, workers, coarsen_above,
                                      downset_limit, progress, prove_by)
        if found is not None:  # (PipeDream's hierarchical optimizer checks no memory: nothing to compare)
            return found
    try:
        return _placed_searched(graph, fine, opts, start, deadline, workers, coarsen_above, solver, downset_limit,
                                progress, prove_by)
    except InfeasibleError as err:
        raise _with_least(err, opts, least) from None


def _placed_searched(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float,
                     workers: int, coarsen_above: int, solver: str, downset_limit: Optional[int], progress,
                     prove_by: Optional[float]) -> PartitionResult:
    """``_placed``'s searches (its docstring says which), where no walk under a memory limit answered."""
    limit = default_limit(fine) if downset_limit is None else downset_limit
    masks = enumerate_downsets(fine, max(limit, min(CHEAP_CUTS_CAP * limit, CHEAP_CUTS_WORK // len(fine))),
                               deadline) if solver == "auto" else None  # once, for both DPs below
    small = masks is not None and len(masks) <= limit and opts.memory is None and not fine.shared
    chained = _placed_chain(graph, opts, start, start + EXACT_ROOM * (deadline - start) if small else deadline,
                            progress, None if small else prove_by) \
        if solver == "auto" else None
    if chained is None and solver == "auto" and segment_plan.is_deep(graph, opts):
        chained = _flat_wide(graph, opts, start, start + WIDE_SHARE * (deadline - start))
    result = chained
    if chained is None or (chained.status != "OPTIMAL" and deadline - time.monotonic() >= 0.5):
        try:
            result = _better(chained, _placed_general(graph, fine, opts, start, deadline, workers,
                                                      coarsen_above, solver, masks, limit, progress))
        except InfeasibleError:
            if chained is None:
                raise
    result.hierarchical = _pipedream_levels(graph, opts, deadline)  # once, for the answer given
    return result


def _flat_wide(graph: CostGraph, opts: CostOptions, start: float, deadline: float) -> Optional[PartitionResult]:
    """A deep graph the placed DPs have no lattice for (a Llama's rotary reads and wide attention blocks:
    ``anchors.py``, ``wide_segments.py``, whose restrictions and relaxation only the flat segment DP
    runs): that DP on the flat model at the slower links, its plan scored on this machine, bounded by
    sum C / K (the slower links' bound does not hold here; ``partition`` lifts it to the work floor,
    ``work_floor.py``). None without a plan. On the bundled 24-layer
    Llama on nodes of 8 (100 / 12.5 GB/s) CP-SAT on coarsened units answered 64 devices, the uniform
    layout 512; this plan was faster on both. Only where some layer reads a table of the inputs
    (``anchors.exits``): on the NASNets, deep and branchy, the time it took from CP-SAT cost plans up
    to 6 %."""
    slow = flat_bound(opts, fast=False)
    if not anchors.exits(graph, slow):
        return None
    found = chain_plan(graph, slow, start, deadline, bound_kept=False)
    if found is None or not found.replicas:
        return None
    ev = evaluate(graph, found.assignment, found.replicas, opts)
    result = dataclasses.replace(found, stages=ev.stages, bottleneck_s=ev.bottleneck_s, objective_s=ev.bottleneck_s,
                                 options=opts, bound_s=min(ideal_s(graph, opts), ev.bottleneck_s),
                                 wall_s=time.monotonic() - start, method="segment DP (flat, slower links)")
    result.status = "OPTIMAL" if result.gap <= OPTIMAL_GAP else "FEASIBLE"
    return result


def _placed_chain(graph: CostGraph, opts: CostOptions, start: float, deadline: float,
                  progress: Optional[Callable[[str], None]] = None,
                  prove_by: Optional[float] = None) -> Optional[PartitionResult]:
    """The segment DP that knows node boundaries (``placed.py``) where it applies, else the flat bracket
    (``_bracketed``). Its charged form (``charged.ChargedChainSolver``: PipeDream's all-reduce, pow2
    counts) costs far more per pass on deep graphs, so there the bracket answers first and the charged
    DP gets ``CHARGED_SHARE`` of the time left when the bracket does not prove its plan (CP-SAT the
    rest; under ``pow2`` ``POW2_SHARE``, then the exact-cut pass of ``_cuts_exact`` where more than
    1 % stays open); the better plan and the higher bound are kept (both are bounds of the placed model; the
    charged DP may answer a bound alone, when none of its passes found a faster plan). Under
    ``pow2`` with fxpipe's charges two bounds come first, and the higher is kept: the flat DP with
    each all-reduce floored at the nodes it must cross (``node_floor.py``, ``FLOOR_SHARE`` of the
    time; it sees the power-of-two counts, and its plan, scored placed, is a candidate), then the
    interval DP for ``any`` (``RELAXED_SHARE`` of what is left: its bound holds, every pow2 plan
    being one of its plans, and it sees placement; it starts from the floor's bound, below which its
    passes prove nothing new, and stops within ``RELAXED_TOLERANCE``); both replace the flat
    bracket's, which on many nodes charges every link at B1 and lies far below. Under PipeDream's
    charges (any count) the bracket's bound comes from the flat model at B1 with each stage's
    all-reduce floored at the nodes it must touch (``node_floor.py``), far closer to the placed
    optimum where stages are replicated across nodes. The bracket's plan, or the uniform layout
    where that is faster, is the ceiling the charged DP's first pass tries to prove within 1 %
    (``_bracketed``). ``progress``: a line for each phase that changed the plan or the bound.
    ``prove_by``: until when the finer lattice's pass 1 % under the plan may run (``_finer``)."""
    shown: list = []  # the (plan, bound) last shown: a phase that changed neither says nothing

    def say(label: str, found: Optional[PartitionResult]) -> Optional[PartitionResult]:
        if found is not None and (not shown or shown[-1] != (found.bottleneck_s, found.bound_s)):
            shown.append((found.bottleneck_s, found.bound_s))
            _said_placed(progress, start, label, found)
        return found

    if not (placed.supports(opts) and opts.gpus_per_node < opts.devices):
        return _bracketed(graph, opts, start, deadline)
    if opts.cost_model == "fxpipe" and opts.replication == "any":
        # no plan by PLAN_SHARE of the time (passes of seconds each climbing from sum C / K: 32 blocks on
        # 1024 devices): the flat bracket finds one in the rest, above the bound proven so far
        found = chain_plan(graph, opts, start, deadline, bound_only=True,
                           plan_by=start + PLAN_SHARE * (deadline - start), chain_reads=True,
                           settle_by=start + BOUND_SHARE * (deadline - start))
        say("interval DP", found)
        if found is not None and found.replicas:
            return say("resumed", _resumed(graph, opts, start, deadline, found))
        if found is None:
            return found
        bracket = _bracketed(graph, opts, start, deadline, plain=True, floor=found.bound_s)
        return say("flat bracket", found if bracket is None else _better(found, bracket))
    floor, floored = 0.0, None
    hand = uniform.best_layout(graph, opts)  # the charged DP's ceiling, if nothing beats it (``_bracketed``)
    if opts.cost_model == "fxpipe" and opts.replication == "pow2":
        # the flat DP with every all-reduce past G ranks at B2 (``node_floor.py``): sees that counts are
        # powers of two, where the interval DP below does not (1,024 devices: its bound 18 % lower); it
        # bisects below the uniform layout, which no placement charges less than this floor does
        floored = chain_plan(graph, flat_bound(opts, fast=True), start,
                             time.monotonic() + FLOOR_SHARE * (deadline - time.monotonic()), plain=True,
                             machine=opts, bound_only=True, ceiling=_time_of(graph, hand))
        if floored is not None:  # searched on the flat model, scored and bounded on this machine
            floored = dataclasses.replace(floored, options=opts)
        if floored is not None and floored.replicas and floored.status == "OPTIMAL":
            return say("node-floor DP", floored)
        # every pow2 plan is an ``any`` plan charged the same, so the interval DP's bound holds here too,
        # at a fraction of the charged DP's cost per pass and far above the flat bracket's on many nodes
        share = time.monotonic() + RELAXED_SHARE * (deadline - time.monotonic())
        relaxed = chain_plan(graph, dataclasses.replace(opts, replication="any"), start, share, plain=True,
                             bound_only=True, floor=floored.bound_s if floored is not None else 0.0,
                             tolerance=RELAXED_TOLERANCE)
        floor = max(relaxed.bound_s if relaxed is not None else 0.0, floored.bound_s if floored else 0.0)
    bracket = _bracketed(graph, opts, start, deadline, plain=True, floor=floor, hand=hand)
    if floored is not None and floored.replicas:  # its plan, scored placed, is a candidate too
        bracket = floored if bracket is None else _better(bracket, floored)
    say("flat bracket", bracket)
    if bracket is not None and bracket.status == "OPTIMAL":
        return bracket
    share = POW2_SHARE if opts.replication == "pow2" else CHARGED_SHARE
    exact = chain_plan(graph, opts, start, time.monotonic() + share * (deadline - time.monotonic()),
                       *((bracket.bound_s, bracket.bottleneck_s) if bracket is not None else ()),
                       chain_reads=_chains(opts))
    charged = say("charged DP", _merged(bracket, exact))
    return say("finer passes", _finer(graph, opts, start, deadline,
                                      say("exact cuts", _cuts_exact(graph, opts, start, deadline, charged)),
                                      prove_by))


def _said_placed(progress: Optional[Callable[[str], None]], start: float, label: str,
                 found: PartitionResult) -> None:
    """A progress line for ``found`` after the phase ``label`` (a two-level search's phases take seconds each)."""
    plan = f"plan {found.bottleneck_s * 1e3:.4g} ms, " if found.replicas else ""
    gap = f", gap {100 * found.gap:.2f} %" if found.replicas else ""
    segment_plan.said(progress, start, f"{label}: {plan}bound {found.bound_s * 1e3:.4g} ms{gap}",
                      "two-level segment DP")


def _resumed(graph: CostGraph, opts: CostOptions, start: float, deadline: float,
             found: PartitionResult) -> PartitionResult:
    """``found`` where it is proven within ``FINE_ABOVE`` or fewer than ``FINE_LEFT`` seconds are
    left; else the interval DP's bisection resumed between ``found``'s bound and plan (``_merged``).

    The interval DP (fxpipe's charges, any count) is a relaxation twice over: it charges each cut the
    least any neighbour allows and gives up the shape reads a cut separates from their readers
    (``Units.bridged``). Where those matter its passes find "plans" at T that score far above T
    (32 H100-profiled blocks on 512 devices: 0.173 ms at T = 0.162 ms), and its bisection, left to
    itself, spent the whole limit proving its bound to a hair while its best plan stayed 10 % above
    it. So past ``BOUND_SHARE`` of the time it stops where its plans score that far above their T
    (``placed.SETTLE_ABOVE``), and ``chain_plan``'s search that keeps the reads' compute where
    folding put them (a restriction: plans only) finds real ones in a few of its cheaper passes
    (0.159 ms there). Under that plan the resumed bisection's first pass sits 1 % below it: where
    that pass fails, the plan is proven within 1 %."""
    if found.gap <= FINE_ABOVE or deadline - time.monotonic() < FINE_LEFT:
        return found
    return _merged(found, chain_plan(graph, opts, start, deadline, found.bound_s, found.bottleneck_s,
                                     plain=True, chain_reads=True))


def _cuts_exact(graph: CostGraph, opts: CostOptions, start: float, deadline: float,
                found: Optional[PartitionResult]) -> Optional[PartitionResult]:
    """``found`` where it is proven within ``FINE_ABOVE`` or counts are not powers of two; else the
    charged DP with the previous stage's replica count in its state (``exact_cuts``), given
    ``EXACT_SHARE`` of the time left, between ``found``'s bound and plan.

    The charged DP charges each side of a cut the least any neighbour allows; where a rank talks to
    partners in two nodes (four replicas across a node boundary into one, two into eight that cross
    one) its passes find "plans" that score far above their T, and no pass can prove the plan in hand
    (8 H100-profiled blocks on 256 devices: "plans" at 0.082 ms scoring 0.118 ms, 2.7 % left open).
    With the count in the state every cut is charged as its ranks pay it, for log2 K + 1 times the
    states (a pass about twice a plain one's cost on that profile). It runs after the plain DP, not
    instead of it: replacing it cost rows their plans (a pass's fewest devices more often fail to pad
    to K, and the restricted search that found the plans lost its time), so it only tries to prove or
    beat the plan found, and gives up once a pass 1 % under that plan finds only a "plan" scoring far
    above its T (``chain.solve``'s ``fake_above``): its bound can then no longer prove the plan, and the
    finer lattice after it needs the time (8 blocks on 128 devices: six such passes, 1.2 s, for no
    higher bound)."""
    if found is None or found.gap <= FINE_ABOVE or opts.replication != "pow2" \
            or deadline - time.monotonic() < FINE_LEFT:
        return found
    share = time.monotonic() + EXACT_SHARE * (deadline - time.monotonic())
    return _merged(found, chain_plan(graph, opts, start, share, found.bound_s, found.bottleneck_s, plain=True,
                                     exact_cuts=True, fake_above=placed.SETTLE_ABOVE))


def _merged(found: Optional[PartitionResult], other: Optional[PartitionResult]) -> Optional[PartitionResult]:
    """``other``'s answer taken into ``found``: a bound alone (no plan faster than ``found``'s, status
    ``BOUND``) raises ``found``'s bound where higher; a plan competes with ``found``'s (``_better``)."""
    if other is None:
        return found
    if not other.replicas:
        if found is not None and other.bound_s > found.bound_s:
            found.bound_s = min(other.bound_s, found.bottleneck_s)
            found.status = "OPTIMAL" if found.gap <= OPTIMAL_GAP else "FEASIBLE"
        return found
    return other if found is None else _better(other, found)


def _finer(graph: CostGraph, opts: CostOptions, start: float, deadline: float,
           found: Optional[PartitionResult], prove_by: Optional[float] = None) -> Optional[PartitionResult]:
    """``found`` where it is proven within ``FINE_ABOVE``; else, with ``FINE_LEFT`` seconds or more
    left, the charged DP on the lattice that keeps the shape reads (folded up to ``QUIET`` of sum C / K),
    between ``found``'s bound and plan. The DPs before it fold every read (``segment_plan.QUIET_PLACED``):
    their bound gives up the reads a cut separates from their readers, and their plans keep each read
    with a producer or where ``silent_moves`` put it, so their answers may leave a gap that only a finer
    pass closes (one pass 1 % under the plan proves it within 1 %). Where those DPs did not chain the
    reads (``_chains``: ``pow2`` with fxpipe's charges) a pass on the chained folded lattice comes first
    (a cut gives up at most one read of a chain, ``read_chains.py``; 32 H100-profiled blocks on 128
    devices 1.64 -> 1.31 %, on 512 2.35 -> 1.82 %, with a faster plan). The better plan and the higher
    bound are kept. Each pass gives up as ``_cuts_exact``'s does (``fake_above``): on the folded lattice
    after a pass 1 % under the plan finds only a "plan" scoring far above its T, so the finer lattice,
    whose plans are real, has the time (8 blocks on 128 devices under ``pow2``: 1.40 -> 0.49 %).
    ``prove_by``: each pass's first one, 1 % under the plan, may run on until then (the polish's time,
    ``driver.partition``) at a pace that ends by then (``chain.solve``): it alone can prove the plan."""
    passes = [] if _chains(opts) else [(True, None)]  # (chain_reads, quiet): the chained folded lattice first
    passes.append((_chains(opts), QUIET))
    for chained, quiet in passes:
        if found is None or found.gap <= FINE_ABOVE or deadline - time.monotonic() < FINE_LEFT:
            return found
        found = _merged(found, chain_plan(graph, opts, start, deadline, found.bound_s, found.bottleneck_s,
                                          quiet=quiet, plain=True, chain_reads=chained,
                                          fake_above=placed.SETTLE_ABOVE, prove_by=prove_by))
    return found


def _time_of(graph: CostGraph, layout, opts: Optional[CostOptions] = None) -> float:
    """The bottleneck of a ``uniform.best_layout`` answer: as it was scored (on the machine), or under
    ``opts``; infinite for None (no layout: a ceiling that says nothing)."""
    if layout is None:
        return math.inf
    return layout[0].bottleneck_s if opts is None else evaluate(graph, layout[1], layout[2], opts).bottleneck_s


def _bracketed(graph: CostGraph, opts: CostOptions, start: float, deadline: float,
               plain: bool = False, floor: float = 0.0, hand=None,
               quiet: Optional[float] = None) -> Optional[PartitionResult]:
    """The segment DP under the flat model at the FASTER bandwidth (its bound is a bound of the placed
    model: no placement makes a link faster; under PipeDream's charges with its all-reduces floored
    by node count, ``node_floor.py``, its plans then scored placed) and at the SLOWER one (its plans
    place well), the plan that scores best placed kept, with the fast model's bound; ``plain``: see
    ``segment_plan.chain_plan``; ``floor``: a bound of the placed model known already; ``quiet``: where
    the faster model's placed (node-floor) DP folds nodes that send nothing, if not its own.

    ``hand``: given where the charged DP follows and takes this plan as its ceiling: the best uniform
    PP x DP layout (``uniform.py``). It is then a candidate: a lower ceiling lets one charged pass 1 %
    under it prove the plan within 1 %. It also caps both searches here:
    the slower model bisects below its time under that model, the faster one below its placed time
    (no placement charges less than the faster model), instead of from twice the bound; and the
    slower model stops within ``SLOW_TOLERANCE`` of its own optimum, since the charged DP that follows
    decides the answer (on 96 blocks its passes converging the last half percent took the seconds
    the charged DP needed); for the same reason the faster model stops bisecting, once it holds a
    plan, after ``FAST_SHARE`` of the time left (96 blocks on 1,024 devices under PipeDream's
    charges: its last steps, refining a bound 1.7 % under the optimum by hundredths of a percent,
    took the time of the charged pass that proves the answer within 1 %). Where that layout lies
    within ``UNIFORM_NEAR`` of the bound already, the slower model stops bisecting after
    ``SLOW_SHARE`` of the time left: on deep uniform stacks its passes took a third of the limit
    converging on plans slower than that layout, time the charged DP's one decisive pass needed; far from the bound (few blocks on many devices) its
    converged plans are what the answer rests on, so it keeps the time."""
    # one node: flat at B1; with a floor known, its bound (weaker on many nodes) is not worth its passes
    fast = chain_plan(graph, flat_bound(opts, fast=True), start, deadline, plain=plain,
                      machine=opts if node_floor.applies(opts) else None, ceiling=_time_of(graph, hand),
                      chain_reads=_chains(opts),
                      settle_by=time.monotonic() + FAST_SHARE * (deadline - time.monotonic())
                      if hand is not None else math.inf, quiet=quiet) if floor <= 0 else None
    if fast is None and floor <= 0:
        return None
    bound = fast.bound_s if fast is not None else floor
    near = hand is not None and hand[0].bottleneck_s <= bound * UNIFORM_NEAR
    settle_by = time.monotonic() + (SLOW_SHARE if near else 1.0) * (deadline - time.monotonic())
    slow_opts = flat_bound(opts, fast=False)
    # only its plans count: every shape read folds with its producer, compute kept (a restriction), so
    # a pass costs what the placed DPs' do (on a GPU profile at 1,024 devices one pass on the lattice
    # that keeps them ran past 8 s and 1.3 GB)
    slow = chain_plan(graph, slow_opts, start, deadline, floor=bound, plain=plain, settle_by=settle_by,
                      ceiling=_time_of(graph, hand, slow_opts),
                      tolerance=SLOW_TOLERANCE if hand is not None else None,
                      quiet=QUIET_PLACED, keep_dead=True) \
        if opts.gpus_per_node < opts.devices else None
    # a search capped by the layout may answer its bound alone (no faster plan in its model)
    scored = [(evaluate(graph, r.assignment, r.replicas, opts), r) for r in (fast, slow)
              if r is not None and r.replicas]
    if hand is not None:
        # its bound is the segment DPs' (given as ``floor``, or the faster model's), as is any later proof
        scored.append((hand[0], _uniform_result(graph, opts, hand, "FEASIBLE", 0.0, 0.0,
                                                "uniform layout, segment DP bound")))
    if not scored:
        return None
    ev, best = min(scored, key=lambda x: x[0].bottleneck_s)
    result = dataclasses.replace(
        best, stages=ev.stages, bottleneck_s=ev.bottleneck_s, objective_s=ev.bottleneck_s,
        options=opts, bound_s=min(bound, ev.bottleneck_s), wall_s=time.monotonic() - start)
    result.status = "OPTIMAL" if result.gap <= OPTIMAL_GAP else "FEASIBLE"
    return result


def _placed_general(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float,
                    workers: int, coarsen_above: int, solver: str, masks: Optional[List[int]], limit: int,
                    progress) -> PartitionResult:
    """The placement-aware downset DP on small lattices, else CP-SAT on the bracketing flat models.

    ``masks``: the lattice as ``_placed`` enumerated it (None where it is past ``CHEAP_CUTS_CAP``
    times ``limit``). A lattice past the exact DP's limit but within ``CHEAP_CUTS_CAP`` times it gets the same DP
    on its cheapest cuts first (``downsets.cheap_cut_plan``, ``CHEAP_CUTS_SHARE`` of the time
    left): CP-SAT cannot see placement, and on GNMT over 8 nodes of 2 GPUs its plans stayed 11.8 %
    above the optimum that restriction finds in about a second. Its plan competes with CP-SAT's; the
    bound is CP-SAT's.
    """
    slow = flat_bound(opts, fast=False)
    exact = cheap = ordered = None
    if solver == "auto":
        quick = best_order_dp(fine, slow, deadline) if len(fine) <= coarsen_above else None
        upper = evaluate(graph, to_nodes(graph, fine, quick.stage_of), quick.replicas, opts).bottleneck_s \
            if quick else math.inf
        ordered = _placed_order(graph, fine, opts, start, deadline)
        upper = min(upper, ordered.bottleneck_s) if ordered is not None else upper
        if masks is not None and len(masks) <= limit:
            exact = downset_dp(fine, opts, upper=upper, deadline=deadline, masks=masks)
        elif masks is not None and opts.memory is None:  # its plans do not check memory
            now = time.monotonic()
            cheap = cheap_cut_plan(fine, opts, masks, upper, now + CHEAP_CUTS_SHARE * (deadline - now), most=limit)
    if exact is not None and opts.memory is None and not fine.shared:
        solved = SolveResult("OPTIMAL", *exact, exact.objective, time.monotonic() - start)
        return _result(graph, fine, opts, solved, start, exact.objective, "downset DP")
    restricted = ordered
    if cheap is not None:
        solved = SolveResult("FEASIBLE", cheap.stage_of, cheap.replicas, cheap.objective, ideal_s(graph, opts),
                             time.monotonic() - start)  # a restriction: its own bound is only sum C / K
        cheapest = _result(graph, fine, opts, solved, start, None, "downset DP on the cheapest cuts")
        restricted = cheapest if ordered is None else _better(cheapest, ordered)  # ties: the wider search's
    if restricted is None:
        return _placed_cpsat(graph, fine, opts, start, deadline, workers, coarsen_above, progress)
    try:
        return _better(restricted, _placed_cpsat(graph, fine, opts, start, deadline, workers, coarsen_above, progress))
    except InfeasibleError:
        return restricted


PLACED_ORDER_SHARE = 0.3  # of the time left, at most, for the placed order DP before CP-SAT (``order_placed``)


def _placed_order(graph: CostGraph, fine: Units, opts: CostOptions, start: float,
                  deadline: float) -> Optional[PartitionResult]:
    """The order DP with contiguous placement (``order_placed.py``) where its table is small, scored on
    the graph; its bound is only sum C / K. CP-SAT sees the machine only through the flat models:
    gnmt on 8 nodes of 8 (fxpipe's charges) read 0.00-32.6 % open by the run, and this plan meets
    the bound there."""
    if opts.memory is not None or fine.shared or not order_placed.fits(fine, opts):
        return None  # its plans check neither memory nor tied weights' sync
    now = time.monotonic()
    found = order_placed.best_placed_order(fine, opts, now + PLACED_ORDER_SHARE * (deadline - now))
    if found is None:
        return None
    solved = SolveResult("FEASIBLE", *found, ideal_s(graph, opts), time.monotonic() - start)
    return _result(graph, fine, opts, solved, start, None, "order DP, placed")


def _placed_cpsat(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float, workers: int,
                  coarsen_above: int, progress) -> PartitionResult:
    """CP-SAT on a two-level machine, which its model sees only through ``model_nodes.py``.

    On every node where the graph has at most ``FINE_CPSAT_MAX`` units and the model fits in the
    time: one run of the flat model at the FASTER bandwidth with what crossing a node boundary
    costs (a stage across one all-reduces between nodes, a cut on one runs between nodes), a
    relaxation of the placed model whose bound is a bound and whose plans see where nodes end,
    started from the better (scored placed) of the order DP's plans on the two bracketing flat
    models. inception_v3 on 2 nodes of 4 (10 s): under fxpipe's charges 12.1 % open before (plan
    0.0980 s, bound sum C / K), now 0.0886 s within 2.8 %; under PipeDream's and ``pow2`` OPTIMAL.
    Where the machine has too many node boundaries to model (``model_nodes.walls_modelled``) the flat
    model at the SLOWER bandwidth (whose plans place well) gets two thirds of the time first, and the
    second run charges only what counts past G pay. On coarsened units (the bound then holds only for
    plans that keep each group in one stage, ``_restricted``, so it is sum C / K) the two flat models
    run as before, two thirds and the rest: there the boundary model finds plans later (nasnetalarge
    on 2 nodes of 4, 3 s from the same start: 0.08295 s against the flat model's 0.08266 s). Of all the plans, the one
    ``evaluate`` scores best under ``opts`` is kept; it is OPTIMAL only if it meets the bound.
    """
    slow, fast = flat_bound(opts, fast=False), flat_bound(opts, fast=True)
    units = fine if len(fine) <= FINE_CPSAT_MAX and _time_for_cpsat(fine, fast, deadline) \
        else coarsen(graph, opts, target=coarsen_above, deadline=deadline)
    coarse = len(units) < len(model_nodes(graph, opts))
    bound = sum(units.compute) / opts.devices  # every plan is at least this slow, whatever its placement
    if coarse:  # no bound to prove with: the two flat models, whose searches found plans sooner
        runs = [(slow, None, 2 / 3), (fast, None, 1.0)]
    elif not walls_modelled(opts, slots_of(units, opts)):  # counts past G still pay their crossing
        runs = [(slow, None, 2 / 3), (fast, opts, 1.0)]
    else:
        runs = [(fast, opts, 1.0)]
    warm = [best_order_dp(units, flat, deadline) for flat in (slow, fast)]
    plans = [w for w in warm if w is not None and opts.memory is None]  # they do not check memory
    score = lambda p: evaluate(graph, to_nodes(graph, units, p.stage_of), p.replicas, opts).bottleneck_s
    heuristic = min(score(p) for p in plans) if plans else None
    wall, trace = 0.0, []
    for flat, machine, share in runs:
        if not _time_for_cpsat(units, flat, deadline):
            continue
        model = _cp_sat(units, flat, machine=machine)
        start_from = min(plans, key=score) if machine is not None and plans else warm[flat is fast]
        if start_from is not None:
            model.hint(start_from.stage_of, start_from.replicas)
            if opts.memory is None and not units.shared:  # its time in this model, which the optimum beats
                model.upper_bound(evaluate(graph, to_nodes(graph, units, start_from.stage_of), start_from.replicas,
                                           machine or flat).bottleneck_s)
        solved = model.solve(max(0.05, (deadline - time.monotonic()) * share), workers=workers, report=progress)
        wall, trace = wall + solved.wall_s, trace + solved.progress
        if solved.stage_of is not None:
            plans.append(Solution(solved.stage_of, solved.replicas, solved.objective))
            if flat is fast and not coarse:
                bound = max(bound, solved.bound)
        elif not plans and (flat is slow or len(runs) == 1):  # the first model found none: why (memory?)
            _raise_infeasible(units, opts, solved, None, deadline, workers, restricted=coarse)
    if not plans:
        raise InfeasibleError(f"partition: no plan found in {deadline - start:.0f}s; raise --time-limit")
    value, best = min(((score(p), p) for p in plans), key=lambda x: x[0])
    status = "OPTIMAL" if value <= bound * (1 + OPTIMAL_GAP) else "FEASIBLE"
    solved = SolveResult(status, best.stage_of, best.replicas, value, bound, wall, trace)
    return _result(graph, units, opts, solved, start, heuristic, "CP-SAT")


def _time_for_cpsat(units: Units, opts: CostOptions, deadline: float) -> bool:
    """Whether building the CP-SAT model and its presolve fit in the time left (neither stops on time).

    Measured here: building runs at about 5e4 variables per second on a quiet machine (HF GPT-2, 432
    units, K = 256: 5 s to build), half that with another process on each core; the slower rate is
    assumed. Presolve then does not stop at the solver's limit either: HF GPT-2 on an H100's profile,
    K = 64 (about 4.5e4 cells, 1 s to build), ran 3 s past a 3.9 s limit without a solution, which
    broke ``partition``'s limit + 1 s. So the model is started only where the time left is five times
    its build at the slower rate.
    """
    slots = min(opts.devices, max(1, sum(units.has_compute)))
    cells = (len(units) + len(units.producers)) * slots + slots * len(opts.allowed_replicas())
    left = deadline - time.monotonic()
    return left >= 0.2 and cells / 2.5e4 <= 0.2 * left




def _result(graph: CostGraph, units: Units, opts: CostOptions, solved: SolveResult, start: float,
            heuristic_s: Optional[float], method: str) -> PartitionResult:
    assignment, replicas, result = _best_scored(graph, units, opts, solved)
    out = PartitionResult(
        assignment=assignment, replicas=list(replicas), stages=result.stages,
        bottleneck_s=result.bottleneck_s, options=opts, status=solved.status,
        objective_s=solved.objective, bound_s=min(solved.bound, result.bottleneck_s),
        wall_s=time.monotonic() - start, units=len(units), heuristic_s=heuristic_s, trace=solved.progress,
        method=method,
    )
    if out.status == "OPTIMAL" and out.gap > OPTIMAL_GAP and tied_weights(graph, assignment):
        out.status = "FEASIBLE"  # the solver charged tied weights below their sync (costmodel.tied_sync_s)
    return out


def _best_scored(graph: CostGraph, units: Units, opts: CostOptions, solved: SolveResult) -> tuple:
    """(assignment, replicas, evaluation) of the solver's answer, or of an earlier solution it kept
    (``SolveResult.plans``: where tied weights make its objective a floor) that ``evaluate`` scores
    faster. Only solutions whose objective lies under the answer's real time can be (their real time
    is at least their objective, to the model's rounding: 0.1 % is allowed), so few are scored; the
    answer itself, usually the last kept, is not scored twice."""
    assignment = to_nodes(graph, units, solved.stage_of)
    best = (assignment, solved.replicas, evaluate(graph, assignment, solved.replicas, opts))
    for objective, stage_of, replicas in reversed(solved.plans):
        if (stage_of, replicas) != (solved.stage_of, solved.replicas) \
                and objective * (1 - OPTIMAL_GAP) < best[2].bottleneck_s:
            other = to_nodes(graph, units, stage_of)
            ev = evaluate(graph, other, replicas, opts)
            if ev.bottleneck_s < best[2].bottleneck_s:
                best = (other, replicas, ev)
    return best


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _check_devices(units: Units, opts: CostOptions) -> None:
    work = sum(units.has_compute)
    if work == 0:
        raise InfeasibleError("partition: the graph has no node with compute; nothing to place on devices")
    if opts.replication == "none" and not opts.fewer_devices and opts.devices > work:
        raise InfeasibleError(
            f"partition: {opts.devices} devices without replication need {opts.devices} stages, but only "
            f"{work} units have compute; use at most --devices {work}, or allow replication or --fewer-devices")




def _raise_infeasible(units: Units, opts: CostOptions, solved: SolveResult,
                      warm, deadline: float, workers: int, restricted: bool = False) -> None:
    """Raise with the smallest memory that fits (if memory is the reason), searched until the deadline.
    ``restricted``: ``units`` are coarsened, so the probe's optimum and bound hold only for plans that
    keep each unit whole (the 96-block GPT on 8 devices: "426.8 MiB is the least" where 416 MiB fits)."""
    if solved.status == "UNKNOWN" and warm is not None and opts.memory is None:
        return  # time ran out before CP-SAT restated the warm start: keep it
    if opts.memory is None or solved.status != "INFEASIBLE":
        raise InfeasibleError(f"partition: no plan found ({solved.status}) in {solved.wall_s:.1f}s; "
                              "raise --time-limit")
    probe = _cp_sat(units, opts, minimise_memory=True)
    if warm is not None:
        probe.hint(warm.stage_of, warm.replicas)
    least = probe.solve(max(0.05, deadline - time.monotonic()), workers=workers)
    if least.stage_of is None:
        raise _no_fit(opts, None, None, "CP-SAT")
    proven = least.status == "OPTIMAL" and not restricted
    raise _no_fit(opts, least.objective, None if proven or restricted else least.bound, "CP-SAT", proven)


def _no_fit(opts: CostOptions, fits_in: Optional[float], at_least: Optional[float], by: str,
            proven: bool = False) -> InfeasibleError:
    """The error for a memory limit no plan meets: the least memory a plan was found in (by ``by``;
    ``proven`` the least there is), and the proven floor where known. Both ride on the error
    (``fits_in``, ``at_least``), so a caller with a plan in less memory can say so instead."""
    if fits_in is None:
        what = "no plan fits any memory in the time given"
    else:
        what = f"a plan fits in {_fmt_bytes(fits_in)} per device on {opts.devices} devices ({by}"
        what += "; proven the least)" if proven else \
            f", found within the time limit; at least {_fmt_bytes(at_least)} is needed)" if at_least is not None \
            else ", the least it found; not proven the least)"
    err = InfeasibleError(
        f"partition: no plan fits in {_fmt_bytes(opts.memory)} per device "
        f"({opts.schedule}, optimizer state {opts.optimizer_state}x weights); {what}. "
        "Raise --memory, add devices, or use --schedule 1f1b-flush/gpipe with fewer microbatches.")
    err.fits_in = math.inf if fits_in is None else fits_in
    err.at_least = at_least
    return err


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3f} {unit} ({int(n)} bytes)"
    return f"{int(n)} bytes"


def apply_assignment(gm, assignment: Dict[str, int]) -> None:
    """Write ``meta.StageAssign`` on every fx node named in ``assignment``."""
    from passes import meta

    for node in gm.graph.nodes:
        if node.name in assignment:
            meta.put(node, meta.StageAssign(stage=int(assignment[node.name])))


def is_convex(graph: CostGraph, assignment: Dict[str, int]) -> bool:
    """Stages form a chain: no edge goes backwards, and no stage is left empty."""
    stages = set(assignment.values())
    return all(assignment[u] <= assignment[v] for u, v in graph.edges) and stages == set(range(len(stages)))



def _pipedream_levels(graph: CostGraph, opts: CostOptions, deadline: float) -> Optional[Dict[str, object]]:
    """What PipeDream's hierarchical optimizer answers for the same two-level machine, to compare with.

    Only under its own cost model and options (a two-level machine, no memory
    limit, any replication, all devices); None where it does not apply, the
    graph has too many downsets for the reproduction, or it does not finish by
    the search's ``deadline`` (the time limit holds for the whole call: on
    resnext101 it took 3.7 s after a search that used the limit). A graph of n
    nodes has at least n + 1 downsets (every topological prefix is one), so one
    of ``limit`` nodes or more is turned away before the reproduction spends
    most of a second finding that out.
    """
    G, limit = opts.gpus_per_node, 1000
    if (opts.cost_model != "pipedream" or G is None or opts.memory is not None or opts.fewer_devices
            or opts.replication != "any"):
        return None
    if len(graph.nodes) >= limit:
        return None
    from passes.partition.hierarchical import pipedream_hierarchical

    try:
        h = pipedream_hierarchical(graph, [G, opts.devices // G], [opts.intra_bw, opts.bandwidth], limit=limit,
                                   deadline=deadline)
    except FxpipeError:
        return None
    return {"time_s": h.time_s, "replicas": h.replicas, "ranks": h.ranks}
