"""A floor on the bottleneck from a weight tied between two nodes (a GPT's embedding and output head).

The segment DP charges a stage that holds a tied weight as if the other holder had only the replicas
its own users need at the bottleneck (``chain._Partners``): each holder is priced against the other's
fewest replicas, so two holders may each assume the other small. On HF GPT-2 profiled on an H100 at
K = 256, the embedding and the head each sat alone in a stage at about 0.104 ms of compute, and the
sync of their 128 KiB weight over the two ranks costs 0.105 ms: the plan took 0.209 ms, and the DP's
bound stayed at 0.2006 ms (4.1 % apart), pricing each with two replicas against one of the other.

Any plan either puts both users in one stage, which then holds every node on a path between them
(a stage is convex), or in two stages of r1 and r2 replicas, whose group of r1 + r2 ranks each of
them syncs (``costmodel.tied_sync_s``). Each stage's time is at least ``costmodel.stage_time_s`` of
its tied user's compute and the tied bytes alone (more compute, weights and cuts only add), so the
least over (r1, r2) of the slower of the two, and over r of the shared stage, bounds every plan.
Flat machines only: on a two-level one the sync depends on where the ranks sit.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List

import numpy as np

from passes.costgraph import CostGraph, closure
from passes.partition.coarsen import model_nodes
from passes.partition.costmodel import CostOptions, stage_time_s


def tie_floor(graph: CostGraph, opts: CostOptions) -> float:
    """The highest floor of the weights tied between exactly two nodes (see the module docstring); 0
    where there are none, or on a two-level machine."""
    if opts.gpus_per_node is not None or not graph.param_sizes:
        return 0.0
    placed = set(model_nodes(graph, opts))
    users: Dict[str, List[str]] = {}
    for name, node in graph.nodes.items():
        if name in placed:
            for p in node.params:
                users.setdefault(p, []).append(name)
    tied: Dict[FrozenSet[str], float] = {}
    for p, who in users.items():
        if len(set(who)) == 2:
            key = frozenset(who)
            tied[key] = tied.get(key, 0.0) + float(graph.param_sizes.get(p, 0))
    return max((_pair_floor(graph, [n for n in graph.nodes if n in pair], nbytes, opts)
                for pair, nbytes in tied.items() if nbytes > 0), default=0.0)


def _pair_floor(graph: CostGraph, pair: List[str], nbytes: float, opts: CostOptions) -> float:
    """Least bottleneck of any plan, from the two users of ``nbytes`` tied bytes alone."""
    allowed = np.asarray([r for r in opts.allowed_replicas() if r <= opts.devices], dtype=float)
    c1, c2 = (graph.nodes[n].compute_s for n in pair)
    r1, r2 = allowed[:, None], allowed[None, :]
    split = np.maximum(stage_time_s(c1, nbytes, 0.0, 0.0, r1, opts, tied=nbytes, partners=r2),
                       stage_time_s(c2, nbytes, 0.0, 0.0, r2, opts, tied=nbytes, partners=r1))
    split = np.where(r1 + r2 <= opts.devices, split, np.inf)
    between = _between(graph, pair[0], pair[1])
    compute = sum(graph.nodes[n].compute_s for n in between)
    shared = stage_time_s(compute, nbytes, 0.0, 0.0, allowed, opts)
    return float(min(split.min(initial=np.inf), shared.min(initial=np.inf)))


def _between(graph: CostGraph, first: str, last: str) -> set:
    """``first``, ``last`` and every node on a path from one to the other: a stage holding both holds them."""
    below, above = closure(first, graph.successors()), closure(last, graph.predecessors())
    return (below & above) | {first, last}
