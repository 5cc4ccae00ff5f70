"""Load a user's model: a model file, or ``package.module:factory``.

A model file (or module) defines:

- ``model``: an ``nn.Module``, or a zero-argument callable returning one;
- ``example_inputs``: a tuple with one microbatch of positional inputs (or a
  zero-argument callable returning it; a single tensor is accepted);
- optionally ``loss_fn(outputs, targets)`` and ``example_targets``;
  ``leaf_modules`` (module classes or dotted paths symbolic tracing must not
  enter); ``concrete_args`` (for symbolic tracing); ``batches()``, an
  iterator of ``(inputs, targets)`` microbatches for training.

``package.module:factory`` imports ``package.module`` and calls
``factory()``. If it returns an ``nn.Module``, that is ``model`` and the other
names come from the module; if it returns a dict or an object with those
attributes, they come from there; a tuple is read as
``(model, example_inputs[, loss_fn[, example_targets]])``.

Without ``loss_fn`` fxpipe uses ``default_loss``: the sum, over every floating
tensor the model returns, of its mean. It ignores targets: enough to profile,
plan and smoke-test a pipeline, not to learn anything.

Every user mistake is an ``FxpipeError`` that says what to fix: a missing
file, a missing name, inputs the model rejects (naming the innermost module
that failed and the shapes it was given).
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from passes.capture_check import restore_buffers, save_buffers
from passes.errors import FxpipeError

__all__ = ["ModelSpec", "ModelLoadError", "load_model", "default_loss", "describe_shapes"]


class ModelLoadError(FxpipeError):
    """The model file or factory cannot be used as given."""


def default_loss(outputs: Any, targets: Any = None) -> torch.Tensor:
    """Smoke-run loss: sum of the means of every floating output tensor; targets ignored."""
    terms = [t.float().mean() for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not terms:
        raise ModelLoadError("the model returns no floating-point tensor: define loss_fn(outputs, targets) in the model file")
    return torch.stack(terms).sum()


@dataclass
class ModelSpec:
    """Everything fxpipe needs from a user's model, checked once at load time."""

    model: nn.Module
    example_inputs: Tuple[Any, ...]
    loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss
    example_targets: Any = None
    leaf_modules: Tuple[Any, ...] = ()
    concrete_args: Optional[Dict[str, Any]] = None
    batches: Optional[Callable[[], Iterator[Tuple[Any, Any]]]] = None
    source: str = ""
    has_loss_fn: bool = field(default=False)


