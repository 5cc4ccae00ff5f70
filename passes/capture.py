"""Capture a model as a ``torch.fx.GraphModule``: symbolic tracing first, export second.

``torch.fx.symbolic_trace`` is fast and keeps ``nn.Module`` calls as single
nodes, but cannot see through data-dependent control flow and fails on current
HF transformers models; ``torch.export`` (non-strict) captures those. Its
``.module()`` is a GraphModule of ATen-level calls whose parameters appear as
``get_attr`` nodes. Both kinds of graph are first-class: every later pass must
accept either, so this pass normalises what they share:

- every compute node carries ``meta.ModuleInfo`` (the dotted path of the
  ``nn.Module`` it came from; ``""`` is the root), read from the
  ``call_module`` target or torch's ``nn_module_stack``;
- export graphs get names tied to module paths (``blocks_0_qkv_linear``
  instead of ``linear_4``), as symbolic tracing already gives;
- the graph carries ``meta.CaptureInfo`` (which method, and why fx failed);
- export's ``_assert_tensor_metadata`` checks are removed (see
  ``_drop_metadata_asserts``).

torch.nn's transformer modules and ``MultiheadAttention`` are traced into
(``passes.trace_nn``) so that their layers can go to different stages; every
other torch.nn module stays one ``call_module`` leaf. When fx cannot go in,
export takes over and ``CaptureInfo.fx_error`` names the module.

Export fixes the input shapes and the train/eval mode it saw, so capture at
the microbatch shape, in training mode. Captures can be silently wrong, so each
one is checked once against the original model (forward output and every
parameter gradient, same RNG state); see ``check_capture``.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import os
import re
import traceback
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch
import torch.fx
import torch.nn as nn

from passes import meta
from passes.capture_check import CaptureMismatchError, check_capture
from passes.errors import FxpipeError
from passes.trace_nn import ShapeAnsweringTracer

__all__ = ["capture", "CaptureError", "CaptureMismatchError", "check_capture", "LeafTracer"]

_TORCH_DIR = os.path.dirname(torch.__file__)

LeafSpec = Union[type, str]


class CaptureError(FxpipeError):
    """Neither symbolic tracing nor export could capture the model."""


class LeafTracer(ShapeAnsweringTracer):
    """A tracer that keeps user-declared modules as opaque ``call_module`` leaves.

    Leaves are given as classes (every instance is a leaf) or dotted module
    paths (``"blocks.0.gate"``). Given the example inputs, it traces into
    torch.nn's transformer modules and ``MultiheadAttention`` (see
    ``passes.trace_nn``) unless they are declared leaves; every other torch.nn
    module stays a leaf. When tracing fails, the innermost module it was in
    (``module_stack_objs``, kept by ``ShapeAnsweringTracer``) names the place.
    """

    # A buffer read by attribute is a graph value (``get_attr``): without this, a value computed from
    # it (``self.index.view(-1)``, torchvision's MaxViT) became a traced constant, and the buffer
    # was in no stage (a saved state_dict lacked it). An update of a buffer in ``forward`` by Python
    # code is still left out of the graph: the capture check compares buffers, and export takes over.
    proxy_buffer_attributes = True

    def __init__(self, leaf_modules: Iterable[LeafSpec] = (),
                 example_inputs: Optional[Sequence[Any]] = None) -> None:
        super().__init__(example_inputs)
        leaves = tuple(leaf_modules)
        self.leaf_types = tuple(x for x in leaves if isinstance(x, type))
        self.leaf_paths = frozenset(x for x in leaves if isinstance(x, str))

    def is_declared_leaf(self, m: nn.Module, path: str) -> bool:
        return path in self.leaf_paths or bool(self.leaf_types) and isinstance(m, self.leaf_types)

    def traces_into(self, m: nn.Module, path: str = "") -> bool:
        return not self.is_declared_leaf(m, path) and super().traces_into(m, path)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.is_declared_leaf(m, module_qualified_name) or super().is_leaf_module(m, module_qualified_name)


def capture(
    model: nn.Module,
    example_inputs: Sequence[Any],
    method: str = "auto",
    leaf_modules: Iterable[LeafSpec] = (),
    concrete_args: Optional[Dict[str, Any]] = None,
    check: bool = True,
) -> torch.fx.GraphModule:
    """Capture ``model`` called on ``example_inputs`` (one microbatch, a tuple).

    ``method``: ``"fx"`` (symbolic tracing only), ``"export"`` (torch.export
    only) or ``"auto"`` (fx, falling back to export when tracing fails or the
    traced graph does not match the model). ``leaf_modules`` and
    ``concrete_args`` apply to symbolic tracing. Raises ``CaptureError`` when
    no method works and ``CaptureMismatchError`` when the capture differs
    from the model.
    """
    if method not in ("auto", "fx", "export"):
        raise FxpipeError(f"capture: method must be 'auto', 'fx' or 'export', not {method!r}")
    inputs = tuple(example_inputs)
    leaves = tuple(leaf_modules)
    _check_leaf_paths(model, leaves)
    model.train()
    fx_error: Optional[str] = None
    fx_failure: Optional[BaseException] = None
    if method in ("auto", "fx"):
        try:
            gm = _trace_fx(model, leaves, concrete_args, inputs)
            if check:
                check_capture(model, gm, inputs, method="fx")
            return _finish(gm, "fx", None, model)
        except Exception as exc:  # noqa: BLE001 - any tracing failure means: try export
            if method == "fx" or isinstance(exc, CaptureError):
                raise _as_capture_error(exc, None) from exc
            fx_failure = exc
            fx_error = _fx_error_line(exc)
    try:
        with _quiet_torch_logs():
            gm = torch.export.export(model, inputs, strict=False).module()
    except Exception as exc:  # noqa: BLE001
        raise _as_capture_error(fx_failure, exc) from exc
    _drop_metadata_asserts(gm)
    _rename_export_nodes(gm)
    if check:
        check_capture(model, gm, inputs, method="export")
    return _finish(gm, "export", fx_error, model)


# ------------------------------------------------------------ fx


def _trace_fx(model: nn.Module, leaves: Tuple[LeafSpec, ...], concrete_args: Optional[Dict[str, Any]],
              inputs: Sequence[Any] = ()) -> torch.fx.GraphModule:
    tracer = LeafTracer(leaves, inputs)
    if tracer.traces_into_any(model):
        # forward's optional arguments the example leaves out are fixed to their defaults (as export
        # does): a ``mask=None`` passed on into torch.nn's modules must be None there, not a Proxy
        concrete_args = {**_unsupplied_defaults(model, len(inputs)), **(concrete_args or {})}
    slots = [(m, name, buf) for m in model.modules() for name, buf in m._buffers.items()]
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:
        inner = tracer.module_stack_objs[-1] if tracer.module_stack_objs else model
        exc._fxpipe_module_path = tracer.path_of_module(inner) if inner is not model else ""  # type: ignore[attr-defined]
        exc._fxpipe_module_type = type(inner).__name__  # type: ignore[attr-defined]
        raise
    finally:
        # ``self.count += 1`` in forward stores a Proxy in the module's buffer slot: put every buffer
        # back, so the user's model is left as it was (the capture check then finds the update missing
        # from the graph, and export takes over)
        for m, name, buf in slots:
            if m._buffers.get(name) is not buf:
                m._buffers[name] = buf
    name = type(model).__name__
    gm = torch.fx.GraphModule(tracer.root, graph, name)
    if concrete_args:
        _drop_concrete_placeholders(gm, concrete_args)
    return gm


def _unsupplied_defaults(model: nn.Module, supplied: int) -> Dict[str, Any]:
    params = list(inspect.signature(model.forward).parameters.values())[supplied:]
    simple = (type(None), bool, int, float, str)
    return {p.name: p.default for p in params if p.kind == p.POSITIONAL_OR_KEYWORD and isinstance(p.default, simple)}


def _drop_concrete_placeholders(gm: torch.fx.GraphModule, concrete_args: Dict[str, Any]) -> None:
    """Fold constant ``concrete_args`` into the graph, so placeholders are exactly the inputs.

    Symbolic tracing keeps a placeholder for each concrete argument plus an
    ``_assert`` that it has the traced value; later passes map placeholders to
    ``example_inputs`` by position, so a constant argument is folded instead.
    """
    simple = (type(None), bool, int, float, str)
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or not node.args:  # a concrete argument's placeholder has a default
            continue
        key = str(node.target)
        key = key if key in concrete_args else re.sub(r"_\d+$", "", key)  # fx renames it ``double_1``
        if key not in concrete_args or not isinstance(concrete_args[key], simple):
            continue
        for user in list(node.users):
            checks = list(user.users)
            if user.target is operator.eq and checks and all(c.target is torch._assert for c in checks):
                for check in checks:
                    gm.graph.erase_node(check)
                gm.graph.erase_node(user)
        node.replace_all_uses_with(concrete_args[key])  # type: ignore[arg-type]
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _check_leaf_paths(model: nn.Module, leaves: Tuple[LeafSpec, ...]) -> None:
    known = {name for name, _ in model.named_modules()}
    for leaf in leaves:
        if isinstance(leaf, str) and leaf not in known:
            near = sorted(k for k in known if k and k.split(".")[-1] == leaf.split(".")[-1])[:5]
            hint = f"; modules with that name: {', '.join(near)}" if near else ""
            raise FxpipeError(f"capture: leaf module '{leaf}' is not a submodule of {type(model).__name__}{hint}")
        if not isinstance(leaf, (str, type)):
            raise FxpipeError(f"capture: leaf_modules takes module classes or dotted paths, not {leaf!r}")


# ------------------------------------------------------------ errors


@contextlib.contextmanager
def _quiet_torch_logs() -> Any:
    """Export prints whole partial graphs to stderr when it fails; our error says it shorter."""
    names = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200] + ' …' if len(first) > 200 else first}"


def _fx_error_line(exc: BaseException) -> str:
    """Why symbolic tracing failed, naming the module it was in (shown when export takes over)."""
    path = getattr(exc, "_fxpipe_module_path", "")
    kind = getattr(exc, "_fxpipe_module_type", "")
    return (f"in module '{path}' ({kind}): " if path else "") + _one_line(exc)


def _user_frame(exc: BaseException) -> Optional[str]:
    """``file:line`` of the deepest frame outside torch: the code that failed."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not frame.filename.startswith((_TORCH_DIR, "<")) and not _is_ours(frame.filename):
            found = f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return found


