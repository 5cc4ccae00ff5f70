"""``partition(graph, devices, **options)``: segment DP, else downset DP or CP-SAT; map back, score.

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
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple


from passes.costgraph import CostGraph
from passes.errors import FxpipeError
from passes.partition.coarsen import Units, build_units, coarsen, model_nodes
from passes.partition.chain import solve as chain_solve, unit_bottleneck
from passes.partition.downsets import downset_dp
from passes.partition.segments import build_segments, fold_margin, folded_units
from passes.partition.costmodel import CostOptions, StagePlan, evaluate, flat_bound, tied_weights
from passes.partition.heuristic import Solution, best_order_dp
from passes.partition.result import SolveResult
from passes.partition import branches, charged, placed, retie, stage_count, uniform


RELAXED_SHARE = 0.4  # of the time, for the ``any`` placed DP whose bound holds under pow2 (``_placed_chain``)
CHARGED_SHARE = 0.9  # of the time the flat bracket leaves, for the charged placed DP (CP-SAT gets the rest)
OPTIMAL_GAP = 1e-3  # the segment DP calls a plan optimal within 0.1 % of its proven bound, as CP-SAT's scaling does


def _cp_sat(units: Units, opts: CostOptions, minimise_memory: bool = False):
    """The CP-SAT model, imported here: OR-Tools loads pandas (most of a second), and plans
    the segment DP answers never need it."""
    from passes.partition.model import PartitionModel
    return PartitionModel(units, opts, minimise_memory=minimise_memory)


class InfeasibleError(FxpipeError):
    """No plan satisfies the request; the message says what would fit."""


@dataclass
class PartitionResult:
    assignment: Dict[str, int]
    replicas: List[int]
    stages: List[StagePlan]
    bottleneck_s: float
    options: CostOptions
    status: str  # OPTIMAL, FEASIBLE (time limit), or HEURISTIC (no solver answer)
    objective_s: float
    bound_s: float
    wall_s: float
    units: int  # what the solver saw after coarsening
    heuristic_s: Optional[float] = None  # the warm start's bottleneck
    trace: List[tuple] = field(default_factory=list)
    method: str = "CP-SAT"  # or "segment DP" (segments.py, chain.py) or "downset DP" (downsets.py)
    hierarchical: Optional[Dict[str, object]] = None  # PipeDream's level-by-level answer (pipedream model, G set)

    @property
    def gap(self) -> float:
        return max(0.0, (self.bottleneck_s - self.bound_s) / self.bottleneck_s) if self.bottleneck_s > 0 else 0.0

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    def solver_stats(self) -> Dict[str, object]:
        return {"status": self.status, "objective_s": self.bottleneck_s, "bound_s": self.bound_s,
                "gap": self.gap, "wall_s": self.wall_s, "units": self.units, "heuristic_s": self.heuristic_s,
                "method": self.method, **({"pipedream_hierarchical": self.hierarchical} if self.hierarchical else {})}


def partition(graph: CostGraph, devices: int, *, time_limit: float = 60.0, workers: int = 2,
              coarsen_above: int = 300, solver: str = "auto", downset_limit: Optional[int] = None,
              progress: Optional[Callable[[str], None]] = None, **options) -> PartitionResult:
    """Best pipeline of ``graph`` on ``devices`` devices; ``options`` are ``CostOptions`` fields.

    ``solver``: ``"auto"`` tries the segment DP first (``_chain``); if it does
    not prove its plan, the downset DP when the graph has at most
    ``downset_limit`` downsets (default: a budget by graph size, see
    ``downsets.downset_dp``) and neither memory nor tied weights are involved,
    else CP-SAT; the better plan and the higher bound are kept. ``"cpsat"``
    always uses CP-SAT. ``time_limit`` caps the whole call (every phase checks
    the deadline; the answer is the best plan and bound found by then).
    ``progress``: called with one line per improving CP-SAT solution (the CLI
    passes a stderr printer); ``coarsen_above``: unit count above which nodes merge.
    """
    opts = CostOptions(devices=devices, **options)
    if solver not in ("auto", "cpsat"):
        raise FxpipeError(f"partition: solver must be 'auto' or 'cpsat', not {solver!r}")
    start = time.monotonic()
    deadline = start + time_limit - finish_reserve(time_limit)
    fine = build_units(graph, opts, [[n] for n in model_nodes(graph, opts)])
    _check_devices(fine, opts)
    found = _searched_plan(graph, fine, opts, start, deadline, time_limit, workers, coarsen_above, solver,
                           downset_limit, progress)
    return _uniform_kept(graph, opts, found, start)


def _searched_plan(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float,
                   time_limit: float, workers: int, coarsen_above: int, solver: str,
                   downset_limit: Optional[int], progress) -> PartitionResult:
    """``partition``'s search: the segment DP, then the downset DP or CP-SAT (see ``partition``)."""
    if opts.gpus_per_node is not None:
        return _placed(graph, fine, opts, start, deadline, workers, coarsen_above, solver, downset_limit,
                       progress)
    chained = _chain(graph, opts, start, deadline) if solver == "auto" else None
    if chained is not None and (chained.status == "OPTIMAL" or deadline - time.monotonic() < 0.5):
        return chained
    try:
        other = _general(graph, fine, opts, start, deadline, time_limit, workers, coarsen_above, solver,
                         downset_limit, progress, chained)
    except InfeasibleError:
        if chained is None:
            raise
        return chained
    return _better(chained, other)


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
    best.status = "OPTIMAL" if best.gap <= OPTIMAL_GAP else ("FEASIBLE" if best.status != "HEURISTIC" else best.status)
    best.wall_s = max(chained.wall_s, other.wall_s)
    return best


