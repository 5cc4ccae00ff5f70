"""Symbolic tracing into torch.nn's composite modules (Transformer*, MultiheadAttention).

Why: ``torch.fx`` keeps every torch.nn module a leaf, so a model built on
``nn.TransformerEncoder`` is captured as one node and its layers can never be
put on different pipeline stages. Tracing into these modules meets Python
control flow on tensor *metadata*: ``src.dim() != 3``, ``mask.dtype``,
``len(src.size())``, the shape asserts of ``F.multi_head_attention_forward``.
Plain symbolic tracing refuses all of it, though every answer is fixed once
the input shapes and dtypes are.

``ShapeAnsweringTracer`` answers those questions from the example inputs: when
a traced value is used as a bool, a length or an iterable, it runs the graph
built so far on the example inputs (lazily: only when asked, each node once)
and uses the concrete value. It answers only

- inside one of the ``TRACED_INTO`` modules (user code keeps fx's rules: a
  data-dependent ``if`` there still fails and names the module), and
- for values computed from shapes, dtypes and devices alone, never from tensor
  data (``mask.dtype != torch.bool`` is answered, ``(mask == m).all()`` is not).

The graph is thereby specialised to the example's ranks and dtypes, as
``torch.export`` is. Four torch internals are adjusted while tracing
(``torch_nn_patches``):

- causal-mask detection compares mask *data*; with a traced mask it returns
  the caller's hint (``is_causal is True``), so attention applies the mask
  explicitly instead of the causal kernel: the same function;
- ``F._none_or_dtype`` rejects anything but a tensor; for a traced value it
  returns its dtype;
- ``F.multi_head_attention_forward`` would be recorded as one opaque call
  (proxies implement ``__torch_function__``); it runs with that dispatch off,
  so its input projection, attention and output projection become nodes;
- ``torch._check_with`` (its shape checks) insists on a Python bool: a traced
  condition is answered first.
"""
from __future__ import annotations

import builtins
import contextlib
import inspect
import types
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.modules.transformer as nn_transformer
from torch.fx.node import map_arg

__all__ = ["TRACED_INTO", "ShapeAnsweringTracer", "torch_nn_patches"]

# torch.nn modules whose forward is traced (fx keeps every other torch.nn module a leaf;
# nn.Sequential is traced by fx itself, ModuleList/ModuleDict are never called)
TRACED_INTO = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.MultiheadAttention,
)

_META_METHODS = frozenset({
    "dim", "ndimension", "size", "numel", "nelement", "is_floating_point", "is_complex",
    "is_contiguous", "element_size", "get_device", "stride",
})
_META_ATTRS = frozenset({
    "shape", "dtype", "device", "ndim", "is_nested", "is_sparse", "is_cuda", "is_meta",
    "layout", "is_quantized", "requires_grad", "type",
})
_META_FUNCTIONS = (torch.is_floating_point, torch.is_complex, torch.numel)
_UNKNOWN = object()  # a value the example run could not compute


class _Answerable:
    """``len()``, ``int()`` and ``float()`` the tracer may answer (fx's proxies refuse them)."""

    def __len__(self) -> int:
        return self.tracer.concrete(self, len)  # type: ignore[attr-defined]

    def __int__(self) -> int:
        return self.tracer.concrete(self, int)  # type: ignore[attr-defined]

    def __float__(self) -> float:
        return self.tracer.concrete(self, float)  # type: ignore[attr-defined]


class _Proxy(_Answerable, torch.fx.Proxy):
    def __getattr__(self, k: str) -> "torch.fx.proxy.Attribute":
        return _Attribute(self, k)


class _Attribute(_Answerable, torch.fx.proxy.Attribute):
    pass


