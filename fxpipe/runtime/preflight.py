"""Checks ``fxpipe train`` makes in the parent, before any worker starts.

A mistake found here costs one line and no worker start-up; found in the
workers it would cost a process group, a torchrun report and a line per rank.
So the parent checks what it can see alone: the settings are counts of at
least one, the split was made from this model (its parameter names and
shapes), the first batch of ``batches()`` has the example's shapes and dtypes
(every boundary buffer of the split is sized from them), and, for
``--resume``, the checkpoint (``fxpipe.runtime.checkpoint.check``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from fxpipe.runtime.data import FromBatches, as_tuple, batch_dim
from passes.errors import FxpipeError


class PreflightError(FxpipeError):
    """A setting, split or batch that cannot work; found before the workers start."""


_COUNTS = {"microbatches": ("--microbatches", 1), "steps": ("--steps", 1),
           "checkpoint_every": ("--checkpoint-every", 0)}


def check_config(cfg: Any) -> None:
    """Counts of at least one (the CLI checks them too; this covers ``fxpipe.train`` callers, through ``launch.prepare``)."""
    for field, (option, least) in _COUNTS.items():
        check_count(option, getattr(cfg, field), least)
    if not cfg.timeout_s > 0:
        raise PreflightError(f"--timeout must be positive, got {cfg.timeout_s!r}")
    if cfg.resume and not cfg.checkpoint:
        raise PreflightError("--resume needs --checkpoint DIR (the folder the earlier run checkpointed into)")


def check_count(option: str, value: Any, least: int) -> None:
    """Raise unless ``value`` is a whole number of at least ``least``."""
    if not isinstance(value, int) or value < least:
        raise PreflightError(f"{option} must be a whole number of at least {least}, got {value!r}")


def _shapes(split: Any) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """The split's tensors under the original model's names: shape and dtype."""
    out: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for names, stage in zip(split.param_names, split.stages):
        for local, t in stage.state_dict().items():
            out.setdefault(names.get(local, local), (tuple(t.shape), t.dtype))
    for alias, canon in split.aliases.items():
        if canon in out:
            out[alias] = out[canon]
    return out


def check_split_matches(split: Any, model: torch.nn.Module, where: str, source: str) -> None:
    """The split in ``where`` holds this model's parameters and buffers, same names and shapes."""
    have = _shapes(split)
    want = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    keys = set(split.state_keys if split.state_keys is not None else have)  # the model's keys at split time
    missing = [k for k in want if k not in keys]
    extra = sorted(k for k in keys if k not in want)
    differ = [k for k in want if k in have and have[k][0] != want[k][0]]
    if not (missing or extra or differ):
        return
    first = (f"{differ[0]} is {list(have[differ[0]][0])} there but {list(want[differ[0]][0])} in the model"
             if differ else f"the model has {missing[0]}, the split does not" if missing
             else f"the split has {extra[0]}, the model does not")
    raise PreflightError(f"the split in {where} was not made from {source} ({len(missing) + len(extra) + len(differ)} "
                         f"tensors differ; {first}); split this model with `fxpipe split {source} -o DIR` "
                         "or drop --split")


def _describe(values: List[Any]) -> str:
    return "[" + ", ".join(f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else repr(x)
                           for x in values) + "]"


def check_first_batch(spec: Any, microbatches: int) -> Optional[Tuple[Tuple[Any, ...], Any]]:
    """Microbatch 0 of ``batches()`` (None without it), checked against ``example_inputs``: count, shape, dtype."""
    if spec.batches is None:
        return None
    example = as_tuple(spec.example_inputs)
    try:
        inputs, targets = FromBatches(spec.batches, batch_dim(example), microbatches)(0)
    except FxpipeError as exc:
        raise PreflightError(f"{spec.source}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's generator failed: say where
        raise PreflightError(f"{spec.source}: batches() failed on the first batch: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    same = len(inputs) == len(example) and all(
        not isinstance(e, torch.Tensor) or isinstance(x, torch.Tensor) and x.shape == e.shape and x.dtype == e.dtype
        for x, e in zip(inputs, example))
    if not same:
        raise PreflightError(f"{spec.source}: batches() yields microbatches {_describe(list(inputs))}, but the "
                             f"split was made for example_inputs {_describe(list(example))}; make batches() "
                             "yield inputs with the example's shapes and dtypes (one microbatch or one step "
                             "of them), or change example_inputs and split again")
    return inputs, targets