def _general(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float, time_limit: float,
             workers: int, coarsen_above: int, solver: str, downset_limit: Optional[int], progress,
             chained: Optional[PartitionResult]) -> PartitionResult:
    """The downset DP on small lattices, else CP-SAT on coarsened units (warm-started by ``chained``)."""
    exact = None
    if solver == "auto":
        quick = best_order_dp(fine, opts, deadline) if len(fine) <= coarsen_above else None
        exact = downset_dp(fine, opts, downset_limit, upper=quick.objective if quick else float("inf"), deadline=deadline)
    if exact is not None and opts.memory is None and not fine.shared:
        solved = SolveResult("OPTIMAL", *exact, exact.objective, time.monotonic() - start)
        return _result(graph, fine, opts, solved, start, exact.objective, "downset DP")
    units = coarsen(graph, opts, target=coarsen_above, deadline=deadline)
    warm = exact if exact is not None and len(units) == len(fine) else best_order_dp(units, opts, deadline)
    heuristic_s = None
    if warm is not None:
        heuristic_s = evaluate(graph, _to_nodes(graph, units, warm.stage_of), warm.replicas, opts).bottleneck_s
    if not _time_for_cpsat(units, opts, deadline):
        if warm is None:
            raise InfeasibleError(f"partition: no plan found within the time limit ({time_limit:g}s); "
                                  "raise --time-limit")
        return _result(graph, units, opts, SolveResult("HEURISTIC", *warm, 0.0, 0.0),
                       start, heuristic_s, "CP-SAT")
    model = _cp_sat(units, opts)
    if chained is not None:  # the segment DP's plan, if the units can express it and it beats the order DP's
        stage_of = [chained.assignment[names[0]] for names in units.members]
        whole = all(chained.assignment[n] == s for s, names in zip(stage_of, units.members) for n in names)
        if whole and (warm is None or chained.bottleneck_s < (heuristic_s or math.inf)):
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
        _raise_infeasible(units, opts, solved, warm, deadline, workers)
        solved = SolveResult("HEURISTIC", *warm, 0.0, solved.wall_s)
    return _result(graph, units, opts, solved, start, heuristic_s, "CP-SAT")