def _is_ours(filename: str) -> bool:
    return any(f"/passes/{name}" in filename for name in ("capture", "trace_nn"))


def _as_capture_error(fx_exc: Optional[BaseException], export_exc: Optional[BaseException]) -> FxpipeError:
    if isinstance(fx_exc, FxpipeError) and export_exc is None:
        return fx_exc
    parts = []
    if fx_exc is not None:
        path = getattr(fx_exc, "_fxpipe_module_path", "")
        where = _user_frame(fx_exc)
        parts.append(
            f"symbolic tracing failed in module '{path or '<root>'}'"
            + (f" at {where}" if where else "")
            + f": {_one_line(fx_exc)}"
        )
    if export_exc is not None:
        where = _user_frame(export_exc)
        parts.append("torch.export failed" + (f" at {where}" if where else "") + f": {_one_line(export_exc)}")
    path = getattr(fx_exc, "_fxpipe_module_path", "") if fx_exc is not None else ""
    return CaptureError("capture: " + "; ".join(parts) + f". Way out: {_remedy(path, export_exc)}.")


def _remedy(path: str, export_exc: Optional[BaseException]) -> str:
    text = str(export_exc) if export_exc is not None else ""
    if "in output, which is not a known type" in text:
        kind = text.split("Found ", 1)[-1].split(" in output", 1)[0]
        return (
            f"the model returns {kind}, which a graph cannot carry: make forward return tensors "
            "(HF transformers: set config.use_cache = False; `fxpipe split` and `fxpipe.split` do this)"
        )
    if path:
        return (
            f"declare that module a leaf (leaf_modules = ['{path}'] in the model file, or its class), "
            "or fix its Python-level arguments with concrete_args"
        )
    return (
        "declare the module that holds the failing code a leaf (leaf_modules in the model file), "
        "or fix the Python-level arguments of forward with concrete_args"
    )


