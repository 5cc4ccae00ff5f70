"""Plans that ``1f1b-stash`` can run when stages share a tied weight.

Under weight stashing every backward all-reduces a tied weight (GPT's
embedding and output projection) over all ranks of the stages that hold it,
so those ranks must run equally many backwards per minibatch: the stages
need equal replica counts (``fxpipe.schedule._check_stash_groups`` refuses
anything else). The searches do not model that rule (it would tie replica
variables across stages in every DP and in CP-SAT), so a plan for
``schedule="1f1b-stash"`` can come back with, say, replicas [2, 1, 1] on a
GPT whose first and last stages share the embedding.

``evened`` keeps the plan's stages and chooses the replicas again under the
rule: for each count the tied stages could share (between the fewest and
the most the plan gave them) it fits the other stages' replicas around it,
taking devices from where the cost model loses least and giving spare ones
to the slowest stage, and keeps the fastest such plan; the uniform PP x DP
layout (every stage the same replicas) is the fallback. The bound is left as
it is: a bound of the problem without the rule is one of the problem with
it, so the gap reported is honest, only wider.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

from passes.costgraph import CostGraph
from passes.partition import uniform
from passes.partition.costmodel import CostOptions, Evaluation, evaluate, tied_weights
from passes.partition.result import OPTIMAL_GAP, PartitionResult

SCHEDULE = "1f1b-stash"


def tied_stages(graph: CostGraph, assignment: Dict[str, int]) -> List[int]:
    """Every stage holding a weight that another stage also uses (the runtime syncs them as one group)."""
    return sorted({j for group in tied_weights(graph, assignment) for j in group})


def runnable(graph: CostGraph, assignment: Dict[str, int], replicas: Sequence[int]) -> bool:
    """Whether ``1f1b-stash`` can run these replicas: the tied stages have one count between them."""
    return len({replicas[j] for j in tied_stages(graph, assignment)}) <= 1


def evened(graph: CostGraph, opts: CostOptions, found: PartitionResult, until: float) -> PartitionResult:
    """``found``, or where ``opts.schedule`` is ``1f1b-stash`` and its tied stages have unequal replicas,
    the fastest plan on the same stages with equal ones (or the uniform layout, if faster); the
    search for it stops at ``until`` (``time.monotonic``), the uniform layout still answering."""
    if opts.schedule != SCHEDULE:
        return found
    if runnable(graph, found.assignment, found.replicas):
        return found
    tied = tied_stages(graph, found.assignment)
    start = time.monotonic()
    best: Optional[tuple] = None
    counts = sorted({found.replicas[j] for j in tied})
    for c in [r for r in opts.allowed_replicas() if counts[0] <= r <= counts[-1]]:
        replicas = _fitted(graph, opts, found.assignment, found.replicas, tied, c, until)
        if replicas is not None:
            ev = evaluate(graph, found.assignment, replicas, opts)
            if _fits(ev, opts) and (best is None or ev.bottleneck_s < best[0].bottleneck_s):
                best = (ev, found.assignment, replicas)
    hand = uniform.best_layout(graph, opts)  # equal replicas everywhere: always runnable
    if hand is not None and (best is None or hand[0].bottleneck_s < best[0].bottleneck_s):
        best = hand
    if best is None:
        return found  # nothing runnable fits: the runtime's refusal names the way out
    ev, assignment, replicas = best
    out = dataclasses.replace(
        found, assignment=dict(assignment), replicas=list(replicas), stages=ev.stages,
        bottleneck_s=ev.bottleneck_s, objective_s=ev.bottleneck_s, bound_s=min(found.bound_s, ev.bottleneck_s),
        method=f"{found.method}, tied stages' replicas evened for {SCHEDULE}",
        wall_s=found.wall_s + time.monotonic() - start)
    if out.status != "HEURISTIC":
        out.status = "OPTIMAL" if out.gap <= OPTIMAL_GAP else "FEASIBLE"
    return out


def _fits(ev: Evaluation, opts: CostOptions) -> bool:
    return opts.memory is None or ev.peak_memory_bytes <= opts.memory


def _fitted(graph: CostGraph, opts: CostOptions, assignment: Dict[str, int], replicas: Sequence[int],
            tied: List[int], c: int, until: float) -> Optional[List[int]]:
    """Replicas with every tied stage at ``c`` and the others fitted to the devices, or None.

    Over budget, the untied stage that loses least (its time scaled by the
    replicas it keeps) gives up devices; under budget, the slowest untied
    stage takes the next larger count, until every device is used (or, with
    ``fewer_devices``, where the plan was fastest on the way). One evaluation
    a step; None where the counts cannot add up or ``until`` passes.
    """
    allowed = opts.allowed_replicas()
    out = list(replicas)
    for j in tied:
        out[j] = c
    free = [j for j in range(len(out)) if j not in tied]
    while sum(out) > opts.devices:
        if time.monotonic() > until:
            return None
        ev = evaluate(graph, assignment, out, opts)
        options = [(ev.stages[j].time_s * out[j] / smaller[-1], j, smaller[-1]) for j in free
                   for smaller in [[r for r in allowed if r < out[j]]] if smaller]
        if not options:
            return None
        _, j, r = min(options)
        out[j] = r
    best: Optional[tuple] = None  # (bottleneck, replicas): with fewer_devices, the fastest on the way
    while sum(out) < opts.devices:
        if time.monotonic() > until:
            return None
        ev = evaluate(graph, assignment, out, opts)
        if opts.fewer_devices and (best is None or ev.bottleneck_s < best[0]):
            best = (ev.bottleneck_s, list(out))
        options = [(-ev.stages[j].time_s, j, larger[0]) for j in free
                   for larger in [[r for r in allowed if out[j] < r <= opts.devices - sum(out) + out[j]]] if larger]
        if not options:
            break
        _, j, r = min(options)
        out[j] = r
    if sum(out) == opts.devices:
        t = evaluate(graph, assignment, out, opts).bottleneck_s
        if best is None or t < best[0]:
            best = (t, out)
    return None if best is None else best[1]
