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
  recorded gradient, asking only for the parameters below its off-path
  edges (into their ``.grad``), so the node computes its weight outputs and
  nothing of the input path runs twice. One engine call per such node keeps
  the input path out of each call: from one node, the path below it would
  lead to the next node's parameters.
- Where two off-path edges lead to a common node (a parameter used by two
  operations on the input path, a transpose taken once and used twice), a
  call from the upper node would run the input path down to the lower one
  and count its share twice. Then ``W`` runs the backward from the roots
  again toward the parameters only: correct, but the input path runs a
  second time (known limitation; it costs what the split saved).

A stage that receives no value needing a gradient (the first stage) has no
input half: ``W`` is its whole backward. The sum over both halves equals
``torch.autograd.backward`` of the same roots up to summation order (a test
compares whole training runs in float64).

Cost: the walk in ``B`` and one engine start per node in ``W`` (each
walking the graph below it) made forward + split backward 1.16-1.34x forward
+ a whole backward on the runtime benchmark's stages, so the executor splits
stages made of Linear and convolution layers (and norms, embeddings) the
cheaper way ``fxpipe.runtime.deferred`` describes, and only the others here.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node


class WeightGrad:
    """The weight-gradient half of one microbatch's backward, ready to run once.

    ``frontier``: node -> the leaf tensors (parameters) below its off-path
    edges; ``captured``: node -> the gradients that reached it in ``B``.
    ``from_roots``: the overlapping case, run from ``roots`` instead.
    """

    def __init__(self, frontier: Dict[Node, List[torch.Tensor]], captured: Dict[Node, tuple],
                 roots: List[Tuple[torch.Tensor, torch.Tensor]], from_roots: bool = False) -> None:
        self.frontier, self.captured, self.roots = frontier, captured, roots
        self.from_roots = from_roots

    def run(self) -> None:
        if self.from_roots:
            leaves = list({id(v): v for vs in self.frontier.values() for v in vs}.values())
            torch.autograd.backward([r for r, _ in self.roots], [g for _, g in self.roots], inputs=leaves)
        else:
            for node, leaves in self.frontier.items():
                starts = [(GradientEdge(node, i), g) for i, g in enumerate(self.captured.get(node) or ())
                          if g is not None]
                if starts and leaves:
                    torch.autograd.backward([e for e, _ in starts], [g for _, g in starts], inputs=leaves)
            if self.roots:
                torch.autograd.backward([r for r, _ in self.roots], [g for _, g in self.roots])
        self.frontier, self.captured, self.roots = {}, {}, []


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
    leaves, overlap = _leaves_below(frontier, on_path)
    if overlap:  # see the module docstring: restarting at each node would double count
        return list(got), WeightGrad(leaves, {}, list(zip(roots, grads)), from_roots=True)
    off_roots = [(r, g) for r, g in zip(roots, grads) if r.grad_fn is None or not on_path[r.grad_fn][0]]
    return list(got), WeightGrad(leaves, captured, off_roots)


def _leaves_below(frontier: Dict[Node, List[Tuple[Node, int]]], graph: Dict[Node, Tuple[bool, tuple]]
                  ) -> Tuple[Dict[Node, List[torch.Tensor]], bool]:
    """Per frontier node, the leaves below its off-path edges; and whether two edges reach a common node."""
    owner: Dict[Node, int] = {}
    leaves: Dict[Node, List[torch.Tensor]] = {}
    overlap = False
    i = 0
    for node, off in frontier.items():
        mine = leaves[node] = []
        for child, _ in off:
            i += 1
            stack = [child]
            while stack:
                n = stack.pop()
                if owner.setdefault(n, i) != i:
                    overlap = True
                    continue
                if hasattr(n, "variable"):
                    mine.append(n.variable)
                stack.extend(c for c, _ in graph[n][1] if c is not None and owner.get(c) != i)
    return leaves, overlap


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
