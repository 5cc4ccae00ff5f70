"""Split a stage-assigned graph into one GraphModule per pipeline stage.

``split_stages(gm, example_inputs)`` reads ``meta.StageAssign`` on every
compute node (the partitioner's ``apply_assignment`` writes it, or a user by
hand) and cuts the graph mechanically, like torch's ``split_module`` separates
the policy (which stage) from the mechanism (this module). Rules:

- placeholders become inputs of every stage that uses them (each rank can load
  the model's inputs); ``stage_inputs[j]`` lists which, in placeholder order.
- ``get_attr`` nodes are cloned into every stage that uses them, so a stage
  owns exactly the parameters and buffers it reads, and a parameter read in two
  stages (tied embeddings) is held by both: in-process they are the same
  ``Parameter`` object; ``tied`` records it so a runtime with separate copies
  sums its gradient over those stages. ``call_module`` nodes bring their module.
- the output node goes to the last stage.
- every value that crosses a boundary becomes ``passes.comm.send(value, tag,
  dst)`` at the end of its producer and ``passes.comm.recv(tag, src, shape,
  dtype, requires_grad)`` at the top of each consumer stage. A value is sent
  **directly to every stage that reads it, not relayed** through the stages in
  between: point-to-point transports reach any rank, and a relay would make the
  middle stages hold (for every microbatch in flight) and forward a value they
  never use, then relay its gradient back. Plain tuples, lists and dicts are
  sent leaf by leaf (each leaf gets its own tag, so a tensor leaf keeps its
  gradient) and rebuilt in the consumer; sizes and Python scalars are sent as
  values (``shape=None``).
- in-place ops: a sent value that its own stage later overwrites in place
  (after, in the original order, the consumer read it) is copied right before
  the write and the copy is sent (tag ``"<value>@v<k>:<src>-><dst>"``), so the
  consumer reads what it read in the original; writes that a pipeline cannot
  reproduce are rejected by name. See ``passes.split_check.plan_versions``.

Every stage returns ``(outputs, tokens)``: the original output structure on the
last stage (``None`` elsewhere) and the tuple of what its sends returned (the
contract in ``passes.comm``). Tags read ``"<value>:<src>-><dst>"``.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from passes import comm, meta
from passes.split_check import SplitError, Versions, check_assignment, plan_versions
from passes.split_values import ensure_value_meta, record_values
from passes.values import COMPUTE_OPS, ValueRun

Path = Tuple[Any, ...]

__all__ = ["CommEdge", "SplitError", "SplitResult", "graph_inputs", "leaves", "split_stages"]


@dataclass(frozen=True)
class CommEdge:
    """One value (leaf) sent from ``src_stage`` to ``dst_stage`` under ``tag``."""

    tag: str
    src_stage: int
    dst_stage: int
    value: meta.ValueMeta


@dataclass
class SplitResult:
    """What the split produced; ``fxpipe.SplitModel`` wraps it."""

    stages: List[torch.fx.GraphModule]
    stage_inputs: List[List[int]]
    comm: List[CommEdge]
    param_names: List[Dict[str, str]]
    tied: Dict[str, List[int]]
    aliases: Dict[str, str] = field(default_factory=dict)  # other name of a shared tensor -> canonical name
    in_spec: Any = None   # pytree specs when the graph came from torch.export
    out_spec: Any = None


def leaves(spec: Any, path: Path = ()) -> List[Tuple[Path, Any]]:
    """(path, leaf spec) of a value spec; plain tuples/lists/dicts are opened."""
    if type(spec) in (tuple, list):
        return [x for i, s in enumerate(spec) for x in leaves(s, path + (i,))]
    if type(spec) is dict:
        return [x for k, s in spec.items() for x in leaves(s, path + (k,))]
    return [(path, spec)]


def _rebuild(spec: Any, path: Path, nodes: Dict[Path, torch.fx.Node]) -> Any:
    if type(spec) in (tuple, list):
        return type(spec)(_rebuild(s, path + (i,), nodes) for i, s in enumerate(spec))
    if type(spec) is dict:
        return {k: _rebuild(s, path + (k,), nodes) for k, s in spec.items()}
    return nodes[path]


def _tag(node: torch.fx.Node, path: Path, src: int, dst: int, version: Optional[int] = None) -> str:
    at = "" if version is None else f"@v{version}"
    return f"{node.name}{''.join(f'[{p!r}]' for p in path)}{at}:{src}->{dst}"


def _grad_reach(gm: torch.fx.GraphModule) -> set:
    """Nodes downstream of a floating-point model input: their gradient may be wanted."""
    reach = set()
    for n in gm.graph.nodes:
        spec = meta.get(n, meta.ValueMeta, meta.ValueMeta(None)).spec
        if n.op == "placeholder" and (not isinstance(spec, meta.TensorMeta) or _is_float(spec.dtype)):
            reach.add(n)
        elif any(i in reach for i in n.all_input_nodes):
            reach.add(n)
    return reach


def _is_float(dtype: str) -> bool:
    return getattr(torch, dtype.split(".")[-1]).is_floating_point


class _StageBuilder:
    """Builds the graph of one stage; one instance per stage."""

    def __init__(self, gm: torch.fx.GraphModule, j: int, ctx: "_Context") -> None:
        self.gm, self.j, self.ctx = gm, j, ctx
        self.g = torch.fx.Graph()
        self.env: Dict[torch.fx.Node, Any] = {}
        self.older: Dict[Tuple[torch.fx.Node, int], Any] = {}  # (value, version) -> copy or recv of it
        self.inputs: List[int] = []
        self.edges: List[CommEdge] = []
        self.tokens: List[torch.fx.Node] = []
        self.items: Dict[Tuple[torch.fx.Node, Path], torch.fx.Node] = {}

    def used_here(self, n: torch.fx.Node) -> bool:
        return any(self.ctx.stage_of.get(u) == self.j for u in n.users)

    def build(self) -> torch.fx.GraphModule:
        nodes = list(self.gm.graph.nodes)
        for i, p in enumerate(n for n in nodes if n.op == "placeholder"):
            if self.used_here(p):
                self.env[p] = self._copy(p)
                self.inputs.append(i)
        for u in nodes:
            if self.j in self.ctx.dsts.get(u, ()):
                for version in self.ctx.versions.sends.get((u, self.j), [None]):
                    self._recv(u, version)
        for n in nodes:
            if n.op == "get_attr" and self.used_here(n):
                self.env[n] = self._copy(n)
            elif self.ctx.stage_of.get(n) == self.j and n.op in COMPUTE_OPS:
                for v, k in self.ctx.versions.copy_before.get(n, ()):
                    self.older[(v, k)] = self._node(torch.clone, (self.env[v],), f"{v.name}_v{k}")
                self.env[n] = self._copy(n)
        for u in nodes:
            for t in self.ctx.dsts.get(u, ()) if self.ctx.stage_of.get(u) == self.j else ():
                for version in self.ctx.versions.sends.get((u, t), [None]):
                    self._send(u, t, version)
        out = None
        if self.j == self.ctx.count - 1:
            out_node = next(n for n in nodes if n.op == "output")
            out = torch.fx.map_arg(out_node.args[0], lambda a: self.env[a])
        self.g.output((out, tuple(self.tokens)))
        self.g.lint()
        return torch.fx.GraphModule(self.gm, self.g, class_name=f"Stage{self.j}")

    def _arg(self, reader: torch.fx.Node, a: torch.fx.Node) -> Any:
        version = self.ctx.versions.read.get((reader, a))
        return self.env[a] if version is None else self.older[(a, version)]

    def _copy(self, n: torch.fx.Node) -> torch.fx.Node:
        new = self.g.node_copy(n, lambda a: self._arg(n, a))
        new.meta[meta.NAMESPACE] = dict(n.meta.get(meta.NAMESPACE, {}))  # do not share the dict with the original
        return new

    def _node(self, target: Any, args: tuple, name: str, kwargs: Optional[dict] = None) -> torch.fx.Node:
        return self.g.create_node("call_function", target, args, kwargs or {}, name=name)

    def _recv(self, u: torch.fx.Node, version: Optional[int]) -> None:
        src, spec = self.ctx.stage_of[u], meta.get(u, meta.ValueMeta).spec
        got: Dict[Path, torch.fx.Node] = {}
        for path, leaf in leaves(spec):
            tag = _tag(u, path, src, self.j, version)
            kwargs = {}
            if isinstance(leaf, meta.TensorMeta):
                needs_grad = leaf.requires_grad or (u in self.ctx.reach and _is_float(leaf.dtype))
                kwargs = {"shape": leaf.shape, "dtype": getattr(torch, leaf.dtype.split(".")[-1]),
                          "requires_grad": needs_grad}
            name = u.name + "".join(f"_{p}" for p in path) + ("" if version is None else f"_v{version}")
            got[path] = node = self._node(comm.recv, (tag, src), name, kwargs)
            meta.put(node, meta.ValueMeta(leaf))
            meta.put(node, meta.CommInfo("recv", tag, src, self.j, meta.ValueMeta(leaf)))
        if version is None:
            self.env[u] = _rebuild(spec, (), got)
        else:
            self.older[(u, version)] = _rebuild(spec, (), got)

    def _item(self, node: torch.fx.Node, path: Path, key: Any, u: torch.fx.Node) -> torch.fx.Node:
        """``node[key]``, made once per (container node, path) however many stages it goes to."""
        if (node, path) not in self.items:
            name = u.name + "".join(f"_{p}" for p in path)
            self.items[(node, path)] = self._node(operator.getitem, (node, key), name)
        return self.items[(node, path)]

    def _send(self, u: torch.fx.Node, t: int, version: Optional[int]) -> None:
        spec = meta.get(u, meta.ValueMeta).spec
        base = self.env[u] if version is None else self.older[(u, version)]
        for path, leaf in leaves(spec):
            node = base
            for k, p in enumerate(path):
                node = self._item(node, path[: k + 1], p, u)
            tag = _tag(u, path, self.j, t, version)
            tok = self._node(comm.send, (node, tag, t), f"send_{u.name}" + "".join(f"_{p}" for p in path))
            meta.put(tok, meta.CommInfo("send", tag, self.j, t, meta.ValueMeta(leaf)))
            self.tokens.append(tok)
            self.edges.append(CommEdge(tag, self.j, t, meta.ValueMeta(leaf)))


@dataclass
class _Context:
    stage_of: Dict[torch.fx.Node, int]
    count: int
    dsts: Dict[torch.fx.Node, List[int]]
    versions: Versions
    reach: set


def _destinations(stage_of: Dict[torch.fx.Node, int]) -> Dict[torch.fx.Node, List[int]]:
    dsts: Dict[torch.fx.Node, set] = defaultdict(set)
    for v, t in stage_of.items():
        for u in v.all_input_nodes:
            if u in stage_of and stage_of[u] != t and u.op in COMPUTE_OPS:
                dsts[u].add(t)
    return {u: sorted(ts) for u, ts in dsts.items()}


def _param_names(gm: torch.fx.GraphModule, stages: List[torch.fx.GraphModule]
                 ) -> Tuple[List[Dict[str, str]], Dict[str, List[int]], Dict[str, str]]:
    """Per stage local name -> the original's name; tied parameters; aliases.

    A tensor known under several names in the original (``lm_head.weight`` is
    ``tok.weight``) maps to its first name in ``named_parameters()`` order, the
    canonical one; ``aliases`` lists the others. A stage holding both users
    lists both local names, mapped to the one canonical name: whatever rebuilds
    the stage (stage files) must make them one tensor again, or one user's
    gradient is lost.
    """
    canon: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        first = canon.setdefault(id(t), name)
        if first != name:
            aliases[name] = first
    is_param = {id(p) for p in gm.parameters()}
    names: List[Dict[str, str]] = []
    holders: Dict[str, List[int]] = defaultdict(list)
    for j, st in enumerate(stages):
        local = {}
        for name, t in list(st.named_parameters(remove_duplicate=False)) + list(st.named_buffers(remove_duplicate=False)):
            if id(t) in canon:
                local[name] = canon[id(t)]
                if id(t) in is_param and j not in holders[canon[id(t)]]:
                    holders[canon[id(t)]].append(j)
        names.append(local)
    tied = {name: js for name, js in holders.items() if len(js) > 1}
    return names, tied, aliases


def _pytree_specs(gm: torch.fx.GraphModule) -> Tuple[Any, Any]:
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return (info.in_spec, info.out_spec) if info is not None else (None, None)


def graph_inputs(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> List[Any]:
    """The graph's placeholders' values: an export graph takes the model's inputs flattened."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None:
        return list(inputs)
    from torch.fx import _pytree as fx_pytree

    return list(fx_pytree.tree_flatten_spec((list(inputs), {}), info.in_spec))


