"""Mixed precision for one rank: autocast around the stage, dynamic loss scaling for fp16.

Master weights and optimizer state stay in fp32: the parameters are never
cast, ``torch.autocast`` casts per op (matmuls and convolutions to the low
dtype, reductions and losses kept in fp32, as torch's autocast op lists say).

What crosses between stages: the dtype the split recorded for that value
(``passes.comm``'s receive buffers are allocated from it). A split profiled
under the same autocast (``fxpipe.profiling.profile_model(..., precision=)``)
records the low dtype where autocast produces it, so half the bytes travel;
a split made in fp32 records fp32 and a bf16 run sends its bf16 outputs
upcast (exact), paying fp32 bytes. Casting down (a value recorded in bf16, a
run in fp32) would silently lose precision, so that is an error
(``wire_value``). Gradients travel in the same dtype as their value.

fp16 needs loss scaling (its smallest normal is 6e-5: small gradients
flush to zero). ``LossScaler`` follows ``torch.amp.GradScaler``'s rule:
multiply the loss by ``scale``; before the step divide the gradients by it;
if any gradient on ANY rank is inf/nan, skip the step everywhere and halve
the scale; after ``growth_interval`` good steps in a row, double it. The
inf/nan flag is all-reduced over every rank first, so every stage skips the
same step (a stage stepping while another skips would desynchronise tied
weights and replicas).

Where the unscale sits (for gradient clipping): ``prepare_step`` must run
after the gradient all-reduce and BEFORE any clipping or optimizer step.
``Executor._step`` calls it, then the learning-rate and clipping hook on every
step (clipping is collective, so a skipped step runs it too: the gradients are
gone then, so it scales nothing and records a norm of 0), then the optimizer
step only if it returned True.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Iterable, Optional

import torch
import torch.distributed as dist

from fxpipe.runtime.transport import peer_guard
from passes.errors import FxpipeError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(DTYPES)


class PrecisionError(FxpipeError):
    """A precision that cannot run as asked."""


def precision_dtype(precision: str) -> torch.dtype:
    """The floating dtype ``--precision`` names; an unknown name is a ``PrecisionError``."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return DTYPES[precision]


def check_precision(precision: str, schedule: str) -> None:
    """Fail before any worker starts on a combination that cannot run."""
    precision_dtype(precision)
    if precision == "fp16" and schedule in ("1f1b-stash", "2bw"):
        # each minibatch's step would need an all-rank agreement on inf/nan in the middle of the
        # pipeline (ranks step at different times there): not supported
        raise PrecisionError(f"--precision fp16 (dynamic loss scaling) runs with --schedule 1f1b-flush or "
                             f"gpipe, not {schedule}; use --precision bf16 with {schedule}")


def autocast(precision: str, device: torch.device) -> ContextManager:
    """The context a stage's forward (and the loss) runs in; fp32: none."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def wire_value(value: torch.Tensor, wire_dtype: torch.dtype, tag: str) -> torch.Tensor:
    """``value`` in the dtype its wire carries: an exact upcast, never a silent downcast."""
    if value.dtype == wire_dtype or not (value.is_floating_point() and wire_dtype.is_floating_point):
        return value
    if torch.finfo(wire_dtype).bits < torch.finfo(value.dtype).bits:
        raise PrecisionError(f"value '{tag}' is {value.dtype} but the split records {wire_dtype} for it: the "
                             "split was made for a lower precision than this run; split again with this --precision")
    return value.to(wire_dtype)


class LossScaler:
    """Dynamic loss scale (fp16). Every rank holds one; they stay equal because the skip decision is global."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group: Optional[object] = None,
                 device: torch.device = torch.device("cpu")) -> None:
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.group = group  # None: the default group (every rank)
        self.device = device  # where the flag lives (NCCL needs it on the GPU; untested here)
        self.good_steps = 0
        self.skipped: list = []  # the step numbers (0-based, counting every step) that were skipped
        self._steps = 0

    def prepare_step(self, params: Iterable[torch.Tensor]) -> bool:
        """Unscale the gradients of ``params`` in place; True if the step may run (no inf/nan anywhere).

        Collective: every rank must call it at its step, in the same order.
        On False the gradients are cleared and the scale is lowered.
        """
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        inv = 1.0 / self.scale
        local_bad = False
        if grads:  # foreach: one call over the stage's gradients, not one per tensor
            torch._foreach_mul_(grads, inv)
            local_bad = not bool(torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all())
        flag = torch.tensor([1.0 if local_bad else 0.0], device=self.device)
        if dist.is_available() and dist.is_initialized():
            with peer_guard("all-reduce of the fp16 inf/nan flag"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        ok = flag.item() == 0.0
        self._update(ok)
        if not ok:
            for p in params:
                p.grad = None
        return ok

    def _update(self, ok: bool) -> None:
        if ok:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        else:
            self.skipped.append(self._steps)
            self.scale *= self.backoff_factor
            self.good_steps = 0
        self._steps += 1