class ShapeAnsweringTracer(torch.fx.Tracer):
    """Traces into ``TRACED_INTO`` modules, answering their shape questions (module doc).

    Without ``example_inputs`` it behaves as ``torch.fx.Tracer`` (those modules stay leaves).
    """

    def __init__(self, example_inputs: Optional[Sequence[Any]] = None) -> None:
        super().__init__()
        self.example_inputs = None if example_inputs is None else tuple(example_inputs)
        self.module_stack_objs: List[nn.Module] = []
        self._shape_only: Set[torch.fx.Node] = set()
        self._values: Dict[torch.fx.Node, Any] = {}
        self._placeholders: Dict[str, Any] = {}
        self._evaluating = False

    # ------------------------------------------------------------ which modules, which values

    def traces_into(self, m: nn.Module, path: str = "") -> bool:
        return self.example_inputs is not None and isinstance(m, TRACED_INTO)

    def traces_into_any(self, root: nn.Module) -> bool:
        """Will tracing ``root`` go into one of ``TRACED_INTO`` (not hidden inside a leaf)?"""
        leaves: tuple = ()
        for path, m in root.named_modules():
            if path.startswith(leaves):
                continue
            if self.traces_into(m, path):
                return True
            if path and self.is_leaf_module(m, path):
                leaves += (path + ".",)
        return False

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not self.traces_into(m, module_qualified_name) and super().is_leaf_module(m, module_qualified_name)

    def _in_scope(self) -> bool:
        inner = self.module_stack_objs[-1] if self.module_stack_objs else getattr(self, "root", None)
        return isinstance(inner, TRACED_INTO)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _Proxy(node, self)

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **kw: Any) -> Any:
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw)
        if _shape_only(proxy.node, self._shape_only):
            self._shape_only.add(proxy.node)
        return proxy

    # ------------------------------------------------------------ fx hooks

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if self._evaluating:  # running a leaf on example values: no graph, no proxies
            return forward(*args, **kwargs)
        self.module_stack_objs.append(m)
        result = super().call_module(m, forward, args, kwargs)
        self.module_stack_objs.pop()  # not on failure: the innermost module is the one that failed
        return result

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: Dict[str, Any]) -> Any:
        if self._evaluating:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        value = self._answer(obj)
        return super().to_bool(obj) if value is _UNKNOWN else bool(value)

    def iter(self, obj: torch.fx.Proxy) -> Iterator:
        value = self._answer(obj)
        if value is _UNKNOWN:
            return super().iter(obj)
        return iter([obj[i] for i in range(len(value))])

    def concrete(self, obj: torch.fx.Proxy, convert: Any) -> Any:
        value = self._answer(obj)
        if value is not _UNKNOWN:
            return convert(value)
        if convert is len:
            return torch.fx.Proxy.__len__(obj)  # raises fx's own error
        raise TypeError(f"{convert.__name__}() of a traced value: symbolic tracing cannot answer it here")

    def trace(self, root: Any, concrete_args: Optional[Dict[str, Any]] = None) -> torch.fx.Graph:
        if not isinstance(root, nn.Module) or not self.traces_into_any(root):
            return super().trace(root, concrete_args)
        self._placeholders = _bind_inputs(root, self.example_inputs)
        with _keep_state(root), torch_nn_patches():
            try:
                graph = super().trace(root, concrete_args)
            finally:
                self._values.clear()
        self._drop_answered_questions(graph)
        return graph

    def _drop_answered_questions(self, graph: torch.fx.Graph) -> None:
        """Erase unused shape-only nodes (the questions answered while tracing, ``src.dim() != 3``).

        They are pure, and left in they would tie a stage to tensors it does not use.
        """
        for node in reversed(list(graph.nodes)):
            if node in self._shape_only and not node.users:
                graph.erase_node(node)

    # ------------------------------------------------------------ the example run

    def _answer(self, proxy: torch.fx.Proxy) -> Any:
        node = proxy.node
        if not self._in_scope() or node not in self._shape_only:
            return _UNKNOWN
        value = self._value(node)
        return _UNKNOWN if isinstance(value, torch.Tensor) else value

    def _value(self, node: torch.fx.Node) -> Any:
        """Run every node not run yet, in graph order (that is eager order), up to ``node``."""
        self._evaluating = True
        try:
            for n in node.graph.nodes:
                if n not in self._values:
                    self._values[n] = self._run(n)
                if n is node:
                    break
        finally:
            self._evaluating = False
        return self._values[node]

    def _run(self, n: torch.fx.Node) -> Any:
        if n.op == "placeholder":
            return self._placeholders.get(str(n.target).lstrip("*"), _UNKNOWN)
        if n.op == "get_attr":
            return _fetch(self.root, str(n.target))
        if n.op not in ("call_function", "call_method", "call_module"):
            return _UNKNOWN
        unknown = []
        args = map_arg(n.args, lambda a: _note(self._values.get(a, _UNKNOWN), unknown))
        kwargs = map_arg(n.kwargs, lambda a: _note(self._values.get(a, _UNKNOWN), unknown))
        if unknown:
            return _UNKNOWN
        try:
            if n.op == "call_function":
                return n.target(*args, **kwargs)  # type: ignore[operator]
            if n.op == "call_method":
                return getattr(args[0], str(n.target))(*args[1:], **kwargs)
            return self.root.get_submodule(str(n.target))(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a value we cannot compute is just not answered
            return _UNKNOWN


def _note(value: Any, unknown: list) -> Any:
    if value is _UNKNOWN:
        unknown.append(True)
    return value


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, _UNKNOWN)
        if obj is _UNKNOWN:
            return _UNKNOWN
    return obj