# ------------------------------------------------------------ metadata and names


def module_path_of(node: torch.fx.Node) -> Optional[str]:
    """The dotted module path a node came from, or None when unknown."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return _clean_path(str(path))
    if node.op in ("call_function", "call_method"):
        return ""  # code in the root module's forward
    return None


def _clean_path(path: str) -> str:
    """Normalise strict-export style paths (``L['self'].blocks[0]``) to dotted ones."""
    if not path.startswith("L["):
        return path
    path = path.replace("L['self']", "").replace("['", ".").replace("']", "")
    path = path.replace("[", ".").replace("]", "")
    return path.strip(".")


def _finish(gm: torch.fx.GraphModule, method: str, fx_error: Optional[str],
            model: torch.nn.Module) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        path = module_path_of(node)
        if path is not None:
            meta.put(node, meta.ModuleInfo(path))
    meta.put(gm, meta.CaptureInfo(method=method, fx_error=fx_error, state_keys=tuple(model.state_dict())))
    return gm


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    if hasattr(target, "_opname"):
        name = target._opname  # aten.linear.default -> linear
    return name.split(".")[0].strip("_") or "op"


_METADATA_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def _drop_metadata_asserts(gm: torch.fx.GraphModule) -> None:
    """Erase export's ``_assert_tensor_metadata`` nodes.

    Export puts one beside every ``.to(dtype)`` of the model: it checks that
    the tensor still has the dtype and device it had when traced, and returns
    nothing. The cast after it converts whatever it is given, so the check
    changes no value. Kept, it would be a second reader of what it checks:
    a norm weight cast in the forward (HF Gemma) would look used twice, i.e.
    tied across stages if the check and the cast were placed apart, and a
    residual stream checked before each norm gets a reader the split must
    send it to. Higher-order regions (``torch.autocast`` or ``no_grad``
    blocks of the model) are submodules with their own checks; those go too.
    ``check_capture`` then compares the graph without them to the model.
    """
    for sub in list(gm.modules()):  # higher-order ops (autocast / no_grad regions) keep theirs in submodules
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        here = [n for n in sub.graph.nodes
                if n.op == "call_function" and n.target is _METADATA_ASSERT and not n.users]
        for node in here:
            sub.graph.erase_node(node)
        if here:
            sub.graph.lint()
            sub.recompile()


def _rename_export_nodes(gm: torch.fx.GraphModule) -> None:
    """Prefix export's ``call_function`` names with their module path."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        path = module_path_of(node)
        if path:
            node._rename(f"{path.replace('.', '_')}_{_op_name(node)}")
    gm.recompile()
