"""Python objects a training script hands to ``fxpipe.train``, carried to the workers.

The workers are separate processes started by torchrun, so the data source,
the loss function and the example tensors travel in a pickle file in the run
folder. Tensors and containers go by value; functions and classes go by
reference (module and name), as pickle always sends them, so each must be
importable in a fresh process:

- a function or class at module level of an importable module: fine;
- one at module level of the script being run (``__main__``): fine, the worker
  runs the script first under the name ``__mp_main__`` and its names stand in
  for ``__main__``'s, the convention of ``multiprocessing``'s spawn start: the
  training call must sit under ``if __name__ == "__main__":``;
- a lambda, a function or class defined inside a function, anything defined
  in an interactive session (no file), or a module that a fresh interpreter
  cannot find: refused in the parent with one line naming it and the fix.

The parent's ``sys.path`` travels too (the script's folder is on it, so its
neighbours import in the workers as they did here).
"""
from __future__ import annotations

import importlib.util
import io
import os
import pickle
import sys
import types
from typing import Any, Dict, Iterable, Iterator, Set

from passes.errors import FxpipeError

PAYLOAD_FILE = "payload.pkl"
IMPORTING_MAIN = "FXPIPE_WORKER_IMPORTS_MAIN"  # set while a worker runs the user's script as __mp_main__


class PayloadError(FxpipeError):
    """An object given to ``fxpipe.train`` cannot reach the worker processes."""


class Reiterate:
    """``batches`` given as a re-iterable (a list, a DataLoader): each call starts a new pass."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items

    def __call__(self) -> Iterator[Any]:
        return iter(self.items)


def as_batches(batches: Any) -> Any:
    """A zero-argument callable giving an iterator of ``(inputs, targets)``, as a model file's ``batches()``."""
    if batches is None or callable(batches) and not hasattr(batches, "__next__"):
        return batches
    if hasattr(batches, "__next__"):
        raise PayloadError(f"batches is an iterator ({type(batches).__name__}): it can be read once, in one "
                           "process; pass a function returning a new iterator (def batches(): ...) or a list")
    if hasattr(batches, "__iter__"):
        return Reiterate(batches)
    raise PayloadError(f"batches must be a function returning an iterator of (inputs, targets), or a list "
                       f"of them, not {type(batches).__name__}")


class _Checker(pickle.Pickler):
    """Pickles, refusing what a fresh process could not look up; notes uses of ``__main__``."""

    def __init__(self, file: io.BytesIO, label: str) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.label = label
        self.main = False
        self.checked: Set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (types.FunctionType, type)):
            self._check(obj)
        return NotImplemented

    def _check(self, obj: Any) -> None:
        module, qual = getattr(obj, "__module__", None) or "?", getattr(obj, "__qualname__", "?")
        what = f"{self.label}: {'class' if isinstance(obj, type) else 'function'} {qual} (module {module})"
        if "<lambda>" in qual or "<locals>" in qual:
            raise PayloadError(f"{what} cannot reach the worker processes (pickle sends functions and classes "
                               "by name, and this one has none a new process can look up); define it with "
                               "def/class at module level")
        if module == "__main__":
            if not getattr(sys.modules.get("__main__"), "__file__", None):
                raise PayloadError(f"{what} is defined in an interactive session, which the worker processes "
                                   "cannot import; define it in a .py file")
            self.main = True
        elif module not in self.checked:
            self.checked.add(module)
            if not _findable(module):
                raise PayloadError(f"{what} cannot reach the worker processes: a new Python process cannot "
                                   f"import {module}; define it in an importable module or in your script")


def _findable(module: str) -> bool:
    """A fresh interpreter can import ``module``'s top package (not only this process's ``sys.modules``)."""
    top = module.split(".")[0]
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            if find is not None and find(top, None) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def check_class(cls: type, label: str) -> bool:
    """Refuse a class a worker could not import by name (``module:qualname``); True if it is in ``__main__``."""
    checker = _Checker(io.BytesIO(), label)
    checker.dump(cls)
    if "." in cls.__qualname__:
        raise PayloadError(f"{label}: class {cls.__qualname__} is nested in a class; define it at module level")
    return checker.main


def write(run_dir: str, objects: Dict[str, Any], main: bool = False) -> str:
    """Pickle ``objects`` (name -> object) into ``run_dir``; every name checked on its own for the error line.

    ``main``: run the script in the workers even if no object needs it (the
    optimizer class, which the workers look up by name, is in it).
    """
    parts: Dict[str, bytes] = {}
    for name, obj in objects.items():
        buf = io.BytesIO()
        checker = _Checker(buf, name)
        try:
            checker.dump(obj)
        except PayloadError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever pickle refuses, said in one line
            raise PayloadError(f"{name} cannot reach the worker processes: {type(exc).__name__}: {exc}; "
                               "define its functions and classes at module level") from exc
        parts[name] = buf.getvalue()
        main = main or checker.main
    main_file = os.path.abspath(sys.modules["__main__"].__file__) if main else None
    path = os.path.join(run_dir, PAYLOAD_FILE)
    with open(path, "wb") as f:
        pickle.dump({"parts": parts, "main": main_file, "sys_path": list(sys.path)}, f)
    return PAYLOAD_FILE


def read(run_dir: str, name: str) -> Dict[str, Any]:
    """The objects ``write`` stored, in a worker: the parent's path first, its script run as ``__mp_main__``."""
    with open(os.path.join(run_dir, name), "rb") as f:
        box = pickle.load(f)
    for entry in box["sys_path"]:
        if entry not in sys.path:
            sys.path.append(entry)
    if box["main"]:
        _run_main(box["main"])
    return {k: pickle.loads(v) for k, v in box["parts"].items()}


def _run_main(path: str) -> None:
    """The user's script as module ``__mp_main__``, also seen as ``__main__`` (its guarded part does not run)."""
    if not os.path.exists(path):
        raise PayloadError(f"the script {path} that defines the training objects is not on this node; copy it "
                           "there (same path), or define them in an importable module")
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["__mp_main__"] = module
    os.environ[IMPORTING_MAIN] = path
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        del os.environ[IMPORTING_MAIN]
    sys.modules["__main__"] = module


def guard_reentry() -> None:
    """Refuse ``fxpipe.train`` while a worker runs the user's script: it would start workers of its own."""
    path = os.environ.get(IMPORTING_MAIN)
    if path:
        raise PayloadError(f"{path} called fxpipe.train when a worker imported it for its functions; put the "
                           "training call under if __name__ == \"__main__\":")


def spec_from(objects: Dict[str, Any], source: str) -> Any:
    """The worker's ``ModelSpec`` from the shipped objects (no model: the weights come from the split)."""
    from fxpipe.loader import ModelSpec

    return ModelSpec(model=None, example_inputs=tuple(objects["example_inputs"]),  # type: ignore[arg-type]
                     loss_fn=objects["loss_fn"], example_targets=objects.get("example_targets"),
                     batches=objects.get("batches"), source=source)