def load_model(spec: str, check: bool = True) -> ModelSpec:
    """Load ``spec`` (a file path or ``package.module:factory``) and check it runs."""
    namespace, source = _namespace(spec)
    model = _model(namespace, source)
    no_generation_cache(model, source)
    inputs = _inputs(namespace, source)
    loss_fn = getattr(namespace, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise ModelLoadError(f"{source}: loss_fn must be a function loss_fn(outputs, targets)")
    batches = getattr(namespace, "batches", None)
    if batches is not None and not callable(batches):
        raise ModelLoadError(f"{source}: batches must be a function returning an iterator of (inputs, targets)")
    leaves = getattr(namespace, "leaf_modules", ())
    result = ModelSpec(
        model=model, example_inputs=inputs, loss_fn=loss_fn or default_loss,
        example_targets=getattr(namespace, "example_targets", None),
        leaf_modules=tuple(leaves) if isinstance(leaves, (list, tuple, set)) else (leaves,),
        concrete_args=getattr(namespace, "concrete_args", None), batches=batches,
        source=source, has_loss_fn=loss_fn is not None,
    )
    if check:
        check_runs(result)
    return result


# ------------------------------------------------------------ finding the names


def _namespace(spec: str) -> Tuple[Any, str]:
    path = Path(spec)
    if path.suffix == ".py" or path.exists() or "/" in spec or ":" not in spec and not _is_dotted(spec):
        return _run_file(path), str(path)
    module_name, _, factory_name = spec.partition(":")
    if not _is_dotted(module_name):
        raise ModelLoadError(f"model '{spec}' is neither a file nor package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(f"cannot import '{module_name}' for model '{spec}': {exc}") from exc
    if not factory_name:
        return module, spec
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ModelLoadError(f"'{module_name}' has no callable '{factory_name}' (model '{spec}')")
    made = _call_user(factory, spec, f"{factory_name}()")
    return _factory_namespace(made, module, spec), spec


def _is_dotted(text: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", text))


def _factory_namespace(made: Any, module: Any, spec: str) -> Any:
    if isinstance(made, nn.Module):
        return _Overlay(SimpleNamespace(model=made), module)
    if isinstance(made, dict):
        return _Overlay(SimpleNamespace(**made), module)
    if isinstance(made, tuple):
        names = ("model", "example_inputs", "loss_fn", "example_targets")
        if not 2 <= len(made) <= 4:
            raise ModelLoadError(f"{spec}: a factory tuple is (model, example_inputs[, loss_fn[, example_targets]]), got {len(made)} items")
        return _Overlay(SimpleNamespace(**dict(zip(names, made))), module)
    return _Overlay(made, module)


class _Overlay:
    """Names from the factory's result first, then from its module."""

    def __init__(self, first: Any, second: Any) -> None:
        self._first, self._second = first, second

    def __getattr__(self, name: str) -> Any:
        if hasattr(self._first, name):
            return getattr(self._first, name)
        return getattr(self._second, name)


def _run_file(path: Path) -> Any:
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir() and (path / "split.json").exists():
        raise ModelLoadError(f"{path} is a folder from `fxpipe split`, not a model file: pass the model's .py "
                             f"file and the folder as --split (fxpipe train MODEL.py --split {path})")
    if path.is_dir() or path.suffix != ".py":
        raise ModelLoadError(f"model file must be a .py file: {path}")
    name = "fxpipe_model_" + re.sub(r"\W", "_", path.stem)
    module_spec = importlib.util.spec_from_file_location(name, str(path.resolve()))
    module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # classes defined in the file stay importable (pickling)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the file may import its neighbours
    _call_user(lambda: module_spec.loader.exec_module(module), str(path), "running the file")  # type: ignore[union-attr]
    return module


def _call_user(fn: Callable[[], Any], source: str, what: str) -> Any:
    try:
        return fn()
    except FxpipeError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{source}: {what} failed{_user_line(exc)}: {type(exc).__name__}: {exc}") from exc


def _user_line(exc: BaseException) -> str:
    """`` at file:line`` of the deepest frame outside torch and fxpipe."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/fxpipe/" not in f.filename and "<frozen" not in f.filename]
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" at {exc.filename}:{exc.lineno}"
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _model(namespace: Any, source: str) -> nn.Module:
    if not hasattr(namespace, "model"):
        raise ModelLoadError(f"{source} defines no 'model': add model = MyModel() (an nn.Module, or a function returning one)")
    model = namespace.model
    if not isinstance(model, nn.Module) and callable(model):
        model = _call_user(model, source, "calling model()")
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"{source}: 'model' must be an nn.Module or a zero-argument function returning one, not {type(model).__name__}")
    return model


def no_generation_cache(model: nn.Module, source: str, until: str = "") -> List[Any]:
    """Turn off HF transformers' key/value cache: generation state, useless in training.

    With it on, causal LMs return a ``DynamicCache`` object that no captured
    graph can return (``torch.export`` rejects it), and every stage would carry it.
    Returns the configs changed (``fxpipe.split`` sets them back after capture,
    the model being the caller's; ``until`` says so in the note).
    """
    changed = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True and all(config is not c for c in changed):
            config.use_cache = False
            changed.append(config)
    if changed:
        print(f"note: {source}: set config.use_cache = False{until} (the generation cache is not used in training)",
              file=sys.stderr)
    return changed


def _inputs(namespace: Any, source: str) -> Tuple[Any, ...]:
    if not hasattr(namespace, "example_inputs"):
        raise ModelLoadError(
            f"{source} defines no 'example_inputs': add example_inputs = (torch.randn(8, 3, 32, 32),), "
            "a tuple with one microbatch of the model's positional inputs"
        )
    inputs = namespace.example_inputs
    if callable(inputs) and not isinstance(inputs, torch.Tensor):
        inputs = _call_user(inputs, source, "calling example_inputs()")
    return _as_inputs(inputs, source)


def _as_inputs(inputs: Any, source: str) -> Tuple[Any, ...]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    raise ModelLoadError(f"{source}: example_inputs must be a tuple of the model's positional inputs, not {type(inputs).__name__}")


# ------------------------------------------------------------ running once


def describe_shapes(values: Any) -> str:
    """``[(8, 32) torch.int64, 3]``: shapes and dtypes of tensors, other values as is."""
    def one(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{tuple(x.shape)} {x.dtype}"
        return repr(x)
    return "[" + ", ".join(one(x) for x in pytree.tree_leaves(values)) + "]"


def check_runs(spec: ModelSpec) -> None:
    """Run the model (and loss) once on the example; name the module that rejects it."""
    model = spec.model
    model.train()
    stack: List[Tuple[str, nn.Module, Any]] = []
    names = {id(m): n for n, m in model.named_modules()}
    failed: List[Tuple[str, nn.Module, Any]] = []

    def pre(mod: nn.Module, args: Any) -> None:
        stack.append((names.get(id(mod), "?"), mod, args))

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        stack.pop()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    saved = save_buffers(model)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                outputs = model(*spec.example_inputs)
            except Exception as exc:
                failed.extend(stack)
                raise _rejected(spec, failed, exc) from exc
            _check_loss(spec, outputs)
    finally:
        for h in handles:
            h.remove()
        restore_buffers(saved)


def _rejected(spec: ModelSpec, failed: List[Tuple[str, nn.Module, Any]], exc: Exception) -> ModelLoadError:
    given = describe_shapes(spec.example_inputs)
    where = ""
    if failed:
        path, mod, args = failed[-1]
        where = f" in module '{path or '<root>'}' ({type(mod).__name__}, called with {describe_shapes(args)})"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ModelLoadError(
        f"{spec.source}: the model rejects example_inputs {given}{where}{_user_line(exc)}: "
        f"{type(exc).__name__}: {first}. Make example_inputs one microbatch of what forward() expects"
    )


def loss_problem(loss: Any) -> Optional[str]:
    """What is wrong with ``loss_fn``'s result, or None: it must be a tensor holding one number.

    The one rule for the example check at start-up and for every microbatch
    in training: a 0-d tensor, or any shape with one element (what
    ``backward()`` accepts without a gradient argument).
    """
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return None
    got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    return f"loss_fn must return a scalar tensor, got {got}"


def _check_loss(spec: ModelSpec, outputs: Any) -> None:
    loss = _call_user(lambda: spec.loss_fn(outputs, spec.example_targets), spec.source, "loss_fn(outputs, example_targets)")
    problem = loss_problem(loss)
    if problem:
        raise ModelLoadError(f"{spec.source}: {problem}")