def _placed(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float, workers: int,
            coarsen_above: int, solver: str, downset_limit: Optional[int], progress) -> PartitionResult:
    """A two-level machine (``opts.gpus_per_node``): where a stage sits changes its cost.

    First the segment DP (``_placed_chain``); if that does not prove its plan, the downset DP, which
    keeps the devices used (the next stage's first rank) and the last stage's
    replicas in its state and is exact under the contiguous placement (its upper
    bound from a warm start on the flat model at the slower bandwidth, scored
    placed); otherwise CP-SAT on the two bracketing flat models. The better plan
    and the higher bound are kept.
    """
    chained = _placed_chain(graph, opts, start, deadline) if solver == "auto" else None
    result = chained
    if chained is None or (chained.status != "OPTIMAL" and deadline - time.monotonic() >= 0.5):
        try:
            result = _better(chained, _placed_general(graph, fine, opts, start, deadline, workers,
                                                      coarsen_above, solver, downset_limit, progress))
        except InfeasibleError:
            if chained is None:
                raise
    result.hierarchical = _pipedream_levels(graph, opts)  # once, for the answer given
    return result


def _placed_chain(graph: CostGraph, opts: CostOptions, start: float, deadline: float) -> Optional[PartitionResult]:
    """The segment DP that knows node boundaries (``placed.py``) where it applies, else the flat bracket
    (``_bracketed``). Its charged form (``charged.ChargedChainSolver``: PipeDream's all-reduce, pow2
    counts) costs far more per pass on deep graphs, so there the bracket answers first and the charged
    DP gets ``CHARGED_SHARE`` of the time left when the bracket does not prove its plan (CP-SAT the
    rest); the better plan and the higher bound are kept (both are bounds of the placed model). Under
    ``pow2`` with fxpipe's charges the interval DP for ``any`` runs first (``RELAXED_SHARE`` of the
    time): its bound holds (every pow2 plan is one of its plans) and replaces the flat bracket's, which
    on many nodes charges every link at B1 and lies far below."""
    if not (placed.supports(opts) and opts.gpus_per_node < opts.devices):
        return _bracketed(graph, opts, start, deadline)
    if opts.cost_model == "fxpipe" and opts.replication == "any":
        return _chain(graph, opts, start, deadline)
    floor = 0.0
    if opts.cost_model == "fxpipe" and opts.replication == "pow2":
        # every pow2 plan is an ``any`` plan charged the same, so the interval DP's bound holds here too,
        # at a fraction of the charged DP's cost per pass and far above the flat bracket's on many nodes
        share = time.monotonic() + RELAXED_SHARE * (deadline - time.monotonic())
        relaxed = _chain(graph, dataclasses.replace(opts, replication="any"), start, share, plain=True)
        floor = relaxed.bound_s if relaxed is not None else 0.0
    bracket = _bracketed(graph, opts, start, deadline, plain=True, floor=floor)
    if bracket is not None and bracket.status == "OPTIMAL":
        return bracket
    exact = _chain(graph, opts, start, time.monotonic() + CHARGED_SHARE * (deadline - time.monotonic()),
                   *((bracket.bound_s, bracket.bottleneck_s) if bracket is not None else ()))
    return bracket if exact is None else (exact if bracket is None else _better(exact, bracket))


def _bracketed(graph: CostGraph, opts: CostOptions, start: float, deadline: float,
               plain: bool = False, floor: float = 0.0) -> Optional[PartitionResult]:
    """The segment DP under the flat model at the FASTER bandwidth (its bound is a bound of the placed
    model: no placement makes a link faster) and at the SLOWER one (its plans place well), the plan
    that scores best placed kept, with the fast model's bound; ``plain``: see ``_chain``; ``floor``: a
    bound of the placed model known already."""
    # one node: flat at B1; with a floor known, its bound (weaker on many nodes) is not worth its passes
    fast = _chain(graph, flat_bound(opts, fast=True), start, deadline, plain=plain) if floor <= 0 else None
    if fast is None and floor <= 0:
        return None
    bound = fast.bound_s if fast is not None else floor
    slow = _chain(graph, flat_bound(opts, fast=False), start, deadline, floor=bound, plain=plain) \
        if opts.gpus_per_node < opts.devices else None
    scored = [(evaluate(graph, r.assignment, r.replicas, opts), r) for r in (fast, slow) if r is not None]
    if not scored:
        return None
    ev, best = min(scored, key=lambda x: x[0].bottleneck_s)
    result = dataclasses.replace(
        best, stages=ev.stages, bottleneck_s=ev.bottleneck_s, objective_s=ev.bottleneck_s,
        options=opts, bound_s=min(bound, ev.bottleneck_s), wall_s=time.monotonic() - start)
    result.status = "OPTIMAL" if result.gap <= OPTIMAL_GAP else "FEASIBLE"
    return result


