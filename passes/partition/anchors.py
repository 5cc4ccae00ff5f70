"""Values read far from where they are made: each per-layer read of a shared input-only value, anchored
in its layer, for the segment DP.

Llama-style models compute the rotary tables (cos, sin) once, from the
positions alone, and every layer first reshapes them (``cos.unsqueeze(1)``)
before using them. Those per-layer reads are *exits*: weightless nodes whose
placed producers are all weightless and computed from the inputs alone, read
by nodes that are not. An exit of layer 20 descends from nothing in layers
0-19, so no residual add there is a separator (``segments.separators``: every
later unit must descend from it) and the whole model is one segment, too large
for the DP (a 24-layer HF Llama: 27 separators, all after the last rotary
read, and no plan from the DP on any device count).

An exit's *anchor* is the latest node that is a strict ancestor of every one
of its readers and a descendant of every placed producer of the exit (in a
Llama layer: the input norm's output, which feeds both the query and the key
rotation). Then, as for ``branches.py``'s cones, the planner runs twice:

* **Plan** (``anchored``): an edge from each anchor to its exit, so the exit
  runs no earlier than its anchor's stage: a restriction (fewer plans, each a
  plan of the real graph, scored there); the exit now descends from its
  layer, and the residual adds are separators again.
* **Bound** (``relaxed``): the same edges, and each exit free and silent. Any
  plan P of the real graph maps to a plan of the relaxed graph no slower: move
  every exit into its anchor's stage. Its readers sit no earlier (the anchor
  is their ancestor), its producers no later (they are the anchor's
  ancestors); the stage loses the exit's compute (free); the values the exit
  read now cross up to the anchor's stage instead of the exit's, and where
  that is further, P sent the exit's own value over those boundaries, which
  is at least as large (``exits`` keeps only exits whose placed producers send
  no more than they do: a reshape or a view). So the relaxed optimum bounds
  the real one. The exits' compute still counts in the devices of every prefix
  that holds a unit running after them (``hidden_compute``): every plan runs an
  exit before its descendants.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from passes.costgraph import CostGraph
from passes.partition.branches import forced_compute, input_only
from passes.partition.coarsen import Hidden, Units
from passes.partition.costmodel import CostOptions

Exit = Tuple[str, str]  # (exit node, its anchor)


def exits(graph: CostGraph, opts: CostOptions) -> List[Exit]:
    """Every exit with an anchor (see the module docstring), in graph order."""
    names, producers, readers, free = input_only(graph, opts)
    pos = {n: i for i, n in enumerate(names)}
    preds = {n: [p for p in producers[n] if p in pos] for n in names}  # the placed ones
    below: Dict[str, int] = {}  # strict ancestors among the placed nodes, as a bitset over ``pos``
    for n in names:
        mask = 0
        for p in preds[n]:
            mask |= below[p] | (1 << pos[p])
        below[n] = mask
    found: List[Exit] = []
    for e in names:
        outside = [r for r in readers[e] if not free[r]]
        if not free[e] or not preds[e] or not outside or len(outside) < len(readers[e]):
            continue
        if sum(graph.nodes[p].out_bytes for p in preds[e]) > graph.nodes[e].out_bytes:
            continue  # moving it later could send more than it does (see the module docstring)
        common = ~0
        for r in outside:
            common &= below[r]
        common &= ~below[e] & ~(1 << pos[e])  # not the exit, nor what it reads
        must = 0
        for p in preds[e]:
            must |= 1 << pos[p]
        while common:
            a = common.bit_length() - 1  # the latest candidate in graph order
            if not free[names[a]] and below[names[a]] & must == must:
                found.append((e, names[a]))
                break
            common &= ~(1 << a)
    return found


def anchored(graph: CostGraph, found: List[Exit]) -> CostGraph:
    """The restriction: an edge from every anchor to its exit, each exit moved just after its anchor
    in the node order (which stays topological: the exit's producers are the anchor's ancestors, its
    readers the anchor's descendants)."""
    if not found:
        return graph
    after: Dict[str, List[str]] = {}
    for e, a in found:
        after.setdefault(a, []).append(e)
    moved = {e for e, _ in found}
    order: List[str] = []
    for n in graph.nodes:
        if n not in moved:
            order.append(n)
            order += after.get(n, [])
    nodes = {n: graph.nodes[n] for n in order}
    edges = list(graph.edges) + [(a, e) for e, a in found]
    return CostGraph(nodes=nodes, edges=edges, info=dict(graph.info), param_sizes=dict(graph.param_sizes))


def relaxed(graph: CostGraph, found: List[Exit]) -> CostGraph:
    """The relaxation: ``anchored``, every exit free and silent (see the module docstring)."""
    out = anchored(graph, found)
    for e, _ in found:
        out.nodes[e] = dataclasses.replace(out.nodes[e], fwd_s=0.0, bwd_s=0.0, out_bytes=0)
    return out


def hidden_compute(graph: CostGraph, units: Units, found: List[Exit]) -> List[Hidden]:
    """``Units.hidden`` for ``units`` of ``relaxed(graph, found)``: each exit's compute, forced into any
    prefix that holds a unit running after it (``branches.forced_compute``)."""
    return forced_compute(graph, units, [e for e, _ in found])
