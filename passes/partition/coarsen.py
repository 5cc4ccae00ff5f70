"""Group nodes so the solver sees a few hundred units instead of thousands.

A group always lands in one stage, so every merge removes some stage
boundaries from the search. Merges are chosen to remove the least useful ones:

1. zero-cost nodes (no compute, no weights: views, adds, concats) join their
   only producer or only consumer: a cut next to them rarely matters, their
   output usually has the size of their input;
2. module subtrees: the groups whose nodes all come from one module (by
   ``module_path``, deepest modules first) merge into one group when the
   result is convex (no path leaves the set and comes back) and its compute is
   under the cap below; a model's own module boundaries are where its
   activations are narrowest (a transformer block hands on the residual
   stream, its attention internals are three times wider), so they are the
   cuts worth keeping. PipeDream's profiles carry no module paths, so this
   step only acts on fxpipe's own profiles;
3. chains ``u -> v`` (``u`` has one consumer, ``v`` one producer) with the
   smallest combined compute first.

Steps 2 and 3 each merge up to a cap of 5% of the ideal stage (sum of compute
/ K), raised step by step to 20% while the graph is still over the target, so
balance cannot suffer by more than that; step 2 runs through all its caps
first, so chains do not join the ends of two modules before the modules
merge. Every merge keeps the group graph acyclic. Bytes crossing a boundary
are still counted per original producer (see ``Units.producers``), so a
group's cut accounting stays exact; the only approximation is the restricted
set of cut positions. Inputs and the output node are never merged.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

from passes.costgraph import CostGraph, CostNode
from passes.partition.costmodel import CostOptions, counts_comm


# compute a relaxation took off the units (``Units.hidden``): seconds, forcing units, home unit, after units
Hidden = Tuple[float, List[int], int, List[int]]


@dataclass
class Units:
    """The solver's view: units (groups of nodes) in topological order."""

    members: List[List[str]]
    compute: List[float]
    param_bytes: List[int]  # weights owned by the unit and not shared with other units
    act_bytes: List[int]  # stashed activations (outputs of its non-input nodes)
    has_compute: List[bool]
    is_input: List[bool]  # only in the PipeDream model: forced into stage 0
    is_output: List[bool]  # forced into the last stage
    edges: List[Tuple[int, int]]
    producers: List[Tuple[int, int, List[int]]]  # (unit, bytes, consumer units outside it)
    shared: Dict[str, Tuple[int, List[int]]] = field(default_factory=dict)  # param -> (bytes, units)
    # compute the units do not hold (``branches.hidden_compute``, ``segments.dropped_compute``): (seconds,
    # sorted units of which any one in a prefix of the plan puts it in that prefix too, the unit whose
    # stage the plan puts it in, or -1: the first of those units', units each of which runs in its stage
    # or an earlier one: the first nodes of its nearest ancestors hold them, or [] where none is known)
    hidden: List[Hidden] = field(default_factory=list)
    # values of nodes left out like inputs (``segments.dropped_compute``, ``freed_sends.py``): (bytes, sorted
    # units any of which in a prefix puts the value there, sorted units any of which outside it needs the
    # value, units all of which the prefix must hold); a prefix holding one of the first, missing one of the
    # second and holding all of the third sends the value on. For a node's own readers the first two lists
    # are the same and the third is empty
    hidden_sends: List[Tuple[int, List[int], List[int], List[int]]] = field(default_factory=list)
    # compute of folded nodes that send nothing, left out of ``compute`` (``segments.folded_units`` with
    # ``bridge``): (seconds, a unit before the node, a unit after it, the unit it joined). A stage holding
    # the first two holds the node in every plan; the segment DP charges it there (``segments.Segment.start``)
    bridged: List[Tuple[float, int, int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.members)

    def unit_of(self) -> Dict[str, int]:
        return {n: i for i, names in enumerate(self.members) for n in names}

    def predecessors(self) -> List[List[int]]:
        """Per unit, the units with an edge into it."""
        preds: List[List[int]] = [[] for _ in range(len(self.members))]
        for a, b in self.edges:
            preds[b].append(a)
        return preds


def model_nodes(graph: CostGraph, opts: CostOptions) -> List[str]:
    """Nodes the solver places; fxpipe leaves inputs out (every rank loads them)."""
    if opts.cost_model == "pipedream":
        return list(graph.nodes)
    return [n for n, node in graph.nodes.items() if not node.is_input]


def ideal_s(graph: CostGraph, opts: CostOptions) -> float:
    """Sum of the placed nodes' compute over K: no plan's bottleneck is below it, whatever its layout."""
    return sum(graph.nodes[n].compute_s for n in model_nodes(graph, opts)) / opts.devices


def shared_weights(graph: CostGraph, unit: Dict[str, int]) -> Dict[str, Tuple[int, List[int]]]:
    """Weights used by more than one unit (``unit``: node -> its unit), as ``Units.shared``."""
    users: Dict[str, Set[int]] = {}
    for name in unit:
        for p in graph.nodes[name].params if graph.param_sizes else ():
            users.setdefault(p, set()).add(unit[name])
    return {p: (graph.param_sizes.get(p, 0), sorted(u)) for p, u in users.items() if len(u) > 1}


def own_bytes(graph: CostGraph, node: CostNode, shared: Dict[str, Tuple[int, List[int]]]) -> int:
    """Bytes of ``node``'s weights that are not ``shared`` (``Units.param_bytes`` sums them)."""
    if node.params and graph.param_sizes:
        return sum(graph.param_sizes.get(p, 0) for p in node.params if p not in shared)
    return node.param_bytes


def build_units(graph: CostGraph, opts: CostOptions, groups: List[List[str]]) -> Units:
    """Aggregate costs of ``groups`` (each a list of node names, topologically ordered)."""
    unit = {n: i for i, names in enumerate(groups) for n in names}
    shared = shared_weights(graph, unit)
    succ = graph.successors()
    units = Units(members=groups, compute=[], param_bytes=[], act_bytes=[], has_compute=[],
                  is_input=[], is_output=[], edges=[], producers=[], shared=shared)
    for i, names in enumerate(groups):
        nodes = [graph.nodes[n] for n in names]
        units.compute.append(sum(n.compute_s for n in nodes))
        units.param_bytes.append(sum(own_bytes(graph, n, shared) for n in nodes))
        units.act_bytes.append(sum(n.out_bytes for n in nodes if not n.is_input))
        units.has_compute.append(any(not n.is_input and n.op != "output" for n in nodes))
        units.is_input.append(all(n.is_input for n in nodes))
        units.is_output.append(any(n.op == "output" for n in nodes))
        for n in names:
            outside = sorted({unit[v] for v in succ[n] if v in unit and unit[v] != i})
            if outside and counts_comm(graph.nodes[n], opts) and graph.nodes[n].out_bytes > 0:
                units.producers.append((i, graph.nodes[n].out_bytes, outside))
    units.edges = sorted({(unit[u], unit[v]) for u, v in graph.edges if u in unit and v in unit and unit[u] != unit[v]})
    return units


def coarsen(graph: CostGraph, opts: CostOptions, target: int = 300, deadline: float = math.inf,
            most: float = 0.2) -> Units:
    """Units for the solver: one per node if the graph is small, else merged groups.

    Past ``deadline`` (``time.monotonic()``) no further merge round starts: the
    groups so far are valid units, only more of them. A merge makes a unit of at
    most ``most`` x sum C / K of compute (a stage on one device runs about sum C / K).
    """
    names = model_nodes(graph, opts)
    if len(names) <= target:
        return build_units(graph, opts, [[n] for n in names])
    merger = _Merger(graph, names, opts)
    merger.merge_zero_cost(target)
    ideal = graph.total_compute_s() / opts.devices
    for merge in (merger.merge_modules, merger.merge_chains):  # whole modules before chains cross them
        cap = 0.05 * ideal
        while len(merger.items) > target and cap <= most * ideal and time.monotonic() < deadline:
            merge(target, cap)
            cap *= 2
    return build_units(graph, opts, merger.groups())


class _Merger:
    """Union of nodes along single edges, keeping predecessor/successor sets of groups."""

    def __init__(self, graph: CostGraph, names: List[str], opts: CostOptions) -> None:
        self.graph = graph
        self.order = {n: i for i, n in enumerate(names)}
        self.head = {n: n for n in names}
        self.items: Dict[str, List[str]] = {n: [n] for n in names}
        self.pred: Dict[str, Set[str]] = {n: set() for n in names}
        self.succ: Dict[str, Set[str]] = {n: set() for n in names}
        for u, v in graph.edges:
            if u in self.order and v in self.order:
                self.succ[u].add(v)
                self.pred[v].add(u)
        self.cost = {n: graph.nodes[n].compute_s for n in names}
        self.fixed = {n for n in names if graph.nodes[n].is_input or graph.nodes[n].op == "output"}

    def groups(self) -> List[List[str]]:
        heads = sorted(self.items, key=lambda h: min(self.order[n] for n in self.items[h]))
        return [sorted(self.items[h], key=self.order.__getitem__) for h in heads]

    def _merge(self, a: str, b: str) -> str:
        """Merge group ``b`` into ``a`` (caller guarantees the edge between them is the only path)."""
        for n in self.items.pop(b):
            self.head[n] = a
            self.items[a].append(n)
        for x in self.pred.pop(b):
            self.succ[x].discard(b)
            if x != a:
                self.succ[x].add(a)
                self.pred[a].add(x)
        for x in self.succ.pop(b):
            self.pred[x].discard(b)
            if x != a:
                self.pred[x].add(a)
                self.succ[a].add(x)
        self.pred[a].discard(a)
        self.succ[a].discard(a)
        self.cost[a] += self.cost.pop(b)
        return a

    def merge_zero_cost(self, target: int) -> None:
        for n in list(self.order):
            if len(self.items) <= target:
                return
            node = self.graph.nodes[n]
            if n in self.fixed or n not in self.items or node.compute_s > 0 or node.param_bytes > 0:
                continue
            if len(self.pred[n]) == 1 and next(iter(self.pred[n])) not in self.fixed:
                self._merge(next(iter(self.pred[n])), n)
            elif len(self.succ[n]) == 1 and next(iter(self.succ[n])) not in self.fixed:
                self._merge(next(iter(self.succ[n])), n)

    def merge_modules(self, target: int, cap: float) -> None:
        """Merge each module subtree's groups into one, deepest modules first (see the module docstring)."""
        prefix = {h: self._module_of(h) for h in self.items}
        for depth in range(max((len(p) for p in prefix.values()), default=0), 0, -1):
            buckets: Dict[Tuple[str, ...], List[str]] = {}
            for h, path in prefix.items():
                if len(path) >= depth and h not in self.fixed:  # merged heads left ``prefix``
                    buckets.setdefault(path[:depth], []).append(h)
            for module, heads in buckets.items():
                if len(self.items) <= target:
                    return
                if len(heads) < 2 or sum(self.cost[h] for h in heads) > cap or not self._convex(set(heads)):
                    continue
                heads.sort(key=lambda h: min(self.order[n] for n in self.items[h]))
                for h in heads[1:]:
                    self._merge(heads[0], h)
                    prefix.pop(h, None)
                prefix[heads[0]] = module

    def _module_of(self, head: str) -> Tuple[str, ...]:
        """The deepest module holding every node of the group (() if none)."""
        paths = [tuple(filter(None, self.graph.nodes[n].module_path.split("."))) for n in self.items[head]]
        common = paths[0]
        for p in paths[1:]:
            k = 0
            while k < min(len(common), len(p)) and common[k] == p[k]:
                k += 1
            common = common[:k]
        return common

    def _convex(self, heads: Set[str]) -> bool:
        """No path from the set through a group outside it back into the set."""
        stack = [x for h in heads for x in self.succ[h] if x not in heads]
        seen = set(stack)
        while stack:
            for x in self.succ[stack.pop()]:
                if x in heads:
                    return False
                if x not in seen:
                    seen.add(x)
                    stack.append(x)
        return True

    def merge_chains(self, target: int, cap: float) -> None:
        heap = []
        for u in self.items:
            for v in self.succ[u]:
                heap.append((self.cost[u] + self.cost[v], u, v))
        heapq.heapify(heap)
        while heap and len(self.items) > target:
            cost, u, v = heapq.heappop(heap)
            if u not in self.items or v not in self.items or v not in self.succ[u]:
                continue
            if cost != self.cost[u] + self.cost[v] or cost > cap:
                continue
            if u in self.fixed or v in self.fixed or len(self.succ[u]) != 1 or len(self.pred[v]) != 1:
                continue
            a = self._merge(u, v)
            for x in self.pred[a]:
                heapq.heappush(heap, (self.cost[x] + self.cost[a], x, a))
            for x in self.succ[a]:
                heapq.heappush(heap, (self.cost[a] + self.cost[x], a, x))


def to_nodes(graph: CostGraph, units: Units, stage_of: List[int]) -> Dict[str, int]:
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