def _placed_general(graph: CostGraph, fine: Units, opts: CostOptions, start: float, deadline: float,
                    workers: int, coarsen_above: int, solver: str, downset_limit: Optional[int],
                    progress) -> PartitionResult:
    """The placement-aware downset DP on small lattices, else CP-SAT on the bracketing flat models."""
    slow = flat_bound(opts, fast=False)
    exact = None
    if solver == "auto":
        quick = best_order_dp(fine, slow, deadline) if len(fine) <= coarsen_above else None
        upper = evaluate(graph, _to_nodes(graph, fine, quick.stage_of), quick.replicas, opts).bottleneck_s if quick else math.inf
        exact = downset_dp(fine, opts, downset_limit, upper=upper, deadline=deadline)
    if exact is not None and opts.memory is None and not fine.shared:
        solved = SolveResult("OPTIMAL", *exact, exact.objective, time.monotonic() - start)
        return _result(graph, fine, opts, solved, start, exact.objective, "downset DP")
    return _placed_cpsat(graph, opts, start, deadline, workers, coarsen_above, progress)


def _placed_cpsat(graph: CostGraph, opts: CostOptions, start: float, deadline: float, workers: int,
                  coarsen_above: int, progress) -> PartitionResult:
    """CP-SAT on a two-level machine, which its model cannot see (``costmodel.flat_bound``).

    Two thirds of the time go to the flat model at the SLOWER bandwidth (its
    plans are good once placed), one third to the FASTER one, whose bound is
    the reported lower bound. Of both answers and both warm starts, the plan
    ``evaluate`` scores best under ``opts`` is kept; it is OPTIMAL only if it
    meets that bound.
    """
    units = coarsen(graph, opts, target=coarsen_above, deadline=deadline)
    plans, wall, trace, heuristic = [], 0.0, [], None
    bound = sum(units.compute) / opts.devices  # every plan is at least this slow, whatever its placement
    for fast, share in ((False, 2 / 3), (True, 1.0)):
        flat = flat_bound(opts, fast)
        warm = best_order_dp(units, flat, deadline)
        if warm is not None and opts.memory is None:  # the warm start does not check memory
            plans.append(warm)
            heuristic = heuristic if heuristic is not None else len(plans) - 1
        if not _time_for_cpsat(units, flat, deadline):
            continue
        model = _cp_sat(units, flat)
        if warm is not None:
            model.hint(warm.stage_of, warm.replicas)
            if opts.memory is None and not units.shared:
                model.upper_bound(warm.objective)
        remaining = max(0.05, (deadline - time.monotonic()) * share)
        solved = model.solve(remaining, workers=workers, report=progress)
        wall, trace = wall + solved.wall_s, trace + solved.progress
        if solved.stage_of is not None:
            plans.append(Solution(solved.stage_of, solved.replicas, solved.objective))
        if fast and solved.stage_of is not None:
            bound = max(bound, solved.bound)
        elif not fast and solved.stage_of is None and not plans:
            _raise_infeasible(units, opts, solved, None, deadline, workers)
    if not plans:
        raise InfeasibleError(f"partition: no plan found in {deadline - start:.0f}s; raise --time-limit")
    scored = [(evaluate(graph, _to_nodes(graph, units, p.stage_of), p.replicas, opts).bottleneck_s, p) for p in plans]
    value, best = min(scored, key=lambda x: x[0])
    status = "OPTIMAL" if value <= bound * (1 + OPTIMAL_GAP) else "FEASIBLE"
    solved = SolveResult(status, best.stage_of, best.replicas, value, bound, wall, trace)
    return _result(graph, units, opts, solved, start, None if heuristic is None else scored[heuristic][0], "CP-SAT")


