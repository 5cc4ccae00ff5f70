"""Learning-rate schedules: the learning rate of step ``s`` as a function of ``s`` alone.

One definition, used by every rank before every optimizer step (so every
rank, replica and stage agrees without communicating), by the step line, and
by the tests' references. With ``steps`` = T steps in the run (``--steps``),
``warmup`` = W steps, the base rate ``lr`` and the floor ``min_lr``, step
``s`` (0-based) trains with:

- warm-up, ``s < W``: ``lr * (s + 1) / W`` (a linear ramp whose first step is
  ``lr / W``, not a wasted step at 0, and whose step ``W - 1`` is ``lr``);
- after it, with ``p = (s - W) / (T - W)`` (0 at the first step after the
  warm-up, below 1 at the last step):

  - ``constant``: ``lr``;
  - ``linear``:   ``min_lr + (lr - min_lr) * (1 - p)``;
  - ``cosine``:   ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``.

  Both decays would reach ``min_lr`` at step T, one past the last; so the
  last step's rate is still above it (the usual convention: no step is
  taken at the floor itself).

A step is one optimizer update for ``1f1b-flush`` and ``gpipe``. With
``1f1b-stash`` a step is ``M`` minibatches, each with its own update, and
the update after the backward of global minibatch ``g`` uses step
``g // M``'s rate: all of a step's updates share one rate. Replicas of a
stage agree because a replicated stage's minibatch count divides ``M``
(the stash schedule requires it), so the ``r`` minibatches one update
averages lie in one step.

The rate depends on the step only, so a checkpoint needs only its step
number (and the schedule's settings, recorded with it) for ``--resume`` to
continue the schedule where it stopped. The decay spans ``--steps``:
resuming with a different ``--steps`` stretches the rest of it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from passes.errors import FxpipeError

if TYPE_CHECKING:  # the CLI reads LR_SCHEDULES before torch is imported
    import torch

LR_SCHEDULES = ("constant", "cosine", "linear")


class LRScheduleError(FxpipeError):
    """A learning-rate schedule setting out of range."""


def check_lr_schedule(name: str, warmup: int, min_lr: float, lr: float) -> None:
    """Reject settings with no meaning, naming the option."""
    if name not in LR_SCHEDULES:
        raise LRScheduleError(f"--lr-schedule {name!r} is unknown; choose one of {', '.join(LR_SCHEDULES)}")
    if not isinstance(warmup, int) or warmup < 0:
        raise LRScheduleError(f"--warmup-steps must be a whole number >= 0, got {warmup!r}")
    if not 0.0 <= min_lr <= lr:
        raise LRScheduleError(f"--min-lr must lie between 0 and --lr ({lr}), got {min_lr}")


def lr_at(step: int, *, lr: float, steps: int, lr_schedule: str = "constant", warmup: int = 0,
          min_lr: float = 0.0) -> float:
    """The learning rate of 0-based ``step`` of a ``steps``-step run (see the module docstring)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if lr_schedule == "constant":
        return lr
    p = (step - warmup) / max(1, steps - warmup)
    shape = 1.0 - p if lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return min_lr + (lr - min_lr) * shape


def set_lr(optimizer: "torch.optim.Optimizer", lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