def _shape_only(node: torch.fx.Node, known: Set[torch.fx.Node]) -> bool:
    """Is this value fixed by shapes, dtypes and devices alone (never by tensor data)?"""
    if node.op == "call_method" and node.target in _META_METHODS:
        return True
    if node.op != "call_function":
        return node.op == "call_method" and _inputs_shape_only(node, known)
    if node.target is builtins.getattr and len(node.args) > 1 and node.args[1] in _META_ATTRS:
        return True
    if node.target in _META_FUNCTIONS:
        return True
    return _inputs_shape_only(node, known)


def _inputs_shape_only(node: torch.fx.Node, known: Set[torch.fx.Node]) -> bool:
    inputs = node.all_input_nodes
    return bool(inputs) and all(n in known for n in inputs)


def _bind_inputs(root: nn.Module, inputs: Sequence[Any]) -> Dict[str, Any]:
    """Placeholder name -> example value (cloned: the example run must not change the caller's)."""
    try:
        bound = inspect.signature(root.forward).bind(*inputs)
    except TypeError:
        return {}
    bound.apply_defaults()
    clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return {k: torch.utils._pytree.tree_map(clone, v) for k, v in bound.arguments.items()}


@contextlib.contextmanager
def _keep_state(root: nn.Module) -> Iterator[None]:
    """The example run draws random numbers and may update buffers (BatchNorm): undo both."""
    from passes.capture_check import restore_buffers, save_buffers

    saved = save_buffers(root)
    devices = sorted({b.device.index or 0 for b in root.parameters() if b.is_cuda})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            restore_buffers(saved)


# ------------------------------------------------------------ torch internals adjusted while tracing


def _is_proxy(x: Any) -> bool:
    return isinstance(x, torch.fx.Proxy)


def _detect_is_causal_mask(mask: Any, is_causal: Optional[bool] = None, size: Optional[int] = None) -> bool:
    if _is_proxy(mask):
        return is_causal is True  # the mask is then applied as given: the same function
    return _ORIGINAL["detect"](mask, is_causal, size)


def _none_or_dtype(x: Any) -> Any:
    if _is_proxy(x):
        return x.dtype
    return _ORIGINAL["none_or_dtype"](x)


def _check_with(error_type: Any, cond: Any, message: Any = None) -> None:
    if _is_proxy(cond):
        cond = bool(cond)  # the tracer answers it (a shape check), or refuses
    _ORIGINAL["check_with"](error_type, cond, message)


def _without_dispatch(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with its ``has_torch_function`` check answering no: its body runs on proxies."""
    scope = dict(fn.__globals__)
    scope["has_torch_function"] = lambda *a, **k: False
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _multi_head_attention_forward(*args: Any, **kwargs: Any) -> Any:
    values = list(args) + list(kwargs.values())
    if any(_is_proxy(v) for v in values):
        return _ORIGINAL["mha_traced"](*args, **kwargs)
    return _ORIGINAL["mha"](*args, **kwargs)


_ORIGINAL: Dict[str, Any] = {
    "detect": nn_transformer._detect_is_causal_mask,
    "none_or_dtype": F._none_or_dtype,
    "mha": F.multi_head_attention_forward,
    "check_with": torch._check_with,
}


@contextlib.contextmanager
def torch_nn_patches() -> Iterator[None]:
    """Adjust the four torch internals of the module doc for the duration of a trace."""
    patches = [
        (nn_transformer, "_detect_is_causal_mask", _detect_is_causal_mask),
        (F, "_none_or_dtype", _none_or_dtype),
        (F, "multi_head_attention_forward", _multi_head_attention_forward),
        (torch, "_check_with", _check_with),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, new in patches:
            setattr(owner, name, new)
        if "mha_traced" not in _ORIGINAL:  # after the patches: its copy of F's globals has them
            _ORIGINAL["mha_traced"] = _without_dispatch(_ORIGINAL["mha"])
        yield
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)