def _time_for_cpsat(units: Units, opts: CostOptions, deadline: float) -> bool:
    """Whether building the CP-SAT model fits in half the time left (building cannot be interrupted).

    Measured here: about 5e4 variables per second on a quiet machine (HF GPT-2, 432 units, K = 256:
    5 s to build), half that with another process on each core; the slower rate is assumed, so a
    build started near the deadline does not run past it.
    """
    slots = min(opts.devices, max(1, sum(units.has_compute)))
    cells = (len(units) + len(units.producers)) * slots + slots * len(opts.allowed_replicas())
    left = deadline - time.monotonic()
    return left >= 0.2 and cells / 2.5e4 <= 0.5 * left


def _chain(graph: CostGraph, opts: CostOptions, start: float, deadline: float, floor: float = 0.0,
           ceiling: float = math.inf, plain: bool = False) -> Optional[PartitionResult]:
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
    on the optimum and a plan's time known already (``chain.solve``); ``plain``: no second
    search for plans that pay for dead nodes or a mask (``_bracketed`` before
    the charged DP, where time is short).
    """
    if opts.memory is not None:
        return None
    cones: List[branches.Cone] = []
    found = _searched(graph, opts, deadline, cones, floor=floor, ceiling=ceiling)
    if found is None and opts.replication != "none" and opts.gpus_per_node is None:
        cones = branches.input_only_cones(graph, opts)  # an attention mask beside the embeddings
        found = _searched(graph, opts, deadline, cones, keep_dead=True) if cones else None
    if found is None:
        return None
    plan, solution, margin, size = found
    plans, bound = [plan], solution.bound - margin
    if cones:  # the plan came from a restriction: the bound from the relaxation (branches.py)
        bound = 0.0  # cut off by the deadline: the plan stands, bounded by sum C / K below
        lower = _relaxation(graph, opts, deadline, cones)
        if lower is not None:
            plans.append(lower[0])
            plain = _searched(graph, opts, deadline, cones)  # dead nodes folded as the bound folds them
            plans += [plain[0]] if plain else []
            bound = lower[1]
    ideal = sum(graph.nodes[n].compute_s for n in model_nodes(graph, opts)) / opts.devices
    scored = [(evaluate(graph, a, reps, opts), a, reps) for a, reps in plans]
    if not cones and not plain and min(e.bottleneck_s for e, _, _ in scored) > max(bound, ideal) * (1 + OPTIMAL_GAP):
        # plans that pay for dead nodes, and for a cheap input-only value read by many stages (an
        # attention mask folded away like an input, whose bytes then cross every boundary unseen)
        masks = branches.input_only_cones(graph, opts) if opts.gpus_per_node is None else []
        for again in (_searched(graph, opts, deadline, c, keep_dead=True) for c in [[]] + ([masks] if masks else [])):
            scored += [(evaluate(graph, *again[0], opts), *again[0])] if again else []
        # the folding above placed those branches like model inputs, so the bound forgot their compute:
        # the relaxation that counts it in every prefix that must run it bounds the same plans higher
        lower = _relaxation(graph, opts, deadline, masks) if masks else None
        if lower is not None:
            scored.append((evaluate(graph, *lower[0], opts), *lower[0]))
            bound = max(bound, lower[1])
    loose = _loose_groups(graph, opts)
    scored = [(*_loose_ends(graph, loose, a, reps, e, opts), reps) for e, a, reps in scored]
    ev, assignment, replicas = min(scored, key=lambda x: x[0].bottleneck_s)
    bound = max(bound, ideal)
    if opts.gpus_per_node is None and tied_weights(graph, assignment):
        better = retie.recharged(graph, opts, ev.bottleneck_s, ev.stages,
                                 lambda heavier: (_searched(heavier, opts, deadline, cones, True) or [None])[0],
                                 bound * (1 + OPTIMAL_GAP), deadline)
        if better is not None:
            (assignment, replicas), ev = better
    result = PartitionResult(assignment=assignment, replicas=list(replicas), stages=ev.stages,
                             bottleneck_s=ev.bottleneck_s, options=opts, status="FEASIBLE",
                             objective_s=solution.objective, bound_s=min(bound, ev.bottleneck_s),
                             wall_s=time.monotonic() - start, units=size, method="segment DP")
    result.status = "OPTIMAL" if result.gap <= OPTIMAL_GAP else "FEASIBLE"
    return result


def _relaxation(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"]):
    """(plan, bound) from the segment DP on the graph with every cone node but its exit free, the cones'
    compute still counted in the devices of each prefix that must run it (``branches.py``); None if cut
    off by the deadline. Any plan of ``graph`` is a plan there and no slower, so the bound holds."""
    lower = _segment_dp(branches.relaxed(graph, cones), opts, deadline,
                        hidden=lambda units: branches.hidden_compute(graph, units, cones))
    if lower is None:
        return None
    units, found, margin = lower
    return (_to_nodes(graph, units, found.stage_of), found.replicas), found.bound - margin


def _loose_groups(graph: CostGraph, opts: CostOptions) -> Tuple[Dict[str, str], Dict[str, float]]:
    """Weightless nodes computed from model inputs alone whose results nobody uses (export's guard
    checks, an unused arange), each mapped to the first node of its connected group, and each
    group's compute; none on a two-level machine, whose placed plans ``_loose_ends`` leaves alone."""
    if opts.gpus_per_node is not None:
        return {}, {}
    succ, pred = graph.successors(), {n: [] for n in graph.nodes}
    for u, v in graph.edges:
        pred[v].append(u)
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


