"""``1f1b-stash`` plans with tied weights, searched and bounded one common replica count at a time.

Under ``1f1b-stash`` every stage that shares a tied weight runs the same
replica count (``stash_ties.py``). The segment DP cannot carry that count
across the chain, but it can state the rule for one given count c
(``CostOptions.tied_replicas``: a stage sharing a tied weight runs exactly c
replicas, and so does each other holder, so its group has at least c ranks
besides it). Every plan the runtime can run has some common count, so the
least of the per-count bounds, over every allowed c with 2c <= K (a tie joins
at least two stages), bounds them all; the unconstrained bound still holds
too, and the higher of the two is the answer's.

Each count gets the DP on ``segment_plan``'s relaxation (a mask branch
free, its compute still counted, ``branches.py``), bracketed by the best
runnable plan so far: its first pass sits ``chain.PROVE_WITHIN`` under that
plan, so one infeasible pass settles a count within 1 %, and a feasible one
is a faster plan (kept where the runtime can run it and it scores faster);
where the count's bound leaves room, plans with the mask branch as one node,
then in pieces. Far from the plan's own count every count fails: one pass
over the rest of a side (each tied stage any count of the range,
``CostOptions.tied_replicas_upto``, a relaxation of each) settles them at
once, tried at the 1st, 2nd, 4th, 8th... count on each side of the best
plan's count (``_tails``). The counts go the plan's own first, then the
powers of two, then the rest around the best plan's count (``_ordered``).
A second round, while time is left, closes every count to
the DP's tolerance. Every candidate has its loose nodes (export's guard checks)
placed where they cost least (``segment_plan.finished``), as ``chain_plan``'s
are. Measured at 10 s on HF GPT-2 with its head tied to the embedding (the
tests' stored profile), with the searches before it at half the limit
(``driver._searches_until``): 32 and 64 devices OPTIMAL (2.85 and 6.0 %
open before, plans 2.8 and 6.0 % faster), 128, 256, 512 and 1,024 devices
1.5, 3.8, 1.8 and 12.3 % (15.2, 14.1, 33.0 and 24.2 % before); with
``pow2`` 32 and 64 OPTIMAL, 128-1,024 0.65-2.3 % (2.8, 5.9, 17.0, 20.0,
3.2, 0.8 % before). The range passes and the order (a quicker hour, before
and after in it): 128, 256, 512 and 1,024 devices 0.87, 0.30, 2.24 and
0.56 % (0.89, 3.80, 12.26 and 0.56 %). CP-SAT under the rule (``driver._stash_searched``)
had found nothing faster at 32 and 64 devices in 40 s. Per count the DP's
fewest-devices plan may not spread over exactly K with the tied stages held
(``chain.pad``), so a count's plans can miss, never its bound.
Flat machines, no memory limit (the segment DP models neither otherwise).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import List, Optional, Tuple

from passes.costgraph import CostGraph
from passes.partition import branches, segment_plan, stash_ties
from passes.partition.chain import PROVE_WITHIN, TOLERANCE
from passes.partition.coarsen import to_nodes
from passes.partition.costmodel import CostOptions, evaluate, shared_weights
from passes.partition.result import OPTIMAL_GAP, PartitionResult

PIECES = (1, 8)  # the mask branch in the plan searches: one node, then a chain of pieces (``branches.contracted``)
ROUNDS = (PROVE_WITHIN * (1 + 1e-6), TOLERANCE)  # where each count's bisection stops, round by round


def may_apply(opts: CostOptions, tied: bool) -> bool:
    """Whether the per-count search can run for a graph with (``tied``) or without tied weights: a
    ``1f1b-stash`` plan on a flat machine without a memory limit, with replicas (the driver leaves it
    time only then, ``driver._searches_until``)."""
    return (tied and opts.schedule == stash_ties.SCHEDULE and opts.gpus_per_node is None and opts.memory is None
            and opts.replication != "none")


def applies(graph: CostGraph, opts: CostOptions, found: PartitionResult) -> bool:
    """Whether the per-count search has something to prove (``may_apply``): a runnable plan, not
    proven, of a graph with a tied weight. The plan need not split it: the best runnable plan may
    (HF GPT-2 tied under PipeDream's charges, 64 devices: evening's plan holds the tie in one stage,
    3.6 % open, and until 2026-12-05 the search did not run)."""
    return (may_apply(opts, True) and found.status != "OPTIMAL" and found.bottleneck_s < math.inf
            and bool(graph.param_sizes) and bool(shared_weights(graph))
            and stash_ties.runnable(graph, found.assignment, found.replicas))


def searched(graph: CostGraph, opts: CostOptions, found: PartitionResult, deadline: float,
             progress=None) -> PartitionResult:
    """``found`` (a runnable plan, ``stash_ties.evened``'s) with a faster runnable plan where a count's
    search finds one, and its bound raised to the least per-count bound once every count is done (by
    ``deadline``, ``time.monotonic``); the rounds of ``ROUNDS`` each go over every count."""
    if not applies(graph, opts, found):
        return found
    start = time.monotonic()
    cones = branches.input_only_cones(graph, opts)
    counts = _ordered(graph, [c for c in opts.allowed_replicas() if 2 * c <= opts.devices], found)
    if not counts:
        return found
    best: Tuple[float, Optional[tuple]] = (found.bottleneck_s, None)  # (time, (evaluation, assignment, replicas))
    keep = functools.partial(_kept, graph, opts, segment_plan.loose_groups(graph, opts))
    lows = {c: found.bound_s for c in counts}
    bound = found.bound_s

    def visit(c: int, tolerance: float, tails: dict) -> bool:
        """Count c's bound, then its plans where the bound leaves room; False past the deadline."""
        nonlocal best
        if time.monotonic() > deadline:
            return False
        if c in tails and lows[c] * (1 + tolerance) < best[0]:  # one pass for the rest of this side
            _settle(graph, opts, cones, deadline, tails[c], best[0] / (1 + tolerance) * (1 + 1e-12), lows)
        if lows[c] * (1 + tolerance) >= best[0]:
            return True  # this count is settled at this round's tolerance
        counted = dataclasses.replace(opts, tied_replicas=c)
        lower = segment_plan.bracketed(graph, counted, deadline, cones, floor=lows[c], ceiling=best[0],
                                       tolerance=tolerance)
        if lower is None:
            return False
        units, solution, margin = lower
        lows[c] = max(lows[c], solution.bound - margin)
        if solution.stage_of is not None:
            best = keep(best, to_nodes(graph, units, solution.stage_of), solution.replicas)
        best = _restricted(graph, keep, counted, cones, deadline, tolerance, lows[c], best, PIECES[:1])
        return True

    first = [c for c in counts if c == counts[0] or c & (c - 1) == 0]  # ``_ordered``: the own count, powers of two
    for tolerance in ROUNDS:
        for c in first:  # bounds first: one pass each settles most counts (its plans kept where runnable)
            if not visit(c, tolerance, {}):
                return _answer(found, best, bound, start)
        centre = counts[0] if best[1] is None else _own_count(graph, best[1][1], best[1][2]) or counts[0]
        rest = _nearest(centre, [c for c in counts if c not in first])
        tails = _tails(centre, rest)
        for c in rest:
            if not visit(c, tolerance, tails):
                return _answer(found, best, bound, start)
        bound = max(bound, min(min(lows.values()), best[0]))
        for c in sorted(counts, key=lows.get):  # then the branch in pieces, the most promising counts first
            if time.monotonic() > deadline:
                return _answer(found, best, bound, start)
            counted = dataclasses.replace(opts, tied_replicas=c)
            best = _restricted(graph, keep, counted, cones, deadline, tolerance, lows[c], best, PIECES[1:])
        if progress is not None:
            progress(f"partition: 1f1b-stash, every common count of the tied stages searched: bound "
                     f"{bound * 1e3:.4f} ms, plan {best[0] * 1e3:.4f} ms")
    return _answer(found, best, bound, start)


def _tails(centre: int, counts: List[int]) -> dict:
    """Per count where a range check pays (``_settle``), the counts on its side of ``centre`` (the best
    plan's count) from it outwards: at the 1st, 2nd, 4th, 8th... count of a side, so that a side whose
    far counts all fail costs a few passes, not one per count (HF GPT-2 tied, 256 devices: each count
    12 % of the time the per-count search had, counts 15-128 failed one pass each, 111-128 got none),
    and the checks come after the counts nearest the best one, whose plans lower the time they are made
    at (on 512 devices twelve checks at the first plan's time all found plans). Around the best count,
    not the first plan's: on 512 devices that was 16 replicas, the best 64, and every range from 17 up
    held 64."""
    out = {}
    for side in (sorted(c for c in counts if c > centre), sorted((c for c in counts if c < centre), reverse=True)):
        for k in range(len(side) - 1):  # a range of one count is that count's own pass
            if k & (k + 1) == 0:
                out[side[k]] = side[k:]
    return out


def _settle(graph: CostGraph, opts: CostOptions, cones, deadline: float, tail: List[int], T: float,
            lows: dict) -> None:
    """Raise ``lows`` of every count in ``tail`` to T, less folding's margin, where one pass over their
    range (``CostOptions.tied_replicas_upto``, a relaxation of each) proves that no plan meets T."""
    if all(lows[c] >= T for c in tail):
        return
    ranged = dataclasses.replace(opts, tied_replicas=min(tail), tied_replicas_upto=max(tail))
    proven = segment_plan.proven_above(graph, ranged, deadline, cones, T)
    if proven is not None:
        for c in tail:
            lows[c] = max(lows[c], proven)


def _restricted(graph: CostGraph, keep, counted: CostOptions, cones, deadline: float,
                tolerance: float, low: float, best: tuple, pieces: Tuple[int, ...]) -> tuple:
    """``best``, or (``keep``: ``_kept``) a faster runnable plan of the count's search with the mask branch as ``pieces`` nodes in a
    chain (``segment_plan.searched``), where the count's bound (``low``) leaves room under ``best``: the
    relaxation's plans may run that branch where no plan can (HF GPT-2, 32 devices: the relaxation's plan
    at one common replica scored 2.29 ms, this search's 1.75 ms, the unconstrained optimum)."""
    for k in pieces if cones else ():
        if time.monotonic() > deadline or low * (1 + tolerance) >= best[0]:
            break
        found = segment_plan.searched(graph, counted, deadline, cones, keep_dead=True, ceiling=best[0],
                                      tolerance=tolerance, pieces=k)
        if found is not None and found[0] is not None:
            best = keep(best, *found[0])
    return best


def _ordered(graph: CostGraph, counts: List[int], found: PartitionResult) -> List[int]:
    """The plan's own common count first, then the powers of two, then the rest, each nearest the plan's
    count first: near it a faster plan is likeliest, and finding one early lowers the bracket of every
    later count; the powers of two span the range in a few counts, where the own count can lie far from
    the best one (HF GPT-2 tied, 512 devices: evening's plan at 16 replicas, the best at about 64; one
    count at a time up from 16, the time ran out at 29, 10.4 % open). ``searched`` orders the rest again
    around the best plan's count once the powers of two are done."""
    anchor = _own_count(graph, found.assignment, found.replicas) or 1
    own, powers = [c for c in counts if c == anchor], [c for c in counts if c != anchor and c & (c - 1) == 0]
    return own + _nearest(anchor, powers) + _nearest(anchor, [c for c in counts if c != anchor and c & (c - 1)])


def _nearest(centre: int, counts: List[int]) -> List[int]:
    """``counts`` nearest ``centre`` first (by ratio, the smaller of a tie first)."""
    return sorted(counts, key=lambda c: (abs(math.log(c / centre)), c))


def _own_count(graph: CostGraph, assignment, replicas) -> Optional[int]:
    """The replicas of a runnable plan's tied stages (None where no stage shares a tied weight)."""
    own = [replicas[j] for j in stash_ties.tied_stages(graph, assignment)]
    return min(own) if own else None


def _kept(graph: CostGraph, opts: CostOptions, loose, best: tuple, assignment, replicas) -> tuple:
    """``best``, or the plan (``assignment``, ``replicas``) where the runtime can run it and it is faster,
    its loose groups and silent nodes placed where they slow it least (``segment_plan.finished``, as
    ``chain_plan`` does: the DP leaves export's guard checks out, and where it puts them is not where
    they cost least; HF GPT-2, 64 devices, one count: 6.6 % of a plan's time in its first stage)."""
    if not stash_ties.runnable(graph, assignment, replicas):
        return best
    ev = evaluate(graph, assignment, replicas, opts)
    ev, assignment, replicas = segment_plan.finished(graph, loose, assignment, replicas, ev, opts)
    if ev.bottleneck_s < best[0]:
        return ev.bottleneck_s, (ev, assignment, list(replicas))
    return best


def _answer(found: PartitionResult, best: tuple, bound: float, start: float) -> PartitionResult:
    """``found`` with the better plan and the higher bound."""
    out = dataclasses.replace(found, wall_s=found.wall_s + time.monotonic() - start)
    if best[1] is not None:
        ev, assignment, replicas = best[1]
        out = dataclasses.replace(out, assignment=dict(assignment), replicas=replicas, stages=ev.stages,
                                  bottleneck_s=ev.bottleneck_s, objective_s=ev.bottleneck_s,
                                  method=f"{found.method}; faster plan by the segment DP per common tied count")
    if best[1] is None and bound > found.bound_s:
        out.method = f"{found.method}; bound by the segment DP per common tied count"
    out.bound_s = min(max(out.bound_s, bound), out.bottleneck_s)
    if out.status != "HEURISTIC":
        out.status = "OPTIMAL" if out.gap <= OPTIMAL_GAP else "FEASIBLE"
    return out
