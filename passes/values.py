"""What every node of a graph produces on one example run.

``ValueRecorder`` is an ``Interpreter`` that, like torch's ``ShapeProp``, runs
the graph once on example inputs and writes one typed record per node
(``meta.ValueMeta``), keeping every value. The profiler times nodes on those
values; the split reads the records to know what crosses a cut. Both use this
one recorder, so a node's record follows one rule (``value_spec``) whichever
pass wrote it last.

While it runs, it also watches tensor version counters to find which node
wrote into which storage (``ValueRun``): the split needs the writes because a
value that crosses a stage boundary is shared with its consumer, and a later
in-place op in the producing stage would otherwise change what the consumer
reads (see ``passes.split``). A version counter is shared by a tensor and all
its views, so watching it catches every write the example run makes, including
those of modules and methods whose aliasing no op schema describes
(``nn.ReLU(inplace=True)``, ``x.add_``, ``x[i] = y``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.fx
from torch.utils import _pytree as pytree

from passes import meta
from passes.errors import FxpipeError

__all__ = ["COMPUTE_OPS", "ValueRecorder", "ValueRun", "value_bytes", "value_spec"]

COMPUTE_OPS = ("call_module", "call_function", "call_method")  # nodes that run code; the others pass values on
_CONSTANT_LEAVES = (int, float, bool, str, type(None), torch.Size, torch.dtype, torch.device)


def value_spec(value: Any) -> Any:
    """The ``ValueMeta.spec`` of a runtime value.

    Only exact tuples, lists and dicts are opened: the split sends a container
    leaf by leaf and rebuilds it with its type, so anything else (a namedtuple
    such as ``torch.max``'s result, a dict subclass such as an HF
    ``ModelOutput``) stays one opaque ``"<type name>"`` leaf.
    """
    if isinstance(value, torch.Tensor):
        return meta.TensorMeta(tuple(int(s) for s in value.shape), str(value.dtype), bool(value.requires_grad))
    if type(value) in (tuple, list):
        return type(value)(value_spec(v) for v in value)
    if type(value) is dict:
        return {k: value_spec(v) for k, v in value.items()}
    if isinstance(value, _CONSTANT_LEAVES):
        return value
    return f"<{type(value).__name__}>"


def value_bytes(value: Any) -> int:
    """Bytes of the tensors in a runtime value, inside any tuple, list or dict (subclasses too).

    What producing the value moves, whether or not the split can send it
    piece by piece: a namedtuple's tensors count although its spec is opaque.
    """
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(value_bytes(v) for v in value.values())
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return sum(value_bytes(v) for v in value)
    return 0


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


def node_failed(who: str, n: torch.fx.Node, exc: BaseException) -> str:
    """The one-line message for a node that raised on the example inputs."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{who}: node '{n.name}' ({n.op} {n.target}) failed on the example inputs: {type(exc).__name__}: {first}"


class ValueRecorder(torch.fx.Interpreter):
    """Runs a graph once, keeping every value (``env``), writing ``ValueMeta``, noting writes (``run``).

    ``error`` turns a node that raised into the caller's error (its pass's
    ``FxpipeError`` subclass, its wording); the original is chained. Values
    are kept alive to the end, which also keeps storages, and so their keys,
    unique.
    """

    def __init__(self, gm: torch.fx.GraphModule,
                 error: Callable[[torch.fx.Node, Exception], FxpipeError]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.error = error
        self.run_info = ValueRun()

    def run_node(self, n: torch.fx.Node) -> Any:
        before = [(key, t, _version(t)) for v in n.all_input_nodes for key, t in _storage_keys(self.env.get(v))]
        try:
            result = super().run_node(n)
        except Exception as exc:  # noqa: BLE001 - re-raised as the caller's error, naming the node
            raise self.error(n, exc) from exc
        written = {key for key, t, ver in before if ver is not None and _version(t) != ver}
        if written:
            self.run_info.writes[n] = written
        self.run_info.order[n] = len(self.run_info.order)
        self.run_info.keys[n] = {key for key, _ in _storage_keys(result)}
        meta.put(n, meta.ValueMeta(value_spec(result)))
        return result
