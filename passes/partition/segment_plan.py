"""The segment DP as the partitioner runs it: on the folded units of a graph, with the attention-mask
branches (``branches.py``) planned as one block and bounded on the graph where they are free, the
loose ends (nodes nobody reads) placed where they slow a stage least, a tied weight's real sync
re-searched (``retie.py``), and every plan scored on the graph's own nodes (``costmodel.evaluate``).

``chain_plan`` is the entry point (``driver.partition`` and the two-level paths call it); the rest
are its steps, kept here so the driver holds only the order in which solvers run.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from passes.costgraph import CostGraph
from passes.partition import (anchors, branches, charged, node_floor, placed, retie, side_chains, stage_count,
                               wide_blocks, wide_segments)
from passes.partition.chain import PROVE_WITHIN, TOLERANCE, ChainSolver, solve as chain_solve, unit_bottleneck
from passes.partition.coarsen import Hidden, Units, ideal_s, model_nodes, to_nodes
from passes.partition.freed_sends import chain_sends, freed_sends, lookups
from passes.partition.costmodel import CostOptions, evaluate, tied_weights
from passes.partition.memory_guard import past
from passes.partition.result import OPTIMAL_GAP, PartitionResult
from passes.partition.segments import MAX_DOWNSETS, build_segments, fold_margin, folded_units, weight_only
from passes.partition.tie_floor import tie_floor
from passes.partition.work_floor import work_floor


QUIET = 1e-3  # nodes that send nothing and cost up to this x sum C / K fold, their compute dropped
# ... for the placed and node-floor DPs, whatever they cost: many devices shrink sum C / K until shape reads
# pass QUIET, and each one kept doubles its block's downsets (the benchmark GPT profiled on an H100: 1,588
# a block instead of 108, a charged pass over 8 blocks 2.4 s instead of 0.13 s). Their compute is charged
# to every stage that holds a unit before them and one after them (``Units.bridged``, a relaxation that
# gives up only the reads a cut separates from their readers), and a plan runs them where they slow it
# least (``silent_moves``). Until this release they folded up to 1 % of sum C / K (``wide_blocks.SILENT``)
# with their compute dropped: on that profile 2.4 % of the compute at 64 devices, the bound 2.2 % under
# the plan. The flat DP keeps its exact lattice and starts from a coarse one instead (``wide_blocks.py``)
QUIET_PLACED = math.inf
RESTRICT_SHARE = 0.5  # of the time left, for the two-level search that keeps the reads' compute after a bisection
# settled early (``settle_by``): the resumed bisection that may prove its plan needs the rest (``driver._resumed``)
CHAIN_ABOVE = 5e-3  # of sum C / K: shape reads of one unit chain where a cut could give up more (``read_chains``);
# on the H100-profiled GPT a block's reads less the largest (45 us) are 0.2-250 % of it, on the CPU
# profile 0.004-6 %: on 96 CPU-profiled blocks at 64-256 devices chains only slowed the passes
# (23 -> 21 of 24 rows OPTIMAL with every chain made)
DEEP = 600  # nodes above which a flat graph whose segments do not build, or are too wide to search
# (``wide_segments.LIMIT``), gets the rotary reads anchored and its wide segments narrowed (``anchors.py``,
# ``wide_segments.py``): CP-SAT runs on every node up to there (``driver.FINE_CPSAT_MAX``) and did better on
# inception_v3 (325 nodes) with the whole 10 s, and HF GPT-2 (536) keeps its wide mask pieces' lattices
FINER_AFTER = 2.0  # seconds left after the plans from which the wide path tries ``finer_bound`` (not tuned):
# its lattices take 0.5 s to build and a pass 0.5-1.5 s on the 24-layer Llama, 2.2-3.8 s on the 96-layer
# one (1.5-6 s on 24 layers before its counts came from below, quick and slow days on this machine),
# and a pass cut off proves nothing
SHRINK_TO = wide_segments.LIMIT  # downsets ``finer_bound`` brings a segment too wide for its lattice to, freeing
# its side chains (``side_chains.py``): on HF Phi3 (24 layers, 128 devices, 10 s) 7.84 % open with every weightless
# node freed; a prototype of it read 5.96 / 3.05 / 2.77 % at 1,000 / 2,000 / 3,000, and at 4,000 its searches stopped
# at the planning memory budget; 2,000 keeps a pass near the Llama's (3,221 a block, not shrunk)
WIDE_SEARCHES = (wide_segments.narrowed, wide_segments.paired)  # the wide path's plans where the bound is kept, in
# order: the first is the quickest, and the relaxation's bound (``early_bound``) runs under its plan; the search
# on merged blocks comes after ``finer_bound`` (``_merged_plan``). Not the chained search: ``paired`` holds
# every chained plan, and on the 24-layer Llama its 0.7-1.5 s went to ``finer_bound`` on a slow day (32, 128
# and 256 devices 2.06 -> 1.55, 5.09 -> 2.58 and 7.20 -> 3.67 % open; 8 and 16 planned 0.06 and 0.02 % slower,
# where the chained plan scored best once its loose nodes were placed; 96 layers: the same plans)
WIDE_UNBOUNDED = (wide_segments.narrowed, wide_segments.chained, wide_segments.merged, wide_segments.paired)  # where
# the bound is dropped (``bound_kept``): no bound runs, and the chained plan is the quickest after the first
EARLY_TOLERANCE = 3e-3  # where ``early_bound``'s bisection stops once its relaxation has a plan 1 % under the
# first plan (the DP's own tolerance, 3e-4, until then): it can no longer prove that plan within 1 %, and stands
# as the paired search's floor and where ``finer_bound`` proves nothing; on 96 Llama layers and 1,024 devices its
# last four passes (0.45 s, which the finer pass needs) raised it 0.07 %
SCORING_EVALUATIONS = 30  # evaluations' worth of time the wide path keeps back (``_scoring_reserve``)
CONE_PIECES = (8, 16)  # a mask branch's plans, where not proven, in this many pieces in a chain, each count
# in turn until one proves (``branches.contracted``): one piece made the branch's 0.36 ms run in one stage,
# and HF GPT-2's tied head at 64 devices read 1.3 % above its bound with the stages before it half empty;
# 8 pieces prove it, 16 (a finer chain through the same cuts, whose plan there read 1.26 %) take tied 128
# from 1.15 to 0.84 %


def chain_plan(graph: CostGraph, opts: CostOptions, start: float, deadline: float, floor: float = 0.0,
           ceiling: float = math.inf, plain: bool = False,
           machine: Optional[CostOptions] = None, settle_by: float = math.inf,
           bound_only: bool = False, plan_by: float = math.inf,
           tolerance: Optional[float] = None, quiet: Optional[float] = None,
           keep_dead: bool = False, exact_cuts: bool = False, chain_reads: bool = False,
           bound_kept: bool = True, prove_by: Optional[float] = None, fake_above: Optional[float] = None,
           progress: Optional[Callable[[str], None]] = None) -> Optional[PartitionResult]:
    """The exact lattice DP (``chain.py``) when the graph splits into small segments, else None.

    Not used with a memory limit (not modelled there). Replication ``none`` on
    exactly K devices counts stages instead of devices (``stage_count.py``).
    Nearly free nodes fold into their producers first
    (``segments.folded_units``); the bound is lowered by what that can cost.
    Where a segment is too large because of a branch computed from the inputs
    alone (an attention mask), the plan comes from the graph with that branch
    as one node and the bound from the graph with it free, its compute still
    counted in the devices of every prefix that must run it (``branches.py``).
    Every candidate plan is scored on ``graph``; a tied weight's real sync
    gets its plans re-searched (``retie.py``). ``floor``, ``ceiling``: a bound
    on the optimum and a plan's time known already (``chain.solve``), or any time no lower than the
    optimum of the model searched (a two-level plan's placed time, for the models that relax the
    machine); ``plain``: no second search, neither for plans that pay for dead nodes or a mask nor
    ``retie``'s (``_bracketed`` before the charged DP, where time is short and the plans are scored
    placed); ``machine``: with ``opts`` the flat model at B1 of that
    two-level machine, the DP floors each stage's all-reduce at the nodes it must touch
    (``node_floor.py``: a higher bound under PipeDream's charges), and plans are scored on that machine
    (a plan's time under ``opts`` may lie below this bound, so it could not cap it); ``settle_by``: past
    this time the bisection stops once it holds a plan (``chain.solve``; the placed DP only while its
    plans score far above their T, ``placed.SETTLE_ABOVE``, and then its search that keeps the reads'
    compute is given a share of the time and the best plan as its ceiling, for ``driver._resumed``);
    ``bound_only``: cut off
    before any plan, answer the bound proven so far with no plan (status ``BOUND``) rather than None;
    ``plan_by``: the placed DP stops there if it holds no plan yet (``chain.solve``); ``tolerance``: where
    the bisection stops, if not each DP's own (a bound wanted before the charged DP stops sooner);
    ``quiet``: where nodes that send nothing fold, times sum C / K, if not ``segment_dp``'s own;
    ``keep_dead``: their compute (and dead nodes') kept in the units they join, a restriction whose
    plans score as the DP charged them (``folded_units``): for a search that wants plans, not a bound.
    ``exact_cuts``: the placed DP keeps the previous stage's replica count in its state (``pow2``;
    ``charged.ChargedChainSolver``), so every cut is charged as the plan's ranks pay it.
    ``chain_reads``: the placed DPs' folded shape reads of one unit chained in the order they are needed,
    so a cut gives up at most one of them (``read_chains.py``; where a chain is worth more than
    ``CHAIN_ABOVE`` of sum C / K): a higher bound, and plans that run each read where the DP charged it,
    for a lattice about twice as large.
    ``bound_kept``: False for a caller that drops the bound (``driver._flat_wide`` scores the plan on a
    two-level machine, where the flat bound does not hold): the wide path then spends no time on
    ``early_bound`` (on nodes of 8 it made the 24-layer Llama's 64- and 256-device plans 0.25 and 0.16 % slower).
    ``prove_by``: a time after ``deadline`` until which the pass 1 % under ``ceiling`` (on the wide path,
    ``finer_bound``'s under the best plan) may run (the caller's time for what follows,
    ``driver.partition``'s polish): that one pass decides whether the plan is proven within 1 %, and on
    the 96-layer Llama it takes 2.2-4.4 s (by the hour) of the 3.8-3.9 s the plans left it, so a slower
    hour cut it off (1,024 devices: 3.4 % open instead of 0.99 %). Past ``deadline`` it goes on only at a
    pace that ends by ``prove_by`` (``memory_guard.pass_deadline``).
    ``progress``: called with a line for each plan and bound of the wide path (its searches take seconds).
    Under PipeDream's charges on a two-level machine (not ``plain``) the charged DP's bisection may
    stop early for the search that keeps the folded nodes' compute (``_settle_near``).
    ``fake_above``: the placed DPs' bisection under ``ceiling`` gives up once it can no longer prove that
    plan within 1 % and its plans score this far above their T (``chain.solve``).
    """
    if opts.memory is not None:
        return None
    cones: List[branches.Cone] = []
    wide_path = opts.replication != "none" and opts.gpus_per_node is None
    searching = wide_path and not plain and not bound_only and machine is None  # for plans, flat: the wide path
    # each layer's read of the rotary tables, in its layer (``anchors.exits``); where there are such reads the
    # table crosses every cut between the layers, so the graph as it is has no separator there and its
    # segments never build: that search is skipped (it took 0.1-0.45 s to fail on the 96-layer Llama)
    exits: List[anchors.Exit] = anchors.exits(graph, opts) if searching else []
    found = None if exits else searched(graph, opts, deadline, cones, keep_dead, floor=floor, ceiling=ceiling,
                                        machine=machine, settle_by=settle_by, bound_only=bound_only,
                                        plan_by=plan_by, tolerance=tolerance, quiet=quiet, exact_cuts=exact_cuts,
                                        chain_reads=chain_reads, settle_near=_settle_near(opts, plain, machine),
                                        fake_above=fake_above, prove_by=-math.inf if prove_by is None else prove_by)
    early: Optional[float] = None  # the wide path's bound under its first plan (``early_bound``)
    wide: list = []  # the searches on narrowed and paired (and chained and merged, where the bound is dropped)
    # wide segments (``wide_segments.py``) that answered, the first being ``found``: restrictions, no bound of their own
    plan_graph = graph  # where plans are searched: ``graph``, or a restriction of it (``anchors.anchored``)
    if found is None and wide_path:
        # on a deep graph searched for plans (not a bracket, ``plain``), the rotary tables' reads too
        deep = searching and (bool(exits) or is_deep(graph, opts))
        plan_graph = anchors.anchored(graph, exits)
        cones = branches.input_only_cones(plan_graph, opts)  # an attention mask beside the embeddings
        found = searched(plan_graph, opts, deadline, cones, keep_dead=True) if cones or exits else None
        if found is None and deep:  # a block too wide for its lattice (Llama's attention): its weighted
            # units with the rest folded into them, two chains (the heaviest path and the rest), or (where the
            # bound is dropped) one chain or the block whole (``wide_segments.py``); after the first, the
            # relaxation's bound under its plan (``early_bound``), the others then improve the plan (the
            # order: ``WIDE_SEARCHES``, ``WIDE_UNBOUNDED``)
            reserve = _scoring_reserve(graph, opts)
            deadline -= reserve
            prove_by = deadline if prove_by is None else max(deadline, prove_by - reserve)
            for widen in WIDE_SEARCHES if bound_kept else WIDE_UNBOUNDED:
                # where the bound is kept, the second search bisects between the relaxation's bound and the
                # first plan (``chain.solve``'s bracket; no plan where none is faster): on the 96-layer Llama
                # the paired search took 1.6 s instead of 3.1 on 256 devices, time ``finer_bound`` then had
                # (where the bound is dropped the plans are scored on a two-level machine: a slower flat plan
                # may win there, so those searches stay whole)
                near = dict(floor=early or 0.0, ceiling=wide[0][1].objective) if wide and bound_kept else {}
                f = searched(plan_graph, opts, deadline, cones, keep_dead=True, widen=widen, **near)
                wide += [f] if f is not None else []
                if f is not None and f[0] is not None:
                    said(progress, start, f"{widen.__name__} blocks: plan {f[1].objective * 1e3:.4g} ms")
                if bound_kept and early is None and f is not None and f[0] is not None:
                    early = early_bound(graph, opts, deadline, cones, exits, f[0])  # under the first plan
                    if early is not None:
                        said(progress, start, f"bound {early * 1e3:.4g} ms (the blocks' weightless nodes free)")
            found = wide[0] if wide else None
    if found is None:
        return None
    plan, solution, margin, size = found
    if plan is None:  # ``ceiling``/``bound_only``: no (faster) plan within the time, only a bound
        return PartitionResult(assignment={}, replicas=[], stages=[], bottleneck_s=math.inf, options=opts,
                               status="BOUND", objective_s=math.inf, bound_s=max(0.0, solution.bound - margin),
                               wall_s=time.monotonic() - start, units=size, method="segment DP")
    plans, bound = [plan] + [f[0] for f in wide[1:] if f[0] is not None], solution.bound - margin
    if cones or exits or wide:  # the plan came from a restriction: the bound from the relaxation (branches.py,
        # anchors.py, wide_segments.py)
        bound = 0.0  # cut off by the deadline: the plan stands, bounded by sum C / K below
        # where the wide path has the relaxation's bound already (``early_bound``), not again: on every
        # 24-layer Llama row its bound came out no higher and its plan 2-3x slower (on 96 layers it was cut off)
        lower = relaxation(graph, opts, deadline, cones, exits, bool(wide)) if early is None else None
        if lower is not None:
            plans.append(lower[0])
            unfolded = searched(plan_graph, opts, deadline, cones)  # dead nodes folded as the bound folds them
            # (no plan where the segments are wide: the narrowed search above stands for it)
            plans += [unfolded[0]] if unfolded else []
            bound = lower[1]
        bound = max(bound, early or 0.0)
    ideal = ideal_s(graph, opts)
    floor_s = floors(graph, opts, machine)
    judge = machine or opts  # plans are scored where the bound holds
    scored = [(evaluate(graph, a, reps, judge), a, reps) for a, reps in plans]
    masks: List[branches.Cone] = []
    if not cones and not exits and not plain and min(e.bottleneck_s for e, _, _ in scored) > max(bound, floor_s) * (1 + OPTIMAL_GAP):
        # plans that pay for dead nodes, and for a cheap input-only value read by many stages (an
        # attention mask folded away like an input, whose bytes then cross every boundary unseen)
        masks = branches.input_only_cones(graph, opts) if opts.gpus_per_node is None else []
        flat = machine is None and opts.gpus_per_node is None
        exact = _exact(graph, opts, deadline, scored, max(bound, floor_s), ideal, judge) if flat else None
        if exact is not None:  # its plans include those of the search that charges dead nodes
            bound = max(bound, exact)
        proven = min(e.bottleneck_s for e, _, _ in scored) <= max(bound, floor_s) * (1 + OPTIMAL_GAP)
        masks = [] if proven else masks
        # on a two-level machine the dropped nodes' compute kept where folding put them: plans as they
        # score, searched between the bound and the best plan (the placed DPs' plans may split a node
        # from its readers where the DP charged it nowhere, ``Units.bridged``)
        near = {} if flat else dict(floor=max(bound, floor_s), quiet=quiet)
        # a caller that settled the bisection early (``driver._resumed``) wants time left after this search,
        # which then bisects under the best plan rather than climbing from the bound
        settled = not flat and settle_by < math.inf
        until = time.monotonic() + RESTRICT_SHARE * (deadline - time.monotonic()) if settled else deadline
        if settled:
            near["ceiling"] = min(e.bottleneck_s for e, _, _ in scored)
        for again in (searched(graph, opts, until, c, keep_dead=True, **near)
                      for c in ([] if exact is not None else [[]]) + ([masks] if masks else [])):
            scored += [(evaluate(graph, *again[0], judge), *again[0])] if again and again[0] else []
        # the folding above placed those branches like model inputs, so the bound forgot their compute:
        # the relaxation that counts it in every prefix that must run it bounds the same plans higher
        lower = relaxation(graph, opts, deadline, masks) if masks else None
        if lower is not None:
            scored.append((evaluate(graph, *lower[0], judge), *lower[0]))
            bound = max(bound, lower[1])
    loose, silent = loose_groups(graph, opts), silent_nodes(graph, opts)
    finish = lambda e, a, reps: finished(graph, loose, a, reps, e, judge, silent)  # noqa: E731
    scored = [finish(e, a, reps) for e, a, reps in scored]
    if wide and bound_kept:  # before the block whole and the mask in pieces: without them every 24- and
        # 96-layer Llama row kept its plan at 10 s, and they took the 3-4 s a pass of this bound needs
        bound = _finer(graph, opts, deadline, cones, exits, max(bound, floor_s), scored, prove_by,
                       lambda line: said(progress, start, line))
        scored += [finish(evaluate(graph, *p, judge), *p) for p in _merged_plan(plan_graph, opts, deadline, cones)]
    if cones or masks:
        _in_pieces(graph, plan_graph if cones else graph, opts, deadline, cones or masks, scored,
                   max(bound, floor_s), judge, finish, wide_segments.narrowed if wide else None)
    ev, assignment, replicas = min(scored, key=lambda x: x[0].bottleneck_s)
    bound = max(bound, floor_s)
    if machine is None and opts.gpus_per_node is None and not plain and tied_weights(graph, assignment):
        better = retie.recharged(graph, opts, ev.bottleneck_s, ev.stages,
                                 lambda heavier: (searched(anchors.anchored(heavier, exits), opts, deadline, cones, True,
                                                           settle_by=settle_by) or [None])[0],
                                 bound * (1 + OPTIMAL_GAP), deadline)
        if better is not None:
            (assignment, replicas), ev = better
    result = PartitionResult(assignment=assignment, replicas=list(replicas), stages=ev.stages,
                             bottleneck_s=ev.bottleneck_s, options=opts, status="FEASIBLE",
                             objective_s=solution.objective, bound_s=min(bound, ev.bottleneck_s),
                             wall_s=time.monotonic() - start, units=size, method="segment DP")
    result.status = "OPTIMAL" if result.gap <= OPTIMAL_GAP else "FEASIBLE"
    return result


def _settle_near(opts: CostOptions, plain: bool, machine: Optional[CostOptions]) -> Optional[Tuple[float, float]]:
    """Where the charged DP's bisection may stop early (``chain.solve``'s ``settle_near``): under
    PipeDream's charges on a two-level machine, where the search that keeps the folded nodes' compute
    follows it (not ``plain``). There the relaxed plans score above their T by the compute folding
    left out of the units, which that search charges: 32 H100-profiled blocks on 128 devices found
    plans at 1.016-1.02 T, and that search 0.5881 ms where the last two bisection passes (1.5 s) would
    only have raised the bound 0.18 %. Where plans score further above T (1.08 T on 256 devices, folded
    reads on one-replica stages) that search found nothing better than the plan in hand, and the bound
    needed its last passes: the bisection goes on."""
    if plain or machine is not None or opts.gpus_per_node is None or opts.cost_model != "pipedream":
        return None
    return placed.SETTLE_WITHIN, placed.SETTLE_NEAR


def said(progress: Optional[Callable[[str], None]], start: float, line: str, search: str = "segment DP") -> None:
    """``line`` to ``progress`` (if given) as the planner's progress line of ``search``, with the seconds since
    ``start`` (``driver._placed_chain``'s phases too)."""
    if progress is not None:
        progress(f"partition: {search}, {time.monotonic() - start:.1f} s: {line}")


def _merged_plan(plan_graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"]) -> list:
    """The plan (in a list; empty if none in time) of the search with every wide segment one unit
    (``wide_segments.merged``): on a first profile of the 24-layer HF Llama the fastest on 512 devices,
    on the bundled one it won no row."""
    found = searched(plan_graph, opts, deadline, cones, keep_dead=True, widen=wide_segments.merged)
    return [found[0]] if found is not None and found[0] is not None else []


def _finer(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"],
           exits: Sequence[anchors.Exit], bound: float, scored: list, prove_by: float,
           say: Callable[[str], None] = lambda line: None) -> float:
    """``finer_bound`` under the best plan in ``scored`` where that is not proven within ``bound`` and
    ``FINER_AFTER`` seconds are left (its first pass may then run until ``prove_by``, the rest until
    ``deadline``); else (or cut off before its first pass) ``bound``. ``say``: a progress line as it starts
    and, where it raised the bound, one with the gap."""
    best = min(e.bottleneck_s for e, _, _ in scored)
    if best <= bound * (1 + OPTIMAL_GAP) or deadline - time.monotonic() <= FINER_AFTER:
        return bound
    say(f"bound with the blocks whole, a pass of seconds 1 % under {best * 1e3:.4g} ms first, then bisecting "
        "until the limit")
    finer = finer_bound(graph, opts, deadline, cones, exits, bound, best, prove_by)
    if finer is None or finer <= bound:
        return bound
    say(f"bound {finer * 1e3:.4g} ms (the blocks whole), {best * 1e3:.4g} ms planned, "
        f"gap {100 * (1 - finer / best):.2f} %")
    return finer


def _scoring_reserve(graph: CostGraph, opts: CostOptions) -> float:
    """Seconds the wide path keeps back for what follows its searches: scoring and finishing its
    plans (``finished``, several evaluations each) and the driver's uniform layouts (two a divisor of
    K), ``SCORING_EVALUATIONS`` times one evaluation of the graph. On a 96-layer HF Llama (6,000 nodes,
    0.02-0.04 s an evaluation) they took 1.4 s past the search's deadline at 1,024 devices."""
    t = time.monotonic()
    evaluate(graph, {n: 0 for n in graph.nodes}, [opts.devices], opts)
    return SCORING_EVALUATIONS * (time.monotonic() - t)


def is_deep(graph: CostGraph, opts: CostOptions) -> bool:
    """Whether ``graph`` takes the wide path: more than ``DEEP`` nodes to place (see there), or, at any
    size, layers that read a table made from the inputs alone (``anchors.exits``: a Llama's rotary
    tables). A Llama of 2-8 layers (175-528 nodes) went to CP-SAT on every node and came back 2.3-14.5 %
    open on 8-64 devices at 10 s (its plans mostly optimal, its bound weak); this path proves the same
    plans, or faster ones (``anchors.exits`` takes a few milliseconds; layer 0's reads are no exit, so a
    1-layer Llama stays with CP-SAT)."""
    return len(model_nodes(graph, opts)) > DEEP or bool(anchors.exits(graph, opts))


def _exact(graph: CostGraph, opts: CostOptions, deadline: float, scored: list, bound: float, ideal: float,
           judge: CostOptions) -> Optional[float]:
    """Where the plans in ``scored`` are not proven: ``wide_blocks.exact_plan`` (nothing dropped), its
    plan added to ``scored``; the bound it proves, or None (in time, proven, or cut off)."""
    best = min(e.bottleneck_s for e, _, _ in scored)
    if best <= max(bound, ideal) * (1 + OPTIMAL_GAP):
        return None
    exact = wide_blocks.exact_plan(graph, opts, deadline, max(bound, ideal), best, tiny_input(opts, ideal))
    if exact is None:
        return None
    assignment, reps, proven = exact
    scored += [(evaluate(graph, assignment, reps, judge), assignment, reps)] if reps else []
    return proven


def _in_pieces(graph: CostGraph, plan_graph: CostGraph, opts: CostOptions, deadline: float,
               cones: List["branches.Cone"], scored: list, bound: float, judge: CostOptions, finish: Callable,
               widen: Optional[Callable[[Units], Optional[Units]]] = None) -> None:
    """Where the plans in ``scored`` are not proven, more: each cone in ``CONE_PIECES`` pieces (the DP may
    then run its first pieces in stages before the exit's), searched on ``plan_graph`` (``graph`` or its
    restriction), scored on ``graph`` and added to ``scored``, until one proves. Only then: their
    lattices are several times the one-piece one. ``finish``: (evaluation, plan, replicas) to the entry
    ``scored`` holds (``loose_ends``); ``widen``: as ``segment_dp``'s."""
    for pieces in CONE_PIECES:
        if min(e.bottleneck_s for e, _, _ in scored) <= bound * (1 + OPTIMAL_GAP):
            return
        again = searched(plan_graph, opts, deadline, cones, keep_dead=True, pieces=pieces, widen=widen)
        if again is not None and again[0] is not None:
            scored.append(finish(evaluate(graph, *again[0], judge), *again[0]))


def tiny_input(opts: CostOptions, ideal: float) -> float:
    """Compute up to which a weightless node of the inputs alone is left out like an input (fxpipe's
    model, where every rank loads the inputs; PipeDream's puts them in stage 0)."""
    return 0.02 * ideal if opts.cost_model == "fxpipe" else -1.0


def floors(graph: CostGraph, opts: CostOptions, machine: Optional[CostOptions] = None) -> float:
    """The closed-form bounds: sum C / K, the all-reduce that replicated weights cannot avoid
    (``work_floor.py``) and, where a weight is tied between two nodes, the least their stages can take
    (``tie_floor.py``; on the flat model the plans are scored on: with ``machine`` they are not)."""
    return max(ideal_s(graph, opts), tie_floor(graph, opts) if machine is None else 0.0, work_floor(graph, opts))


def early_bound(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"],
                exits: Sequence[anchors.Exit], plan: Tuple[Dict[str, int], List[int]]) -> Optional[float]:
    """``relaxation``'s bound (the wide segments' weightless nodes free) searched between the floors
    (``floors``) and ``plan``'s time, for the wide path to run after its first
    plan rather than after all four: on a deep graph those searches take the whole limit and the
    relaxation came too late to run (96-layer HF Llama, 10 s, 64 devices: narrowed, merged and chained
    searches 3.3, 2.3 and 2 s, the relaxation cut off, 2.56 % open; bracketed it takes 3.2 s there and
    bounds the first plan within 0.28 %); once the relaxation runs 1 % under the plan, its next pass sits
    ``EARLY_TOLERANCE`` above the floors and its bisection stops at that tolerance (``chain.solve``'s
    ``loose``). None where the plan lies within ``OPTIMAL_GAP`` of a floor (proven already)
    or the relaxation cannot run (past the deadline, or a lattice still too wide); cut off, the floor or
    what its passes proved."""
    floor = floors(graph, opts)
    ceiling = evaluate(graph, plan[0], plan[1], opts).bottleneck_s
    if ceiling <= floor * (1 + OPTIMAL_GAP):
        return None  # proven already
    lower = _relaxed_dp(graph, opts, deadline, cones, exits, wide_segments.NARROW, floor=floor, ceiling=ceiling,
                        bound_only=True, floor_counts=True, loose=EARLY_TOLERANCE)
    return None if lower is None else lower[1].bound - lower[2]


def relaxation(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"],
               exits: Sequence[anchors.Exit] = (), wide: bool = False):
    """(plan, bound) from the segment DP on the graph with every cone node but its exit free, every
    anchored exit free in its anchor's stage and, with ``wide``, the weightless nodes of segments too
    wide for their lattice free, their compute still counted in the devices of each prefix that must
    run it (``branches.py``, ``anchors.py``, ``wide_segments.relaxed``); None if cut off by the
    deadline or a lattice is still too wide. Any plan of ``graph`` maps to a plan there no slower, so
    the bound holds."""
    lower = _relaxed_dp(graph, opts, deadline, cones, exits, wide_segments.NARROW if wide else None)
    if lower is None:
        return None
    units, found, margin = lower
    return (to_nodes(graph, units, found.stage_of), found.replicas), found.bound - margin


def finer_bound(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"],
                exits: Sequence[anchors.Exit], floor: float, ceiling: float,
                prove_by: float = -math.inf) -> Optional[float]:
    """A bound from ``relaxation``'s graph with the wide segments' weightless nodes kept where their
    lattice has at most ``segments.MAX_DOWNSETS`` downsets, and past it only the side chains freed that
    bring it to ``SHRINK_TO`` (``side_chains.shrunk``; a segment past ``side_chains.COUNT_CAP`` times
    the limit, as the Llama's first one, freed whole), searched between
    ``floor`` (a bound already proven) and ``ceiling`` (the best plan's time), its first pass
    ``chain.PROVE_WITHIN`` under the plan, which may run until ``prove_by`` where that is later than
    ``deadline``; cut off, the highest T its passes proved infeasible (``floor``
    if none); None where the deadline passed before it began or a lattice is still too wide.

    ``relaxation`` frees every weightless node of a segment over ``wide_segments.NARROW`` downsets, and
    that compute, a fifth of a Llama's, fills the slack of any stage: its bound stays near sum C / K.
    Kept, it runs only where a plan can run it. On the 24-layer HF Llama the attention blocks then
    have 3,220 downsets and 1.15 million stage pairs each (the first segment, with the embedding and
    the rotary tables, 27,228 downsets: freed); a DP pass, on replica counts from below
    (``floor_counts``), takes 0.5-1.5 s on 24 layers and 2.2-3.8 s on 96 here, so this runs with the
    time the plans leave (``chain_plan``: right after the narrowed and paired searches,
    ``FINER_AFTER``), often one pass. One infeasible pass 1 % under the plan proves the plan within
    1 %: on the 96-layer Llama this bound lies 0.3-0.6 % under the plans (128-512 devices, run to its
    end), and at 10 s 256-1,024 devices went from 1.6-1.7 % open to 0.95-0.99 %. On the 24-layer one
    it lies 2.1-2.8 % under the plans on 256 and 512 devices (and lay 1.0 % under on 32 before the
    polish split stages there), where that pass is feasible and proves nothing;
    a first pass between bound and plan instead (until this release) left those rows within 0.01 %
    of the same gaps (docs/results.md)."""
    lower = _relaxed_dp(graph, opts, deadline, cones, exits, MAX_DOWNSETS, floor=floor, ceiling=ceiling,
                        bound_only=True, exact_wide=True, floor_counts=True, prove_by=prove_by, descend=True,
                        shrink_to=min(SHRINK_TO, MAX_DOWNSETS // 2))  # under the limit where that is set low
    if lower is None:
        return None
    _, found, margin = lower
    return found.bound - margin


def bracketed(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"], floor: float,
              ceiling: float, tolerance: float):
    """``segment_dp``'s answer on ``relaxation``'s graph (no anchored reads, no wide segments freed) searched
    between a bound (``floor``) and a plan's time (``ceiling``), its first pass ``chain.PROVE_WITHIN`` under
    the plan, the bisection stopping at ``tolerance``: for a caller that searches many restrictions of one
    problem against its best plan (``stash_counts.py``, one per common count of the tied stages)."""
    return _relaxed_dp(graph, opts, deadline, cones, (), None, floor=floor, ceiling=ceiling, tolerance=tolerance)


def proven_above(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"],
                 T: float) -> Optional[float]:
    """One pass of ``bracketed``'s relaxation at T: where no plan meets T, T less what folding may cost
    (a bound); None where one does, or past the deadline. For a caller that settles many restrictions
    with one pass (``stash_counts.py``: a range of counts)."""
    # ``chain.solve``'s first pass sits PROVE_WITHIN under the ceiling, at T; it stops after it, failed (the
    # bracket is then within its tolerance) or with a plan (``settle_by``); its bound reaches T only if it failed
    lower = _relaxed_dp(graph, opts, deadline, cones, (), None, floor=T / (1 + PROVE_WITHIN),
                        ceiling=T * (1 + PROVE_WITHIN), tolerance=PROVE_WITHIN * (1 + 1e-6), settle_by=-math.inf)
    if lower is None:
        return None
    _, found, margin = lower
    return T - margin if found.stage_of is None and found.bound >= T * (1 - 1e-12) else None


def _relaxed_dp(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"],
                exits: Sequence[anchors.Exit], limit: Optional[int], shrink_to: Optional[int] = None, **search):
    """``segment_dp``'s answer (``search``: its options) on ``graph`` with every cone node but its exit
    free, every anchored exit free in its anchor's stage and, where ``limit`` is given, the weightless
    nodes of segments of more than ``limit`` downsets free (none where no segment has that many), their
    compute given the units as ``Units.hidden``: the relaxation ``relaxation`` and ``finer_bound``
    search, at two limits; with ``shrink_to`` (``finer_bound``) only the side chains that bring each
    such segment to that many downsets are freed (``side_chains.shrunk``). The values made silent that
    every plan still sends are charged where it must (``freed_sends.py``)."""
    held = anchors.relaxed(graph, list(exits))
    loose = branches.relaxed(held, cones)
    if limit is None:
        widened = None
    elif shrink_to is not None:  # only the side chains that make a segment wide (``side_chains.py``)
        widened = side_chains.shrunk(loose, opts, limit, shrink_to, deadline)
    else:
        widened = wide_segments.relaxed(loose, opts, limit=limit, deadline=deadline)
    relaxed_graph, freed = widened if widened is not None else (loose, [])
    exit_nodes = [e for e, _ in exits]

    def sends(units: Units):
        seen = lookups(relaxed_graph, units)
        return freed_sends(graph, relaxed_graph, units, exit_nodes, opts, seen) \
            + chain_sends(graph, relaxed_graph, units, freed, exit_nodes, seen)

    return segment_dp(relaxed_graph, opts, deadline,
                      hidden=lambda units: branches.hidden_compute(held, units, cones)
                      + anchors.hidden_compute(graph, units, list(exits))
                      + branches.forced_compute(loose, units, freed),
                      sends=sends, **search)


def loose_groups(graph: CostGraph, opts: CostOptions) -> Tuple[Dict[str, str], Dict[str, float]]:
    """Weightless nodes computed from model inputs alone whose results nobody uses (export's guard
    checks, an unused arange), each mapped to the first node of its connected group, and each
    group's compute; none on a two-level machine, whose placed plans ``loose_ends`` leaves alone."""
    if opts.gpus_per_node is not None:
        return {}, {}
    succ, pred = graph.successors(), graph.predecessors()
    names = model_nodes(graph, opts)
    dead: set = set()
    for n in reversed(names):
        node = graph.nodes[n]
        if node.op != "output" and not node.params and node.param_bytes == 0 and not node.is_input \
                and all(v in dead for v in succ[n]):
            dead.add(n)
    loose: Dict[str, str] = {}  # node -> the first node of its group
    for n in names:
        if n in dead and all(graph.nodes[p].is_input or p in loose for p in pred[n]):
            roots = {loose[p] for p in pred[n] if p in loose}
            loose[n] = min(roots, key=names.index) if roots else n
            for other, root in loose.items():
                if root in roots:
                    loose[other] = loose[n]
    groups: Dict[str, float] = {}
    for n, root in loose.items():
        groups[root] = groups.get(root, 0.0) + graph.nodes[n].compute_s
    return loose, groups


def loose_ends(graph: CostGraph, found: Tuple[Dict[str, str], Dict[str, float]], assignment: Dict[str, int],
                replicas: List[int], ev, opts: CostOptions):
    """The loose groups of ``loose_groups`` where they slow a stage least: the DP leaves them out
    (``folded_units``), and any stage may run them."""
    loose, groups = found
    if not any(groups.values()):
        return ev, assignment
    times = [s.time_s for s in ev.stages]  # taken out where they were; each group adds compute / r
    for n in loose:
        times[assignment[n]] -= graph.nodes[n].compute_s / ev.stages[assignment[n]].replicas
    moved, where = dict(assignment), {}
    for root in sorted(groups, key=lambda r: -groups[r]):
        where[root] = min(range(len(times)), key=lambda s: times[s] + groups[root] / replicas[s])
        times[where[root]] += groups[root] / replicas[where[root]]
    moved.update({n: where[root] for n, root in loose.items()})
    again = evaluate(graph, moved, replicas, opts)
    return (again, moved) if again.bottleneck_s < ev.bottleneck_s else (ev, assignment)


Silent = Tuple[List[str], List[str], Dict[str, List[str]], Dict[str, List[str]]]  # ``silent_nodes``


def silent_nodes(graph: CostGraph, opts: CostOptions, names: Optional[List[str]] = None) -> Silent:
    """The placed nodes (``names``, default every model node), those of them ``silent_moves`` may move
    (in graph order), and the graph's successors and predecessors: the same for every plan that places
    every node, so a caller scoring several plans works them out once (a 64-stage plan of the 96-layer HF
    Llama: its ``weight_only`` and adjacency took 10-30 ms of the 35-57 ms its finishing took)."""
    names = model_nodes(graph, opts) if names is None else names
    derived = weight_only(graph, names)
    silent = [n for n in names if graph.nodes[n].out_bytes == 0 and not graph.nodes[n].params
              and graph.nodes[n].param_bytes == 0 and graph.nodes[n].compute_s > 0
              and graph.nodes[n].op != "output" and not graph.nodes[n].is_input or n in derived]
    return names, silent, graph.successors(), graph.predecessors()


def finished(graph: CostGraph, loose, assignment: Dict[str, int], replicas: List[int], ev, opts: CostOptions,
             silent: Optional[Silent] = None):
    """(evaluation, assignment, replicas) of a plan with its loose groups and silent nodes placed where
    they slow it least (``loose_ends``, ``silent_moves``; ``silent``: ``silent_nodes``, if known)."""
    ev, assignment = loose_ends(graph, loose, assignment, replicas, ev, opts)
    ev, assignment = silent_moves(graph, assignment, replicas, ev, opts, silent)
    return ev, assignment, replicas


def silent_moves(graph: CostGraph, assignment: Dict[str, int], replicas: List[int], ev, opts: CostOptions,
                 silent: Optional[Silent] = None):
    """Nodes that send nothing (shape reads) and the nodes of weight-only chains moved, each to the
    stage between its producers' and its readers' where it slows the plan least, the better of that
    and ``assignment`` kept (with ``ev``).

    Folding puts such a node with a producer, and the placed DPs charge it only to a stage that holds
    a unit before it and one after it (``Units.bridged``): a plan that separates the two may run it
    in any stage in between, and the one with room costs nothing. A weight-only chain
    (``segments.weight_only``) is left out of the units, and the flat DP lets its compute fill the
    room of any stage up to its reader's (``chain.ChainSolver._late``), but ``to_nodes`` puts it with
    the reader (Gemma, 24 layers, 64 devices: the plan 0.9629 ms so, 0.9450 with the chains moved).
    ``silent``: ``silent_nodes(graph, opts)``, worked out here if not given."""
    if silent is None or not all(n in assignment for n in silent[0]):  # a plan that leaves nodes out
        silent = silent_nodes(graph, opts, [n for n in model_nodes(graph, opts) if n in assignment])
    _, silent, succ, pred = silent
    if not silent:
        return ev, assignment
    times = [st.time_s for st in ev.stages]
    moved = dict(assignment)
    for n in silent:  # in graph order: a node's producers have their final stages
        lo = max((moved[p] for p in pred[n] if p in moved), default=0)
        hi = min((moved[c] for c in succ[n] if c in moved), default=len(replicas) - 1)
        if hi <= lo:
            continue
        c, now = graph.nodes[n].compute_s, moved[n]
        times[now] -= c / replicas[now]
        best = min(range(lo, hi + 1), key=lambda st: (times[st] + c / replicas[st], st != now))
        times[best] += c / replicas[best]
        moved[n] = best
    if moved == assignment:
        return ev, assignment
    again = evaluate(graph, moved, replicas, opts)
    return (again, moved) if again.bottleneck_s < ev.bottleneck_s else (ev, assignment)


def searched(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"],
              keep_dead: bool = False, floor: float = 0.0, ceiling: float = math.inf,
              machine: Optional[CostOptions] = None, settle_by: float = math.inf, bound_only: bool = False,
              plan_by: float = math.inf, tolerance: Optional[float] = None, quiet: Optional[float] = None,
              pieces: int = 1, exact_cuts: bool = False, chain_reads: bool = False,
              widen: Optional[Callable[[Units], Optional[Units]]] = None,
              settle_near: Optional[Tuple[float, float]] = None, fake_above: Optional[float] = None,
              prove_by: float = -math.inf):
    """(plan on ``graph``'s nodes, the chain DP's answer, fold margin, units) from the segment DP on
    ``graph`` with each cone as ``pieces`` nodes in a chain (``branches.contracted``), or None."""
    merged = branches.contracted(graph, cones, pieces) if cones else graph
    solved = segment_dp(merged, opts, deadline, keep_dead, floor=floor, ceiling=ceiling, machine=machine,
                        settle_by=settle_by, bound_only=bound_only, plan_by=plan_by, tolerance=tolerance,
                        quiet=quiet, exact_cuts=exact_cuts, chain_reads=chain_reads, widen=widen,
                        settle_near=settle_near, fake_above=fake_above, prove_by=prove_by)
    if solved is None:
        return None
    units, found, margin = solved
    if found.stage_of is None:  # a bound and no plan (``ceiling``: the caller's plan stands)
        return None, found, margin, len(units)
    assignment = branches.expand(to_nodes(merged, units, found.stage_of), cones, pieces, graph)
    return (assignment, found.replicas), found, margin, len(units)


def _charge_left_out(units) -> None:
    """``Units.hidden`` added to the compute of the unit that runs it (a restriction, for searches
    whose plans must score as charged): a folded node's with the unit it joined, one left out like an
    input with the first unit that reads it, where ``to_nodes`` places it when that unit's stage is
    the earliest of its readers' (nodes such as an input's shape reads and ``arange``: on the
    H100-profiled GPT 34 us a plan's first stage ran that its search had not charged)."""
    for seconds, forcing, home, _ in units.hidden:
        at = home if home >= 0 else min(forcing, default=-1)
        if at >= 0:
            units.compute[at] += seconds
            units.has_compute[at] = units.has_compute[at] or seconds > 0


def segment_dp(graph: CostGraph, opts: CostOptions, deadline: float, keep_dead: bool = False,
                hidden: Optional[Callable[[Units], List[Hidden]]] = None, floor: float = 0.0,
                ceiling: float = math.inf, machine: Optional[CostOptions] = None, settle_by: float = math.inf,
                bound_only: bool = False, plan_by: float = math.inf, tolerance: Optional[float] = None,
                quiet: Optional[float] = None, exact_cuts: bool = False, chain_reads: bool = False,
                widen: Optional[Callable[[Units], Optional[Units]]] = None, exact_wide: bool = False,
                floor_counts: bool = False, loose: Optional[float] = None, prove_by: float = -math.inf,
                descend: bool = False, settle_near: Optional[Tuple[float, float]] = None,
                fake_above: Optional[float] = None,
                sends: Optional[Callable[[Units], List[Tuple[int, List[int], List[int], List[int]]]]] = None):
    """(units, the chain DP's answer, what folding may cost the bound) or None (see ``chain_plan``);
    ``widen``: on the flat model, where a segment's lattice is over the limit, the units it makes of
    them instead (``wide_segments.narrowed``, ``merged`` or ``chained``, restrictions: the answer's bound
    is then none);
    ``exact_wide``: search segments over ``wide_segments.LIMIT`` downsets as they are (``finer_bound``);
    ``floor_counts``: the flat DP counts replicas from below (``chain.ChainSolver``), for a search whose
    bound alone is kept (its plans need not meet the T of their pass);
    ``loose``: the flat DP's tolerance once a pass runs 1 % under ``ceiling`` (``chain.solve``);
    ``prove_by``: the flat DP's pass 1 % under ``ceiling`` may run until then (``chain.solve``);
    ``descend``: after that pass finds a plan, the flat DP's next passes step down from it (``chain.solve``);
    ``settle_near``: where the placed DPs' bisection stops early for the search that follows (``chain.solve``);
    ``fake_above``: where the placed DPs' bisection under a ceiling gives up (``chain.solve``);
    ``hidden``: the compute a relaxation took off the units, given them (``Units.hidden``); ``sends``: the
    values it made silent that every plan still sends, given them where the DP keeps ``Units.hidden_sends``
    (``freed_sends.py``); ``tolerance``:
    where the placed and node-floor DPs' bisection stops, if not their own. None at
    once past the deadline: folding and segmenting alone take a good part of a second on a deep graph.
    Nodes that send nothing fold up to ``QUIET`` of sum C / K, for the placed and node-floor DPs
    whatever they cost (``QUIET_PLACED``; their compute bridged, ``Units.bridged``), or up to ``quiet``
    where given."""
    if past(deadline):
        return None
    ideal = graph.total_compute_s() / opts.devices
    fold = dict(tiny=1e-5 * ideal, tiny_input=tiny_input(opts, ideal))
    placed_dp = opts.gpus_per_node is not None or machine is not None
    quiet = quiet if quiet is not None else QUIET_PLACED if placed_dp else QUIET
    silent = math.inf if quiet == math.inf else quiet * ideal
    units, folded = folded_units(graph, opts, tiny_silent=silent, keep_dead=keep_dead, bridge=placed_dp,
                                chain_above=CHAIN_ABOVE * ideal if chain_reads else None, **fold)
    if past(deadline):  # a search begun just before the deadline went on to build its segments and
        # widen them before its first check: 0.4-0.5 s past it on a 96-layer Llama (1-1.3 s on a slow day)
        return None
    if placed_dp or opts.replication == "none":
        # the placed, node-floor and stage-count DPs do not count the compute folding leaves out of the
        # units (``ChainSolver._late``), so their plans must not be scored with it either; a search for
        # plans (``keep_dead``, a restriction) charges it to the unit whose stage runs it instead
        if keep_dead:
            _charge_left_out(units)
        units.hidden, units.hidden_sends = [], []
    elif sends is not None:
        units.hidden_sends += sends(units)
    if hidden is not None:
        units.hidden += hidden(units)
    segs = build_segments(units, deadline=deadline)
    if widen is not None and (segs is None or wide_segments.too_wide(segs)) and not placed_dp \
            and opts.replication != "none":
        coarse = widen(units) if time.monotonic() <= deadline else None
        segs = build_segments(coarse, deadline=deadline) if coarse is not None else None
        units = coarse if segs is not None else units
    if segs is None or (widen is not None and wide_segments.too_wide(segs)):
        return None
    score = lambda stage_of, reps: unit_bottleneck(units, stage_of, reps, machine or opts)  # noqa: E731
    if opts.replication == "none" and not opts.fewer_devices:
        if not stage_count.applies(opts, units):
            return None
        found = chain_solve(units, segs, opts, deadline, score, stage_count.StageCountSolver(units, segs, opts),
                            bound_only=bound_only)
    elif opts.gpus_per_node is not None:  # placed.supports(opts): the offset within a node joins the state
        found = chain_solve(units, segs, opts, deadline, score, charged.solver_for(units, segs, opts, exact_cuts),
                            tolerance or placed.TOLERANCE, placed.LADDER, placed.PROBE_WITHIN, floor, ceiling,
                            settle_by=settle_by, bound_only=bound_only, plan_by=plan_by,
                            settle_above=placed.SETTLE_ABOVE, settle_near=settle_near, fake_above=fake_above,
                            prove_by=prove_by)
    elif machine is not None:  # the flat model at B1 of ``machine``, all-reduces floored by node count
        # no ladder: its first pass, at twice the bound (1 % under a ceiling, if given), finds a plan
        found = chain_solve(units, segs, opts, deadline, score, node_floor.NodeFloorSolver(units, segs, machine),
                            tolerance or TOLERANCE, floor=floor, ceiling=ceiling, settle_by=settle_by,
                            bound_only=bound_only)
    else:
        first = None
        if wide_blocks.wide(segs) and not bound_only and ceiling == math.inf:
            first = wide_blocks.first_plan(graph, opts, deadline, floor, fold, hidden)
        if first is not None:  # a plan from the narrow lattice, which the exact one proves or beats
            found = chain_solve(units, segs, opts, deadline, score, floor=max(floor, first.bound_s),
                                ceiling=first.real_s, settle_by=settle_by, trust_ceiling=True)
            return wide_blocks.better(graph, opts, first, units, found, fold_margin(units, folded))
        if wide_segments.too_wide(segs) and widen is None and not exact_wide and is_deep(graph, opts):
            return None  # no pass in time, nor a plan to start from: the caller narrows (``wide_segments``)
        solver = ChainSolver(units, segs, opts, floor_counts=True) if floor_counts else None
        found = chain_solve(units, segs, opts, deadline, score, solver, tolerance=tolerance or TOLERANCE, floor=floor,
                            ceiling=ceiling, settle_by=settle_by, bound_only=bound_only, loose=loose,
                            prove_by=prove_by, descend=descend)
    if found is None:
        return None
    return units, found, fold_margin(units, folded)
