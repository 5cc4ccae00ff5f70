"""Optimizers that update out of place, so a weight stash needs no copies.

With weight stashing (``1f1b-stash``, ``2bw``) a forward's weights must stay
unchanged until its backward, while the optimizer keeps updating. An
in-place optimizer forces the stash to clone the weights for every version.
These optimizers instead give each parameter a new tensor and rebind the
parameter to it (``p.data = new``): the tensors an earlier forward used
(``fxpipe.runtime.stash`` holds aliases of them) are never written again, so
they *are* that version, and the stash copies nothing.

They are ``torch.optim.SGD`` / ``torch.optim.AdamW`` with ``step`` wrapped:
same options, same state (``state_dict`` and checkpoints are torch's
format). Two ways to write the new tensors:

- SGD without momentum: ``new = p - lr * (g + wd * p)``, one pass that reads
  the old tensor and writes the new one, where a copying stash pays the
  update plus a clone. The new tensor is the gradient's storage, written
  over (the gradient is dead after the update), where that gradient is a
  tensor of its own (``_into_grad``), else a new one from ``torch._foreach``
  calls. The arithmetic is torch's op for op (bit-identical to
  ``torch.optim.SGD`` in float64, fused or not;
  tests/fxpipe/runtime/test_copy_free.py);
- everything else (momentum, AdamW): each parameter is first rebound to a
  fresh copy of itself and torch's own step (fused where the caller asked)
  updates the copy in place: torch's arithmetic by construction, and the
  same work as a copying stash's clone plus step. (An out-of-place AdamW
  written in ``_foreach`` calls would make eight passes over the weights
  with one dispatch per tensor per op, against the fused kernel's one pass:
  slower on CPU than the copy it saves.)
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch
import torch.nn as nn

_UNSUPPORTED = ("capturable", "differentiable")
INTO_GRAD_NUMEL = 1 << 16  # elements from which SGD writes a parameter's update over its gradient (``_into_grad``)


def _rebind(params: List[torch.Tensor], new: List[torch.Tensor]) -> None:
    """Point every parameter at its new tensor; the old tensor stays whole for whoever holds it."""
    for p, n in zip(params, new):
        p.data = n


class _OutOfPlace:
    """``step`` that never writes a tensor a parameter held before it (unless told nobody holds them)."""

    out_of_place = True
    in_place_ok = False  # set per update by ``allow_in_place``
    param_groups: List[Dict[str, Any]]

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Optional[torch.Tensor]:
        if self.in_place_ok:  # no version aliases the weights: torch's own step, no new tensors
            return super().step(closure)  # type: ignore[misc]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rest = False
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and not self._update(group, params):
                _rebind(params, [p.detach().clone() for p in params])  # torch's in-place step writes these
                rest = True
        if rest:
            super().step()  # type: ignore[misc]  # on the copies: groups done above have no .grad left to use
        return loss

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor]) -> bool:
        """Update ``params`` into new tensors where a direct out-of-place step exists; False: not here."""
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad`` minus its profiler span: with ``1f1b-stash`` it runs after every minibatch."""
        if not set_to_none:
            return super().zero_grad(set_to_none)  # type: ignore[misc]
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


class CopyFreeSGD(_OutOfPlace, torch.optim.SGD):
    """``torch.optim.SGD``; without momentum, the update writes the new tensors directly: into the
    gradient's own storage where the gradient may become the weight (``_into_grad``), else new ones."""

    _big: Optional[Set[int]] = None  # ids of the parameters of at least INTO_GRAD_NUMEL elements

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor]) -> bool:
        if group["momentum"] != 0:
            return False
        neg_lr, decay, maximize = -float(group["lr"]), group["weight_decay"], group["maximize"]
        if self._big is None:  # once: sizes never change (the tensors do), and most models have few large ones
            self._big = {id(q) for gr in self.param_groups for q in gr["params"] if q.numel() >= INTO_GRAD_NUMEL}
        rest = params
        if self._big:
            rest = []
            for p in params:
                if id(p) in self._big and _into_grad(p, p.grad):
                    _sgd_over_grad(p, neg_lr, decay, maximize)
                else:
                    rest.append(p)
        if rest:
            grads = [p.grad for p in rest]
            if maximize:
                grads = torch._foreach_neg(grads)
            if decay != 0:
                grads = torch._foreach_add(grads, rest, alpha=decay)
            _rebind(rest, torch._foreach_add(rest, grads, alpha=neg_lr))
        for p in rest:  # done: torch's step, if it runs for other groups, must skip these
            p.grad = None
        return True

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._big = None


