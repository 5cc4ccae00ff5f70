"""What the split needs to know about values: their shapes, and in-place writes.

``record_values`` runs the graph once on the example inputs (an
``Interpreter`` that, like torch's ``ShapeProp``, writes one typed record per
node: ``meta.ValueMeta``) and at the same time watches tensor version counters
to find which node wrote into which storage. The split needs the writes because
a value that crosses a stage boundary is shared with its consumer: a later
in-place op in the producing stage would otherwise change what the consumer
reads (see ``passes.split``).

Why run it instead of reading op schemas: symbolic_trace graphs call modules
and methods (``nn.ReLU(inplace=True)``, ``x.add_``, ``x[i] = y``) whose aliasing
no schema describes, and views make a write to one value a write to another.
A version counter is shared by a tensor and all its views, so watching it
catches every case the example run takes.

Without example inputs, shapes come from what capture left on the nodes
(``ValueMeta``, export's fake ``val``, or ``tensor_meta``) and no write analysis
is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
from torch.utils import _pytree as pytree

from passes import meta
from passes.capture_check import restore_buffers, save_buffers
from passes.errors import FxpipeError

_CONSTANT_LEAVES = (int, float, bool, str, type(None), torch.Size, torch.dtype, torch.device)


class ShapePropError(FxpipeError):
    """The graph failed on the example inputs, or a node has no shape record."""


def value_spec(value: Any) -> Any:
    """The ``ValueMeta.spec`` of a runtime value.

    Unlike ``passes.profile.value_spec`` only exact tuples, lists and dicts are
    opened: the split sends a container leaf by leaf and rebuilds it with its
    type, so a dict subclass (an HF ``ModelOutput``) must stay one opaque value.
    """
    if isinstance(value, torch.Tensor):
        return meta.TensorMeta(tuple(int(s) for s in value.shape), str(value.dtype), bool(value.requires_grad))
    if type(value) in (tuple, list):
        return type(value)(value_spec(v) for v in value)
    if type(value) is dict:
        return {k: value_spec(v) for k, v in value.items()}
    if isinstance(value, _CONSTANT_LEAVES):
        return value
    if isinstance(value, torch.SymInt):
        return "<SymInt>"
    return f"<{type(value).__name__}>"


@dataclass
class ValueRun:
    """In-place writes seen on the example run.

    ``order``: node -> position in graph order; ``keys``: node -> storages its
    value lives in; ``writes``: node -> storages it wrote into.
    """

    order: Dict[torch.fx.Node, int] = field(default_factory=dict)
    keys: Dict[torch.fx.Node, Set[int]] = field(default_factory=dict)
    writes: Dict[torch.fx.Node, Set[int]] = field(default_factory=dict)


def _storage_keys(value: Any) -> List[Tuple[int, torch.Tensor]]:
    out = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            try:
                key = leaf.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if key:
                out.append((key, leaf))
    return out


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, run: ValueRun) -> None:
        super().__init__(gm, garbage_collect_values=False)  # keep storages alive: keys stay unique
        self.run_info = run

    def run_node(self, n: torch.fx.Node) -> Any:
        before = []
        for v in n.all_input_nodes:
            for key, t in _storage_keys(self.env.get(v)):
                before.append((key, t, _version(t)))
        try:
            result = super().run_node(n)
        except Exception as exc:  # noqa: BLE001 - re-raised with the node's name
            raise ShapePropError(f"split: node '{n.name}' ({n.format_node()}) failed on the example inputs: "
                                 f"{type(exc).__name__}: {exc}") from exc
        written = {key for key, t, ver in before if ver is not None and _version(t) != ver}
        if written:
            self.run_info.writes[n] = written
        self.run_info.order[n] = len(self.run_info.order)
        self.run_info.keys[n] = {key for key, _ in _storage_keys(result)}
        if n.op != "output":
            meta.put(n, meta.ValueMeta(value_spec(result)))
        return result


def record_values(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> ValueRun:
    """Run ``gm`` on ``example_inputs``; write ``ValueMeta`` on every node."""
    run = ValueRun()
    saved = save_buffers(gm)  # BatchNorm running stats: this run must not change the model
    try:
        with torch.enable_grad():
            _Recorder(gm, run).run(*example_inputs)
    finally:
        restore_buffers(saved)
    return run


def _spec_from_val(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return meta.TensorMeta(tuple(int(s) for s in val.shape), str(val.dtype), bool(val.requires_grad))
    if type(val) in (tuple, list):
        return type(val)(_spec_from_val(v) for v in val)
    return value_spec(val)


def ensure_value_meta(gm: torch.fx.GraphModule) -> None:
    """Fill ``ValueMeta`` from capture's records; name the first node without any."""
    for n in gm.graph.nodes:
        if n.op == "output" or meta.has(n, meta.ValueMeta):
            continue
        if "val" in n.meta:
            meta.put(n, meta.ValueMeta(_spec_from_val(n.meta["val"])))
        elif "tensor_meta" in n.meta and hasattr(n.meta["tensor_meta"], "shape"):
            tm = n.meta["tensor_meta"]
            meta.put(n, meta.ValueMeta(meta.TensorMeta(tuple(tm.shape), str(tm.dtype), bool(tm.requires_grad))))
        elif n.op not in ("get_attr", "placeholder") and n.users:
            raise ShapePropError(f"split: node '{n.name}' has no shape record: pass example_inputs to "
                                 "split_stages(...) (or run passes.profile first)")