def _check_opaque(stage_of: Dict[torch.fx.Node, int], run: Optional[ValueRun]) -> None:
    """Reject a crossing value that holds tensors inside a type the split cannot open.

    Only plain tuples/lists/dicts are sent leaf by leaf; anything else (a
    namedtuple such as ``torch.max``'s result, a dataclass) would travel as one
    object, and a runtime that moves tensors between processes would drop
    their gradients.
    """
    if run is None:
        return
    for u, dsts in _destinations(stage_of).items():
        spec = meta.get(u, meta.ValueMeta).spec
        if isinstance(spec, str) and run.keys.get(u):
            users = ", ".join(sorted(v.name for v in u.users if stage_of.get(v) in dsts))
            raise SplitError(f"split: '{u.name}' ({spec.strip('<>')}, holding tensors) would cross from stage "
                             f"{stage_of[u]} to stage {dsts[0]} ({users}); only tensors, sizes, scalars and "
                             f"plain tuples/lists/dicts can cross: put {users} in stage {stage_of[u]}, or "
                             "unpack the value in the model (a, b = ...)")


def split_stages(gm: torch.fx.GraphModule, example_inputs: Optional[Sequence[Any]] = None) -> SplitResult:
    """Cut ``gm`` into its stages (see the module docstring).

    ``example_inputs`` (the model's positional inputs, one microbatch) give
    shapes and let the split check in-place ops; without them the nodes must
    already carry shapes (``ValueMeta``, or export's ``val``).
    """
    stage_of, count = check_assignment(gm)
    run: Optional[ValueRun] = None
    if example_inputs is not None:
        run = record_values(gm, graph_inputs(gm, example_inputs))
    ensure_value_meta(gm)
    _check_opaque(stage_of, run)
    versions = plan_versions(stage_of, run)
    for m, pairs in versions.copy_before.items():
        for v, _ in pairs:
            if not meta.get(v, meta.ValueMeta).is_tensor:
                raise SplitError(f"split: in-place op '{m.name}' overwrites '{v.name}' (not a single tensor) "
                                 "after a later stage read it; make the op out-of-place")
    ctx = _Context(stage_of, count, _destinations(stage_of), versions, _grad_reach(gm))
    builders = [_StageBuilder(gm, j, ctx) for j in range(count)]
    stages = [b.build() for b in builders]
    names, tied, aliases = _param_names(gm, stages)
    in_spec, out_spec = _pytree_specs(gm)
    return SplitResult(stages=stages, stage_inputs=[b.inputs for b in builders],
                       comm=[e for b in builders for e in b.edges], param_names=names, tied=tied,
                       aliases=aliases, in_spec=in_spec, out_spec=out_spec)
