"""A stage's backward in two halves: input gradients now (``B``), weight gradients later (``W``).

Zero-bubble schedules send the gradient of a stage's inputs upstream as soon
as it exists and do the weight-gradient work where the rank would otherwise
wait. Both halves use the ordinary autograd graph of the forward:

- ``backward_input`` asks the engine only for the gradients of the received
  values. The engine runs just the nodes on paths to them, and a node asked
  for some of its outputs computes only those (a matmul's backward skips the
  weight's product), so this is the input-gradient work and no more. The
  graph is kept. On the way, a pre-hook records the gradient that reaches
  every node of that path from which an edge leaves the path (the edge leads
  to parameters only: a node that could reach a received value would be on
  the path itself).
- ``WeightGrad.run`` restarts the engine at each such node with its
  recorded gradient, asking only for its off-path edges, so the node computes
  its weight outputs and nothing of the input path runs twice; then one
  backward from all those edges accumulates into the parameters' ``.grad``.
  One engine call per such node keeps the input path out of each call: from
  one node, the path below it would lead to the next node's parameters.
- Where two such nodes share an off-path node (a parameter used by two
  operations on the input path, a transpose taken once and used twice), a
  call from the upper node would run the input path down to the lower one
  and count its share twice. Then ``W`` runs the backward from the roots
  again toward the parameters only: correct, but the input path runs a
  second time (known limitation; it costs what the split saved).

A stage that receives no value needing a gradient (the first stage) has no
input half: ``W`` is its whole backward. The sum over both halves equals
``torch.autograd.backward`` of the same roots up to summation order (a test
compares whole training runs in float64).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node


class WeightGrad:
    """The weight-gradient half of one microbatch's backward, ready to run once."""

    def __init__(self, frontier: Dict[Node, List[Tuple[Node, int]]], captured: Dict[Node, tuple],
                 roots: List[Tuple[torch.Tensor, torch.Tensor]], from_roots: bool = False) -> None:
        self.frontier, self.captured, self.roots = frontier, captured, roots
        self.from_roots = from_roots

    def run(self) -> None:
        edges, grads = self._from_roots() if self.from_roots else self._from_frontier()
        edges += [r for r, _ in self.roots if not self.from_roots]
        grads += [g for _, g in self.roots if not self.from_roots]
        if edges:
            torch.autograd.backward(edges, grads)
        self.frontier, self.captured, self.roots = {}, {}, []

    def _from_frontier(self) -> Tuple[list, list]:
        edges: list = []
        grads: list = []
        for node, off in self.frontier.items():
            starts = [(GradientEdge(node, i), g) for i, g in enumerate(self.captured.get(node) or ()) if g is not None]
            if not starts:
                continue
            wanted = [GradientEdge(child, nr) for child, nr in off]
            got = torch.autograd.grad([e for e, _ in starts], wanted, [g for _, g in starts], retain_graph=True,
                                      allow_unused=True)
            edges += [e for e, g in zip(wanted, got) if g is not None]
            grads += [g for g in got if g is not None]
        return edges, grads

    def _from_roots(self) -> Tuple[list, list]:
        """The parameters' gradients from the roots again: the input path runs a second time."""
        leaves = list({id(v): v for off in self.frontier.values() for c, _ in off
                       for v in _leaves(c)}.values())
        torch.autograd.backward([r for r, _ in self.roots], [g for _, g in self.roots], inputs=leaves)
        return [], []


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   inputs: Sequence[GradientEdge]) -> Tuple[List[Optional[torch.Tensor]], WeightGrad]:
    """Gradients of ``inputs`` (edges of the received values) from ``roots``; the rest for later.

    Without inputs, nothing runs now and the returned ``WeightGrad`` is the
    whole backward.
    """
    if not inputs:
        return [], WeightGrad({}, {}, list(zip(roots, grads)))
    on_path = _on_path([r.grad_fn for r in roots if r.grad_fn is not None], {e.node for e in inputs})
    targets = {e.node for e in inputs}
    frontier = {}
    for node, (on, children) in on_path.items():
        if on and node not in targets:
            off = [(c, nr) for c, nr in children if c is not None and not on_path[c][0]]
            if off:
                frontier[node] = off
    captured: Dict[Node, tuple] = {}
    hooks = [node.register_prehook(_recorder(captured, node)) for node in frontier]
    try:
        got = torch.autograd.grad(list(roots), list(inputs), list(grads), retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    if _overlap(frontier, on_path):  # see the module docstring: restarting at each node would double count
        return list(got), WeightGrad(frontier, {}, list(zip(roots, grads)), from_roots=True)
    off_roots = [(r, g) for r, g in zip(roots, grads) if r.grad_fn is None or not on_path[r.grad_fn][0]]
    return list(got), WeightGrad(frontier, captured, off_roots)


def _overlap(frontier: Dict[Node, List[Tuple[Node, int]]], graph: Dict[Node, Tuple[bool, tuple]]) -> bool:
    """Whether two off-path edges of the frontier lead to a common node (then one would count the other's share)."""
    owner: Dict[Node, int] = {}
    edges = [c for off in frontier.values() for c, _ in off]
    for i, child in enumerate(edges):
        stack = [child]
        while stack:
            n = stack.pop()
            if owner.setdefault(n, i) != i:
                return True
            stack.extend(c for c, _ in graph[n][1] if c is not None and owner.get(c) != i)
    return False


def _leaves(node: Node) -> List[torch.Tensor]:
    """The tensors whose gradient accumulators lie at or below ``node``."""
    out, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):
            out.append(n.variable)
        stack.extend(c for c, _ in n.next_functions if c is not None)
    return out


def _recorder(store: Dict[Node, tuple], node: Node):
    def hook(grad_outputs: tuple) -> None:
        store[node] = grad_outputs
    return hook


def _on_path(roots: List[Node], targets: set) -> Dict[Node, Tuple[bool, tuple]]:
    """For every node reachable from ``roots``: (whether it reaches a target, its next edges).

    Iterative depth-first search (a deep stage would overflow Python's
    recursion); targets are not expanded (below a received value lies only
    its anchor).
    """
    seen: Dict[Node, Tuple[bool, tuple]] = {}
    stack = [(n, False) for n in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            children = seen[node][1]
            seen[node] = (node in targets or any(c is not None and seen[c][0] for c, _ in children), children)
            continue
        if node in seen:
            continue
        children = () if node in targets else node.next_functions
        seen[node] = (False, children)
        stack.append((node, True))
        stack.extend((c, False) for c, _ in children if c is not None and c not in seen)
    return seen
