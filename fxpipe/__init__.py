"""fxpipe: PipeDream-style pipeline-parallel training on torch.fx.

The public names load lazily, so ``import fxpipe`` (and the CLI's start-up)
does not pay for torch.fx passes and OR-Tools until they are used.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "split": "fxpipe.api",
    "train": "fxpipe.trainer",
    "TrainOutcome": "fxpipe.trainer",
    "run_local": "fxpipe.local",
    "SplitModel": "fxpipe.split_model",
    "CommEdge": "fxpipe.split_model",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxpipe' has no attribute '{name}'")
