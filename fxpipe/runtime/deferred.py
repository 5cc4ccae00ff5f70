"""Zero-bubble's weight half for Linear and convolution layers: their weight gradients deferred to ``W``.

``fxpipe.runtime.wgrad`` splits any stage's backward on its autograd graph:
``B`` asks the engine for the received values' gradients only, ``W``
restarts the engine once per node that leads to parameters. That costs a
Python walk of the graph in ``B``, and in ``W`` one engine start per node,
each walking everything below it again: on the runtime benchmark's stages
(``tools.bench.split_backward``, one process, one thread), forward + ``B`` +
``W`` took 1.16-1.34x forward + one whole backward, more than the bubble the
schedule removes.

A Linear layer's weight gradient needs nothing from autograd: it is
``dy^T x`` (and ``dy`` summed for the bias), from the layer's input ``x`` and
the gradient ``dy`` of its output; a convolution's is the same product as a
correlation (``torch.nn.grad.conv2d_weight``). So a stage made only of such
layers and of layers with cheap weight gradients (norms, embeddings) splits
without the engine's help:

- in the forward, each such layer runs on detached weights, so the autograd
  graph holds the input path only (autograd then skips the weight's matmul),
  and a pre-hook on the output's node records ``dy`` when ``B`` reaches it;
- ``B`` is one ordinary backward: received values' gradients, the cheap
  weights' gradients, and per layer call its ``(x, dy)``; the graph is freed;
- ``W`` computes each recorded call's weight product and accumulates it into
  the weight's ``.grad`` (and ``dy`` summed into the bias's).

On the same stages that takes 0.94-1.09x (``B`` + ``W`` cost what the
whole backward does; what remains is a pre-hook and detached views per layer
call in the forward), and ``W`` keeps each call's input and output gradient
alive instead of the whole graph. Megatron-LM's zero-bubble schedules defer Linear weight
gradients the same way. Stages holding other weights (parameters used
directly by the graph, attention modules with their own projections) keep
the generic split: computing their weight gradients in ``B`` would put the
work zero-bubble moves back into it. Only the classes themselves qualify
(``nn.Linear``, ``nn.Conv1d/2d/3d`` with zero padding given as numbers), not
subclasses, which may compute something else.

A deferred layer's input is read again in ``W``; if the stage wrote into it
in place after the layer ran, the gradient would be wrong, so its version is
recorded and ``W`` raises instead. Values are computed in the dtype the
forward ran in (autocast's, cast the same way) and accumulated in the
weight's own dtype.

With recomputation (``fxpipe.runtime.recompute``) the stage's forward runs
twice: in ``F`` without keeping activations (autograd's graph, and so the
hooks that record each call's output gradient, come from this run), then in
``B`` again to give autograd its saved tensors. An input kept from the first
run would live from ``F`` to ``W``, which is what recomputation avoids, so
that run leaves each call a slot (``Replayed``) and the recompute fills it
with the same input recomputed: kept from ``B`` to ``W``, as without
recomputation.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from passes.errors import FxpipeError

# modules whose weight gradient costs little next to their input gradient: computed in B as they are
CHEAP = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.Embedding) + \
    ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

# one deferred layer call: (layer, weight, bias or None, [its input, the input's version], the output's gradient);
# the input's slot is filled at once, or by the recompute in B where the stage recomputes (``Replayed``)
Entry = Tuple[nn.Module, torch.Tensor, Optional[torch.Tensor], list, torch.Tensor]


class Replayed:
    """The deferred layer calls of one recomputed forward, in call order (the module docstring): the first
    run appends an empty slot per call, each recompute fills them again from the first."""

    def __init__(self) -> None:
        self.slots: List[list] = []
        self.next = 0


_RUN: contextvars.ContextVar = contextvars.ContextVar("fxpipe_deferred_run", default=None)


@contextmanager
def replaying(calls: Replayed, again: bool) -> Iterator[None]:
    """Deferring layers called inside record their inputs in ``calls``: leave slots (the first run), or
    fill them (``again``: a recompute, which may run more than once)."""
    calls.next = 0
    token = _RUN.set((calls, again))
    try:
        yield
    finally:
        _RUN.reset(token)


class DeferredGradError(FxpipeError):
    """A deferred weight gradient that can no longer be computed exactly."""


class WeightGradDeferral:
    """The deferrable layers of one stage, with their weight gradients deferred while ``enabled``.

    ``collect()`` before a microbatch's backward starts a list the layers'
    pre-hooks fill; ``done()`` after it returns that list as a ``Deferred``
    to run at ``W``. A backward outside ``collect`` / ``done`` (a tool
    running the stage) gets its weight gradients at once, as usual.
    """

    def __init__(self, layers: Dict[str, nn.Module]) -> None:
        self.layers = layers
        self.enabled = False
        self._open: Optional[List[Entry]] = None
        for name, layer in layers.items():
            # a subclass whose forward defers (a class attribute: as cheap to call as the layer's own)
            layer.__class__ = _DEFERRING[type(layer)]
            object.__setattr__(layer, "_fxpipe_deferral", (self, name))

    def collect(self) -> None:
        self._open = []

    def done(self) -> "Deferred":
        entries, self._open = self._open or [], None
        return Deferred(entries)

    def remove(self) -> None:
        """Give every layer back its own class and forward."""
        for layer in self.layers.values():
            layer.__class__ = layer.__class__.__bases__[-1]
            layer.__dict__.pop("_fxpipe_deferral", None)
        self.layers = {}

    def _take(self, layer: nn.Module, weight: torch.Tensor, bias: Optional[torch.Tensor], kept: list,
              grad_outputs: tuple) -> None:
        if grad_outputs[0] is None:  # no gradient reached the output: nothing to add
            return
        entry = (layer, weight, bias, kept, grad_outputs[0])
        if self._open is None:
            _accumulate(entry)
        else:
            self._open.append(entry)


class Deferred:
    """The weight half of one microbatch's backward: ``run`` once (``WeightGrad``'s interface)."""

    def __init__(self, entries: List[Entry]) -> None:
        self.entries = entries

    def run(self) -> None:
        entries, self.entries = self.entries, []
        for entry in entries:
            _accumulate(entry)


def defer_weight_grads(module: nn.Module) -> Optional[WeightGradDeferral]:
    """``module``'s Linear and convolution layers set up for deferral, or None where the stage does not qualify
    (``qualifies``). Layers run as before until ``enabled`` is set."""
    layers = _layers(module)
    return None if layers is None else WeightGradDeferral(layers)


def qualifies(module: nn.Module) -> bool:
    """Whether ``module``'s weight gradients can be deferred, without changing it (what the prediction asks:
    a recomputing stage that does not qualify runs its whole backward in ``B``).

    A stage qualifies when it has a deferrable layer (``_deferrable``) and
    every other trainable parameter belongs to such a layer or to a module of
    a ``CHEAP`` type.
    """
    return _layers(module) is not None


def _layers(module: nn.Module) -> Optional[Dict[str, nn.Module]]:
    layers: Dict[str, nn.Module] = {}
    cheap: set = set()
    for name, sub in module.named_modules():
        if _deferrable(sub):
            layers[name] = sub
            cheap.update(id(p) for p in sub.parameters(recurse=False))
        elif isinstance(sub, CHEAP):
            cheap.update(id(p) for p in sub.parameters(recurse=False))
    if not layers or any(p.requires_grad and id(p) not in cheap for p in module.parameters()):
        return None
    return layers


def _deferrable(sub: nn.Module) -> bool:
    """The class itself (a subclass may compute something else), its own forward, parameters as weights;
    a convolution with zero padding given as numbers (``"same"`` may pad one side more)."""
    if type(sub) not in _DEFERRING or parametrize.is_parametrized(sub) or "forward" in sub.__dict__ \
            or not isinstance(sub.weight, nn.Parameter):
        return False
    if isinstance(sub, nn.Linear):
        return True
    return sub.padding_mode == "zeros" and not isinstance(sub.padding, str)


class _Defers:
    """The deferring forward, shared by the subclasses below (``plain`` runs the layer on given weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grads, _ = self._fxpipe_deferral
        weight, bias = self.weight, self.bias
        if not (grads.enabled and weight.requires_grad and x.requires_grad and torch.is_grad_enabled()):
            return self.plain(x, weight, bias)  # nothing to defer (a first layer on data: its weights go in B)
        deferred_bias = bias if bias is not None and bias.requires_grad else None
        calls, again = _RUN.get() or (None, False)
        x_kept = x.detach()  # shares x's version counter: an in-place write after this call shows in W
        if again:  # a recompute: the first run's slot gets this call's input (before the layer runs: the
            # recompute may stop inside it once autograd has every tensor it saved)
            if calls.next >= len(calls.slots):
                raise DeferredGradError("a recomputed forward called more deferring layers than the first run")
            calls.slots[calls.next][:] = [x_kept, x_kept._version]
            calls.next += 1
        out = self.plain(x, weight.detach(), bias.detach() if deferred_bias is not None else bias)
        if not again:  # the graph B runs is this run's; recomputed later, the slot waits for the recompute
            kept = [x_kept, x_kept._version] if calls is None else []
            if calls is not None:
                calls.slots.append(kept)
            out.grad_fn.register_prehook(partial(grads._take, self, weight, deferred_bias, kept))
        return out


class _DeferringLinear(_Defers, nn.Linear):
    def plain(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def products(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: bool
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).to(dy2.dtype)  # autocast: the matmul read x cast to dy's dtype
        return dy2.t().mm(x2), (dy2.sum(0) if bias else None)


class _DeferringConv(_Defers):
    dims = 0
    weight_grad = None

    def plain(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self._conv_forward(x, weight, bias)

    def products(self, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: bool
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if x.dim() == self.dims + 1:  # an unbatched input
            x, dy = x.unsqueeze(0), dy.unsqueeze(0)
        grad = type(self).weight_grad(x.to(dy.dtype), weight.shape, dy, self.stride, self.padding, self.dilation,
                                      self.groups)
        return grad, (dy.sum([d for d in range(dy.dim()) if d != 1]) if bias else None)


class _DeferringConv1d(_DeferringConv, nn.Conv1d):
    dims, weight_grad = 1, staticmethod(torch.nn.grad.conv1d_weight)


class _DeferringConv2d(_DeferringConv, nn.Conv2d):
    dims, weight_grad = 2, staticmethod(torch.nn.grad.conv2d_weight)


class _DeferringConv3d(_DeferringConv, nn.Conv3d):
    dims, weight_grad = 3, staticmethod(torch.nn.grad.conv3d_weight)


_DEFERRING = {nn.Linear: _DeferringLinear, nn.Conv1d: _DeferringConv1d, nn.Conv2d: _DeferringConv2d,
              nn.Conv3d: _DeferringConv3d}


def _accumulate(entry: Entry) -> None:
    layer, weight, bias, kept, dy = entry
    if not kept:  # a recomputed stage's slot (``Replayed``) the recompute never filled
        _, name = layer._fxpipe_deferral
        raise DeferredGradError(f"layer '{name}' got its output gradient but the recompute never ran it "
                                "again, so its deferred weight gradient has no input; train this stage "
                                "without --recompute or with --schedule 1f1b-flush")
    x, version = kept
    if x._version != version:
        _, name = layer._fxpipe_deferral
        raise DeferredGradError(
            f"the input of layer '{name}' ({type(layer).__bases__[-1].__name__}) was written in place after "
            "the layer read it, so its deferred weight gradient would be wrong; write the model without that "
            "in-place operation or train with a schedule without W (--schedule 1f1b-flush)")
    grad, bias_grad = layer.products(x, dy, weight, bias is not None)
    _add_grad(weight, grad)
    if bias is not None:
        _add_grad(bias, bias_grad)


def _add_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """What autograd's accumulation does for a dense gradient: take it, or add it to the one there."""
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