def _loose_ends(graph: CostGraph, found: Tuple[Dict[str, str], Dict[str, float]], assignment: Dict[str, int],
                replicas: List[int], ev, opts: CostOptions):
    """The loose groups of ``_loose_groups`` where they slow a stage least: the DP leaves them out
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


def _searched(graph: CostGraph, opts: CostOptions, deadline: float, cones: List["branches.Cone"],
              keep_dead: bool = False, floor: float = 0.0, ceiling: float = math.inf):
    """(plan on ``graph``'s nodes, the chain DP's answer, fold margin, units) from the segment DP on
    ``graph`` with each cone as one node (``branches.contracted``), or None."""
    merged = branches.contracted(graph, cones) if cones else graph
    solved = _segment_dp(merged, opts, deadline, keep_dead, floor=floor, ceiling=ceiling)
    if solved is None:
        return None
    units, found, margin = solved
    assignment = branches.expand(_to_nodes(merged, units, found.stage_of), cones)
    return (assignment, found.replicas), found, margin, len(units)


def _segment_dp(graph: CostGraph, opts: CostOptions, deadline: float, keep_dead: bool = False,
                hidden: Optional[Callable[[Units], List[Tuple[float, List[int]]]]] = None, floor: float = 0.0,
                ceiling: float = math.inf):
    """(units, the chain DP's answer, what folding may cost the bound) or None (see ``_chain``);
    ``hidden``: the compute a relaxation took off the units, given them (``Units.hidden``). None at
    once past the deadline: folding and segmenting alone take a good part of a second on a deep graph."""
    if time.monotonic() > deadline:
        return None
    ideal = graph.total_compute_s() / opts.devices
    units, folded = folded_units(graph, opts, tiny=1e-5 * ideal, tiny_silent=1e-3 * ideal,
                                 tiny_input=0.02 * ideal if opts.cost_model == "fxpipe" else -1.0,
                                 keep_dead=keep_dead)
    if hidden is not None:
        units.hidden = hidden(units)
    segs = build_segments(units, deadline=deadline)
    if segs is None:
        return None
    score = lambda stage_of, reps: unit_bottleneck(units, stage_of, reps, opts)  # noqa: E731
    if opts.replication == "none" and not opts.fewer_devices:
        if not stage_count.applies(opts, units):
            return None
        found = chain_solve(units, segs, opts, deadline, score, stage_count.StageCountSolver(units, segs, opts))
    elif opts.gpus_per_node is not None:  # placed.supports(opts): the offset within a node joins the state
        found = chain_solve(units, segs, opts, deadline, score, charged.solver_for(units, segs, opts),
                            placed.TOLERANCE, placed.LADDER, placed.PROBE_WITHIN, floor, ceiling)
    else:
        found = chain_solve(units, segs, opts, deadline, score, floor=floor)
    if found is None:
        return None
    return units, found, fold_margin(units, folded)


def _result(graph: CostGraph, units: Units, opts: CostOptions, solved: SolveResult, start: float,
            heuristic_s: Optional[float], method: str) -> PartitionResult:
    assignment = _to_nodes(graph, units, solved.stage_of)
    result = evaluate(graph, assignment, solved.replicas, opts)
    out = PartitionResult(
        assignment=assignment, replicas=list(solved.replicas), stages=result.stages,
        bottleneck_s=result.bottleneck_s, options=opts, status=solved.status,
        objective_s=solved.objective, bound_s=min(solved.bound, result.bottleneck_s),
        wall_s=time.monotonic() - start, units=len(units), heuristic_s=heuristic_s, trace=solved.progress,
        method=method,
    )
    if out.status == "OPTIMAL" and out.gap > OPTIMAL_GAP and tied_weights(graph, assignment):
        out.status = "FEASIBLE"  # the solver charged tied weights below their sync (costmodel.tied_sync_s)
    return out


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


def _to_nodes(graph: CostGraph, units: Units, stage_of: List[int]) -> Dict[str, int]:
    """Unit stages back to nodes; nodes the solver did not see (fxpipe inputs) join their first consumer."""
    assignment = {n: stage_of[i] for i, names in enumerate(units.members) for n in names}
    succ = graph.successors()
    for name in reversed(list(graph.nodes)):
        if name not in assignment:
            stages = [assignment[v] for v in succ[name] if v in assignment]
            assignment[name] = min(stages, default=0)
    used = sorted(set(stage_of))
    renumber = {s: i for i, s in enumerate(used)}
    return {n: renumber.get(s, 0) for n, s in assignment.items()}


def _raise_infeasible(units: Units, opts: CostOptions, solved: SolveResult,
                      warm, deadline: float, workers: int) -> None:
    """Raise with the smallest memory that fits (if memory is the reason), searched until the deadline."""
    if solved.status == "UNKNOWN" and warm is not None and opts.memory is None:
        return  # time ran out before CP-SAT restated the warm start: keep it
    if opts.memory is None or solved.status != "INFEASIBLE":
        raise InfeasibleError(f"partition: no plan found ({solved.status}) in {solved.wall_s:.1f}s; "
                              "raise --time-limit")
    probe = _cp_sat(units, opts, minimise_memory=True)
    if warm is not None:
        probe.hint(warm.stage_of, warm.replicas)
    least = probe.solve(max(0.05, deadline - time.monotonic()), workers=workers)
    what = (f"the smallest memory per device that fits on {opts.devices} devices is "
            f"{_fmt_bytes(least.objective)}" if least.stage_of is not None
            else "no plan fits any memory in the time given")
    if least.stage_of is not None and least.status != "OPTIMAL":
        what += f" (found within the time limit; at least {_fmt_bytes(least.bound)})"
    raise InfeasibleError(
        f"partition: no plan fits in {_fmt_bytes(opts.memory)} per device "
        f"({opts.schedule}, optimizer state {opts.optimizer_state}x weights); {what}. "
        "Raise --memory, add devices, or use --schedule 1f1b-flush/gpipe with fewer microbatches.")


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



def _pipedream_levels(graph: CostGraph, opts: CostOptions) -> Optional[Dict[str, object]]:
    """What PipeDream's hierarchical optimizer answers for the same two-level machine, to compare with.

    Only under its own cost model and options (a two-level machine, no memory
    limit, any replication, all devices); None where it does not apply or the
    graph has too many downsets for the reproduction. A graph of n nodes has at
    least n + 1 downsets (every topological prefix is one), so one of ``limit``
    nodes or more is turned away before the reproduction spends most of a second
    finding that out after the search's deadline.
    """
    G, limit = opts.gpus_per_node, 1000
    if (opts.cost_model != "pipedream" or G is None or opts.memory is not None or opts.fewer_devices
            or opts.replication != "any"):
        return None
    if len(graph.nodes) >= limit:
        return None
    from passes.partition.hierarchical import pipedream_hierarchical

    try:
        h = pipedream_hierarchical(graph, [G, opts.devices // G], [opts.intra_bw, opts.bandwidth], limit=limit)
    except FxpipeError:
        return None
    return {"time_s": h.time_s, "replicas": h.replicas, "ranks": h.ranks}
