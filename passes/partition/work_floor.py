"""A floor on the bottleneck from the work every device does: compute, and the all-reduce that
replicated weights cannot avoid.

``sum C / K`` counts compute alone. But a node whose compute exceeds T needs a stage of several
replicas, and those replicas all-reduce the stage's weights: with r replicas at bottleneck T,
``r·T >= C + r·allreduce_s(P, r)``. ``costmodel.allreduce_floor`` gives, per node, the least of that
all-reduce time the node's own weights bring whatever stage holds it (its stage has at least the
replicas the node needs alone). Summed over the stages, every plan within T on K devices has

    K·T >= sum C + sum over nodes of allreduce_floor(node, T),

and the right side falls as T grows, so the least T that satisfies it is a bound for every plan,
found by bisection. On a two-level machine a unit's replicas are counted at the faster links, and
their all-reduce charged as the fewest nodes they can fill pay (``costmodel.least_allreduce_coeff``):
no placement pays less. On a 24-layer Llama at 512 devices (10 Gbit/s) the matrix products of 0.7-1.3 ms
need 3-5 replicas each at T near 0.3 ms, and the floor is 5 % above ``sum C / K``.

Tied weights (several users) are left out: where their users share a stage they are synced once,
and ``tie_floor.py`` bounds them on its own.
"""
from __future__ import annotations

import numpy as np

from passes.costgraph import CostGraph
from passes.partition.coarsen import model_nodes, own_bytes, shared_weights
from passes.partition.costmodel import CostOptions, allreduce_floor

STEPS = 40  # bisection steps: 2^-40 of the bracket, whose ends lie within a factor of 2


def work_floor(graph: CostGraph, opts: CostOptions) -> float:
    """The least T with ``K·T >= sum C + sum allreduce_floor(T)`` over the placed nodes (see the module
    docstring), at least ``sum C / K``; 0 on an empty graph."""
    names = model_nodes(graph, opts)
    compute = np.array([graph.nodes[n].compute_s for n in names], dtype=float)
    total = float(compute.sum())
    if total <= 0:
        return 0.0
    shared = shared_weights(graph, {n: i for i, n in enumerate(names)})
    own = np.array([own_bytes(graph, graph.nodes[n], shared) for n in names], dtype=float)
    K = opts.devices
    short = lambda T: K * T < total + float(allreduce_floor(compute, own, T, opts).sum())  # noqa: E731
    lo = total / K
    if not short(lo):
        return lo
    hi = 2.0 * lo
    for _ in range(STEPS):  # the floor only falls as T grows, and one replica a node fits at T = max C
        if not short(hi):
            break
        hi *= 2.0
    else:
        return lo
    for _ in range(STEPS):
        mid = 0.5 * (lo + hi)
        if short(mid):
            lo = mid
        else:
            hi = mid
    return lo  # every T up to here is short: no plan is faster
