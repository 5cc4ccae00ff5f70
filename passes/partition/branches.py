"""Side branches computed from the inputs alone (HF GPT-2's attention mask), for the segment DP.

HF GPT-2 builds its attention mask from position indices in a few dozen small
weightless nodes (arange, cumsum, index, comparisons) that run beside the
embeddings and meet them only at the first attention. That branch and the
embedding path form one segment (``segments.py``) whose downsets are the
product of both sides' (over 200,000), too many for the DP. Here each such
branch is handled twice, and the two answers bracket the optimum:

* A *cone* is an exit node ``x`` whose value is computed from the inputs
  alone (no weights upstream) and read by a node that is not, together with
  the weightless input-only nodes all of whose readers lie in the cone (so
  only ``x`` is read from outside it, and every cone node is an ancestor of
  ``x``), and the nodes nobody reads (checks) that read a cone node.
* **Plan** (``contracted``): each cone becomes one node (its compute summed,
  ``x``'s output), a restriction of the plans, so the DP's plan on it is a
  plan of the real graph, scored there.
* **Bound** (``relaxed``): every cone node but ``x`` costs nothing and sends
  nothing. Any plan of the real graph is then a plan of the relaxed graph
  with no stage slower (less compute, no cut larger: a cone node's readers
  are in the cone, and the values it reads are read there still), except that
  a stage holding only such nodes would hold no compute; it can join the
  stage before it, whose outgoing cut does not grow (the cone sends nothing
  but through ``x``) and whose devices stay the same, or, if it is the first
  stage, the stage after it, which then has no incoming cut. So the relaxed
  optimum on at most K devices is a lower bound, and so is ``sum C / K``.

The relaxed graph forgets the cone's compute, but a plan of the real graph
still runs it: every cone node but the checks is an ancestor of ``x``, so any
prefix of stages that holds a node downstream of it holds it too.
``hidden_compute`` lists that compute with the units that force it in, and the
segment DP counts it in the devices each prefix needs (``Units.hidden``), so
the bound gives up only how the branch's compute splits between stages, not
its share of the devices.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from passes.costgraph import CostGraph
from passes.partition.coarsen import Hidden, Units, model_nodes
from passes.partition.costmodel import CostOptions

Cone = Tuple[str, List[str]]  # exit node, the cone's nodes in graph order (exit last)


def input_only(graph: CostGraph, opts: CostOptions):
    """(the placed nodes in graph order, each one's producers (model inputs included), its placed
    readers, whether it is computed from the inputs alone: no weights, neither the output nor an input,
    reading only inputs and such nodes). Shared by the cones here and ``anchors.exits``."""
    names = model_nodes(graph, opts)
    placed = set(names)
    preds: Dict[str, List[str]] = {n: [] for n in names}
    readers: Dict[str, List[str]] = {n: [] for n in names}
    for u, v in graph.edges:
        if v in placed:
            preds[v].append(u)
        if u in placed and v in placed:
            readers[u].append(v)
    free: Dict[str, bool] = {}
    for n in names:
        node = graph.nodes[n]
        free[n] = (not node.params and node.param_bytes == 0 and node.op != "output" and not node.is_input
                   and all(free.get(p, False) or graph.nodes[p].is_input for p in preds[n]))
    return names, preds, readers, free


def input_only_cones(graph: CostGraph, opts: CostOptions) -> List[Cone]:
    """The cones (see the module docstring) of more than one node."""
    names, preds, readers, free = input_only(graph, opts)
    dead = {n for n in names if free[n] and not readers[n]}  # checks whose result nobody reads
    exits = [n for n in names if free[n] and any(not free[r] for r in readers[n])]
    taken = set(exits)
    cones: List[Cone] = []
    for x in reversed(exits):
        cone = {x}
        for n in reversed(names):
            live = [r for r in readers[n] if r not in dead]
            if free[n] and n not in taken and live and all(r in cone for r in live):
                cone.add(n)
        cone |= {d for d in dead - taken if any(p in cone for p in preds[d])}
        taken |= cone
        if len(cone) > 1:
            cones.append((x, [n for n in names if n in cone]))
    return cones


def contracted(graph: CostGraph, cones: List[Cone], pieces: int = 1) -> CostGraph:
    """Each cone as ``pieces`` nodes in a chain, the last named after its exit (see the module
    docstring: a restriction); ``pieces_of`` says which. A piece sends what its members send to
    later pieces (all of it across each cut it crosses, so never less than the real bytes)."""
    rep = pieces_of(graph, cones, pieces)
    groups: Dict[str, List[str]] = {}
    for n, r in rep.items():
        groups.setdefault(r, []).append(n)
    last = {(r if r in graph.nodes else ms[-1]): r for r, ms in groups.items()}  # where a piece sits
    succ = graph.successors()
    nodes = {}
    for name, node in graph.nodes.items():
        if name not in rep:
            nodes[name] = node
        elif name in last:
            r = last[name]
            members = [graph.nodes[m] for m in groups[r]]
            sent = graph.nodes[r].out_bytes if r in graph.nodes else \
                sum(graph.nodes[m].out_bytes for m in groups[r] if any(rep.get(v) != r for v in succ[m]))
            nodes[r] = dataclasses.replace(graph.nodes[name], name=r, fwd_s=sum(m.fwd_s for m in members),
                                           bwd_s=sum(m.bwd_s for m in members), out_bytes=sent)
    edges = [(rep.get(u, u), rep.get(v, v)) for u, v in graph.edges]
    edges = list(dict.fromkeys((u, v) for u, v in edges if u != v))
    return CostGraph(nodes=nodes, edges=edges, info=dict(graph.info), param_sizes=dict(graph.param_sizes))


def pieces_of(graph: CostGraph, cones: List[Cone], pieces: int = 1) -> Dict[str, str]:
    """Per cone member, the node of ``contracted`` that holds it: the cone's members in graph order
    cut into ``pieces`` runs of about equal compute (a run ends no earlier than it must), each a
    downset of the rest (members read only the inputs and earlier members), so the pieces form a
    chain; the last run, with the exit, is named after it, the others ``<exit>:<k>``. With one piece
    (the plan of earlier releases) the whole cone sits with its exit; with more, the DP may put the
    first runs in earlier stages, where a stage before the exit's has room (HF GPT-2's mask, 0.36
    ms, is 70 % of a stage at 64 devices)."""
    rep: Dict[str, str] = {}
    for x, members in cones:
        total = sum(graph.nodes[m].compute_s for m in members)
        k, acc = 0, 0.0
        for m in members:
            k = pieces - 1 if m == x else k  # checks that read the exit join its piece
            rep[m] = x if k == pieces - 1 else f"{x}:{k}"
            acc += graph.nodes[m].compute_s
            if k < pieces - 1 and acc >= total * (k + 1) / pieces:
                k += 1
    return rep


def relaxed(graph: CostGraph, cones: List[Cone]) -> CostGraph:
    """Every cone node but its exit free and silent (see the module docstring: a relaxation)."""
    quiet = {n for x, members in cones for n in members if n != x}
    nodes = {name: dataclasses.replace(node, fwd_s=0.0, bwd_s=0.0, out_bytes=0) if name in quiet else node
             for name, node in graph.nodes.items()}
    return CostGraph(nodes=nodes, edges=list(graph.edges), info=dict(graph.info), param_sizes=dict(graph.param_sizes))


def expand(assignment: Dict[str, int], cones: List[Cone], pieces: int = 1,
           graph: Optional[CostGraph] = None) -> Dict[str, int]:
    """A plan of ``contracted(graph, cones, pieces)`` as a plan of the real one: each member sits with
    its piece (``graph`` is needed with more than one piece)."""
    rep = {m: x for x, members in cones for m in members} if pieces == 1 else pieces_of(graph, cones, pieces)
    out = {n: s for n, s in assignment.items() if n not in rep.values() or n in rep}
    for m, r in rep.items():
        out[m] = assignment[r]
    return out


def hidden_compute(graph: CostGraph, units: Units, cones: List[Cone]) -> List[Hidden]:
    """``Units.hidden`` for ``units`` of ``relaxed(graph, cones)``: the compute the relaxation took off
    each cone (its nodes upstream of the exit, the exit but not its compute excluded: it keeps that,
    see ``segments.dropped_compute``), with the units that force it into a prefix: the exit's, or,
    where folding left the exit in none (placed like a model input), those holding its nearest placed
    descendants (see the module docstring). Not the members' own units: a member that sends nothing
    may fold into a unit (an input's, PipeDream's model) yet sit in a later stage."""
    unit_of = units.unit_of()
    succ, preds = graph.successors(), graph.predecessors()
    out = []
    for x, members in cones:
        upstream = _ancestors(x, set(members), preds) - {x}
        seconds = sum(graph.nodes[n].compute_s for n in members if n in upstream)
        if seconds > 0:
            out.append((seconds, placed_below(x, unit_of, succ), -1, []))  # computed from the inputs alone
    return out


def forced_compute(graph: CostGraph, units: Units, nodes: List[str]) -> List[Hidden]:
    """``Units.hidden`` for nodes a relaxation made free: each one's compute (in ``graph``), forced into
    any prefix holding a unit whose first node descends from it, the nearest such units (every plan
    runs a node before its descendants). Not the unit of a reader folded into another: a freed reader
    folds into its producer's unit (``segments.folded_units``), which may run before the node (a
    stage ending at a query projection, the next one starting with its reshape and the reshape's
    reader), and a prefix holding that unit need not hold the node; a unit's first node runs where
    the plan puts the unit."""
    heads = {members[0]: u for u, members in enumerate(units.members)}
    succ = graph.successors()
    above = heads_above(graph, heads)
    out = []
    for n in nodes:
        holding = sorted({u for r in succ[n] for u in placed_below(r, heads, succ)})
        if graph.nodes[n].compute_s > 0 and holding:
            out.append((graph.nodes[n].compute_s, holding, -1, sorted(above[n])))
    return out


def heads_above(graph: CostGraph, heads: Dict[str, int]) -> Dict[str, frozenset]:
    """Per node, the units whose first node (``heads``) is one of its nearest such ancestors: every plan
    runs a node in its ancestors' stages or later, and puts a unit where its first node runs, so a
    freed node runs in the stage of each of these units or a later one (``Units.hidden``'s last field:
    a stage that holds such a unit must run the node itself, ``pins.py``)."""
    preds = graph.predecessors()
    above: Dict[str, frozenset] = {}
    for n in graph.nodes:  # in graph order, producers first (one listed later adds none: fewer units, still sound)
        found: set = set()
        for p in preds[n]:
            found |= {heads[p]} if p in heads else above.get(p, frozenset())
        above[n] = frozenset(found)
    return above


def _ancestors(x: str, within: set, preds: Dict[str, List[str]]) -> set:
    """``x`` and the nodes of ``within`` it descends from through ``within``."""
    seen, todo = {x}, [x]
    while todo:
        for p in preds[todo.pop()]:
            if p in within and p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def placed_below(n: str, unit_of: Dict[str, int], succ: Dict[str, List[str]]) -> List[int]:
    """The unit holding ``n``, or those holding the first nodes downstream of it that sit in a unit
    (``unit_of`` may map only some nodes: ``forced_compute`` passes the units' first nodes)."""
    if n in unit_of:
        return [unit_of[n]]
    found, seen, todo = set(), {n}, [n]
    while todo:
        for v in succ[todo.pop()]:
            if v in unit_of:
                found.add(unit_of[v])
            elif v not in seen:
                seen.add(v)
                todo.append(v)
    return sorted(found)
