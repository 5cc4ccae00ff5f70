"""Optimizers that update out of place, so a weight stash needs no copies.

With weight stashing (``1f1b-stash``, ``2bw``) a forward's weights must stay
unchanged until its backward, while the optimizer keeps updating. An
in-place optimizer forces the stash to clone the weights for every version.
These optimizers instead compute each new parameter as a fresh tensor and
rebind the parameter to it (``p.data = new``): the tensors an earlier
forward used (``fxpipe.runtime.stash`` holds aliases of them) are never
written again, so they *are* that version, and a version costs no copy.

They are ``torch.optim.SGD`` / ``torch.optim.AdamW`` with ``step`` replaced:
same options, same state names (``momentum_buffer``; ``step``, ``exp_avg``,
``exp_avg_sq``), so ``state_dict`` and checkpoints are the torch format, and
the arithmetic is the per-tensor algorithm's, op for op, in ``torch._foreach``
calls over the whole group (bit-identical to torch's for-loop implementation
in float64; tests/fxpipe/runtime/test_copy_free.py). Options they do not
implement (``amsgrad``, ``capturable``, ``differentiable``) make
``copy_free_optimizer`` return None, and the caller falls back to torch's
optimizer with copying stash.

Optimizer state (moments) is updated in place: no graph saves it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

_UNSUPPORTED = ("amsgrad", "capturable", "differentiable")


def _rebind(params: List[torch.Tensor], new: List[torch.Tensor]) -> None:
    """Point every parameter at its new tensor; the old tensor stays whole for whoever holds it."""
    for p, n in zip(params, new):
        p.data = n


class _OutOfPlace:
    """``step`` over every group's parameters that have a gradient; ``_update`` returns their new tensors."""

    out_of_place = True
    param_groups: List[Dict[str, Any]]

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Optional[torch.Tensor]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group.get("maximize", False):
                grads = torch._foreach_neg(grads)
            _rebind(params, self._update(group, params, grads))
        return loss

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor],
                grads: List[torch.Tensor]) -> List[torch.Tensor]:
        raise NotImplementedError


class CopyFreeSGD(_OutOfPlace, torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay) writing new parameter tensors."""

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor],
                grads: List[torch.Tensor]) -> List[torch.Tensor]:
        wd, momentum, lr = group["weight_decay"], group["momentum"], float(group["lr"])
        if wd != 0:
            grads = torch._foreach_add(grads, params, alpha=wd)
        if momentum != 0:
            grads = self._momentum(params, grads, momentum, group["dampening"], group["nesterov"])
        return torch._foreach_add(params, grads, alpha=-lr)

    def _momentum(self, params: List[torch.Tensor], grads: List[torch.Tensor], momentum: float,
                  dampening: float, nesterov: bool) -> List[torch.Tensor]:
        """Update the momentum buffers (the first one is the gradient itself) and return the step direction."""
        bufs: List[torch.Tensor] = []
        old = []
        for p, g in zip(params, grads):
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.detach().clone()
            else:
                old.append((buf, g))
            bufs.append(buf)
        if old:
            olds, og = [b for b, _ in old], [g for _, g in old]
            torch._foreach_mul_(olds, momentum)
            torch._foreach_add_(olds, og, alpha=1 - dampening)
        return torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs


class CopyFreeAdamW(_OutOfPlace, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay, bias correction) writing new parameter tensors."""

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor],
                grads: List[torch.Tensor]) -> List[torch.Tensor]:
        avgs, sqs, steps = self._state(params)
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        new = torch._foreach_mul(params, 1 - lr * wd) if wd != 0 else None
        torch._foreach_lerp_(avgs, grads, 1 - beta1)
        torch._foreach_mul_(sqs, beta2)
        torch._foreach_addcmul_(sqs, grads, grads, value=1 - beta2)
        counts = [float(s.item()) for s in steps]  # per tensor, as torch's per-tensor loop reads them
        step_size = [-(lr / (1 - beta1 ** n)) for n in counts]
        denom = torch._foreach_sqrt(sqs)
        torch._foreach_div_(denom, [(1 - beta2 ** n) ** 0.5 for n in counts])
        torch._foreach_add_(denom, eps)
        if new is None:
            return torch._foreach_addcdiv(params, avgs, denom, step_size)
        torch._foreach_addcdiv_(new, avgs, denom, step_size)
        return new

    def _state(self, params: List[torch.Tensor]) -> tuple:
        avgs, sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=dtype)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return avgs, sqs, steps


def copy_free_optimizer(name: str, params: List[nn.Parameter], options: Dict[str, Any]) -> Optional[torch.optim.Optimizer]:
    """The out-of-place ``sgd`` / ``adamw`` over ``params``, or None where its options need torch's own."""
    if any(options.get(k) for k in _UNSUPPORTED) or any(p.is_sparse for p in params):
        return None
    options = {k: v for k, v in options.items() if k not in ("fused", "foreach")}
    if name == "sgd":
        return CopyFreeSGD(params, **options)
    if name == "adamw":
        return CopyFreeAdamW(params, **options)
    return None


def is_out_of_place(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` leaves the tensors it replaces untouched (a stash may then alias them)."""
    return bool(getattr(optimizer, "out_of_place", False))