def _sgd_over_grad(p: torch.Tensor, neg_lr: float, decay: float, maximize: bool) -> None:
    """torch's single-tensor SGD step (no momentum), op for op, each result written over ``p.grad``,
    which then becomes ``p``'s tensor (torch adds ``-lr * g``: ``neg_lr`` is that factor)."""
    g = p.grad
    if maximize:
        torch.neg(g, out=g)
    if decay != 0:
        torch.add(g, p, alpha=decay, out=g)
    torch.add(p, g, alpha=neg_lr, out=g)
    p.grad = None
    p.data = g


def _into_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> bool:
    """Whether SGD may write ``p``'s new weights over its gradient ``g`` and make that its tensor.

    A new tensor per parameter per update is what made the copy-free step cost
    more than torch's in-place one: allocating it, and a fourth stream of memory
    traffic (the MLP stage of ``tools.bench.runtime``, 2.1 MB of weights, one
    thread on a slow day of a 2-core machine: 0.38 ms into new tensors, 0.18 ms
    over the gradients, 0.13-0.15 ms torch's in place). The gradient is dead after the update, and autograd hands each
    parameter a tensor of its own (it copies one that something else holds),
    so writing over it changes nothing anyone can see. Not where ``g`` is a view
    (a replica all-reduce's flat buffer, whose other parts are other
    parameters' gradients) or laid out unlike ``p``; nor for small parameters
    (``CopyFreeSGD._big``): a dispatch per tensor then costs more than the
    single ``foreach`` call it leaves (the runtime bench's GPT stage, some 50
    tensors of at most 16,384 elements: 0.65 ms per step with every tensor in
    the ``foreach`` call, 0.93 ms with every one over its gradient)."""
    return (g is not None and g._base is None and not g.is_sparse
            and g.dtype == p.dtype and g.device == p.device and g.shape == p.shape
            and g.stride() == p.stride() and g.data_ptr() != p.data_ptr())


class CopyFreeAdamW(_OutOfPlace, torch.optim.AdamW):
    """``torch.optim.AdamW`` stepping on fresh copies of the parameters."""


def copy_free_optimizer(name: str, params: List[nn.Parameter], options: Dict[str, Any]) -> Optional[torch.optim.Optimizer]:
    """The out-of-place ``sgd`` / ``adamw`` over ``params``, or None where its options need torch's own."""
    if any(options.get(k) for k in _UNSUPPORTED) or any(p.is_sparse for p in params):
        return None
    if name == "sgd":
        return CopyFreeSGD(params, **options)
    if name == "adamw":
        return CopyFreeAdamW(params, **options)
    return None


def run_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``; for the out-of-place optimizers, without the wrapper torch puts around
    every optimizer's ``step`` (a profiler span and the step-hook loops).

    ``1f1b-stash`` steps after every microbatch, and on the runtime bench's MLP
    stage that wrapper cost 0.15–0.19 ms a call on a slow day of a 2-core
    machine (0.64–0.83 ms a step through it, 0.49–0.61 ms without), 3 % of a
    microbatch. fxpipe registers no optimizer hooks; global ones
    (``register_optimizer_step_pre_hook``) are skipped for these optimizers,
    as torch's profiler span is."""
    if is_out_of_place(optimizer):
        _OutOfPlace.step(optimizer)  # type: ignore[arg-type]  # the method itself, not the class's wrapped attribute
    else:
        optimizer.step()


def allow_in_place(optimizer: torch.optim.Optimizer, allowed: bool) -> None:
    """Let an out-of-place optimizer's next steps write the weights in place (``allowed``: no stashed
    version aliases them, e.g. on the last stage, whose forwards never wait for an update): torch's own
    step, with no new tensor per parameter. No effect on other optimizers."""
    if is_out_of_place(optimizer):
        optimizer.in_place_ok = allowed  # type: ignore[attr-defined]


def is_out_of_place(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` leaves the tensors it replaces untouched (a stash may then alias them)."""
    return bool(getattr(optimizer, "out_of_place", False))
