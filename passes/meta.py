"""The one accessor for fxpipe's node metadata.

Every pass records its results in ``node.meta["fxpipe"]``, a dict from a short
key to one frozen dataclass per concern. The key is the dataclass's ``KEY``
class attribute, so a record is always stored under the same name and a pass
cannot invent a new top-level ``node.meta`` key (torch's own ``tensor_meta``,
``val`` and ``nn_module_stack`` stay where torch puts them).

Graph-wide records (how the graph was captured, the profile settings) live the
same way in ``graph_module.meta["fxpipe"]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Tuple, Type, TypeVar, Union

import torch.fx

from passes.errors import FxpipeError

NAMESPACE = "fxpipe"

T = TypeVar("T")


class MissingMetadataError(FxpipeError):
    """A pass needs a record that an earlier pass should have written."""


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class ModuleInfo:
    """Which ``nn.Module`` (dotted path from the root) a node came from."""

    KEY: ClassVar[str] = "module"
    path: str


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and autograd flag of one tensor value."""

    shape: Tuple[int, ...]
    dtype: str  # e.g. "torch.float32"
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        import torch

        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=getattr(torch, self.dtype.split(".")[-1])).element_size()


@dataclass(frozen=True)
class ValueMeta:
    """What a node produces: a pytree whose tensor leaves are ``TensorMeta``.

    ``spec`` is a nested structure of tuples/lists/dicts; leaves that are not
    tensors are kept as their Python value when it is a small constant (int,
    float, bool, str, None, torch.Size) and otherwise as the string
    ``"<type name>"``.
    """

    KEY: ClassVar[str] = "value"
    spec: Any

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.spec, TensorMeta)

    def tensors(self) -> Tuple[TensorMeta, ...]:
        out = []

        def walk(x: Any) -> None:
            if isinstance(x, TensorMeta):
                out.append(x)
            elif isinstance(x, (tuple, list)):
                for y in x:
                    walk(y)
            elif isinstance(x, dict):
                for y in x.values():
                    walk(y)

        walk(self.spec)
        return tuple(out)


@dataclass(frozen=True)
class NodeCost:
    """Measured cost of one node (written by ``passes.profile``).

    Times are seconds. ``param_bytes`` counts only the parameters this node
    owns: a parameter used by several nodes is owned by its first user in
    graph order, and every user lists it in ``shared_params``.
    """

    KEY: ClassVar[str] = "cost"
    fwd_s: float
    bwd_s: float
    out_bytes: int
    param_bytes: int
    params: Tuple[str, ...] = ()
    shared_params: Tuple[str, ...] = ()
    peak_mem_bytes: Optional[int] = None


@dataclass(frozen=True)
class StageAssign:
    """The pipeline stage a node runs in (written by the partitioner)."""

    KEY: ClassVar[str] = "stage"
    stage: int


@dataclass(frozen=True)
class CommInfo:
    """A generated communication node (written by ``passes.split``).

    ``tag`` is stable across runs: it names the value that crosses, so the
    runtime can match a send with its receive on another process.
    """

    KEY: ClassVar[str] = "comm"
    direction: str  # "send" | "recv"
    tag: str
    src_stage: int
    dst_stage: int
    value: ValueMeta


@dataclass(frozen=True)
class CaptureInfo:
    """Graph-wide: how the graph was captured (``gm.meta['fxpipe']``)."""

    KEY: ClassVar[str] = "capture"
    method: str  # "fx" | "export"
    fx_error: Optional[str] = None
    # the model's own state_dict keys: the graph may hold more tensors (constants the trace made,
    # ``_tensor_constant0``), which a state_dict for the original model must leave out
    state_keys: Tuple[str, ...] = ()


@dataclass(frozen=True)
class ProfileInfo:
    """Graph-wide: the settings a profile was taken with."""

    KEY: ClassVar[str] = "profile"
    device: str
    repeats: int
    batch_size: Optional[int]
    torch_version: str
    whole_fwd_s: float = 0.0
    whole_bwd_s: float = 0.0
    clock: str = ""  # what timed the nodes: "thread CPU time", "wall time" or "cuda events (host clock for ...)"
    precision: str = "fp32"  # the autocast the nodes ran under: fp32 (none), bf16 or fp16


Record = Union[ModuleInfo, ValueMeta, NodeCost, StageAssign, CommInfo, CaptureInfo, ProfileInfo]

# ---------------------------------------------------------------- accessor

_MISSING = object()


def _space(holder: Union[torch.fx.Node, torch.fx.GraphModule]) -> dict:
    return holder.meta.setdefault(NAMESPACE, {})


def put(holder: Union[torch.fx.Node, torch.fx.GraphModule], record: Any) -> None:
    """Store ``record`` under its class's ``KEY`` on a node or a GraphModule."""
    _space(holder)[type(record).KEY] = record


def get(
    holder: Union[torch.fx.Node, torch.fx.GraphModule],
    record: Type[T],
    default: Any = _MISSING,
) -> T:
    """The record of type ``record``; ``default`` (or ``KeyError``) if absent."""
    value = holder.meta.get(NAMESPACE, {}).get(record.KEY, _MISSING)  # type: ignore[attr-defined]
    if value is _MISSING:
        if default is _MISSING:
            raise KeyError(f"node has no fxpipe '{record.KEY}' record")  # type: ignore[attr-defined]
        return default
    return value


def has(holder: Union[torch.fx.Node, torch.fx.GraphModule], record: Type[Any]) -> bool:
    return record.KEY in holder.meta.get(NAMESPACE, {})


def drop(holder: Union[torch.fx.Node, torch.fx.GraphModule], record: Type[Any]) -> None:
    holder.meta.get(NAMESPACE, {}).pop(record.KEY, None)


def require(gm: torch.fx.GraphModule, record: Type[Any], *, needed_by: str, made_by: str,
            what: Optional[str] = None, exempt: Optional[Callable[[torch.fx.Node], bool]] = None) -> None:
    """Raise a clear error unless every node of ``gm`` that computes has a ``record``.

    Placeholders and the output node are exempt (passes annotate computation),
    and so is any node ``exempt`` says; ``what`` names the metadata for the
    user ("costs"), else its key.
    """
    missing = [n.name for n in gm.graph.nodes
               if n.op not in ("placeholder", "output") and not (exempt and exempt(n)) and not has(n, record)]
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise MissingMetadataError(
            f"{needed_by} needs {what or repr(record.KEY)}: run {made_by} first "
            f"({len(missing)} nodes have no '{record.KEY}' record: {shown})")


@dataclass(frozen=True)
class PartitionRecord:
    """Graph-wide: the partitioner's answer (``passes.partition.PartitionResult``)."""

    KEY: ClassVar[str] = "partition"
    result: Any


@dataclass(frozen=True)
class SplitRecord:
    """Graph-wide: the split's answer (``passes.split.SplitResult``)."""

    KEY: ClassVar[str] = "split"
    result: Any
