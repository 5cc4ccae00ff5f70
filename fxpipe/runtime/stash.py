"""Weight versions for one stage: the forward's weights are the backward's weights.

PipeDream's 1F1B keeps several minibatches in flight per stage and updates the
weights after every backward, so by the time minibatch ``m`` runs its
backward the stage's weights have moved on. Correct gradients need the weights
``m``'s forward saw. PipeDream swapped them in with ``load_state_dict``; on
current PyTorch autograd rejects that, because the saved tensors of ``m``'s
graph were modified in place.

So the stash never mutates a tensor that a graph saved. The module's own
parameters are the *master* copy that the optimizer updates. In stash mode each
weight version is a set of detached clones of the master (made lazily at the
first forward after a step), and a forward runs the stage on its version
(the version's tensors put in the parameter slots for the call, as
``torch.func.functional_call`` does; that function itself when a parameter
is tied under two names). The backward accumulates into
the version's ``.grad``; ``backward_done`` moves that into the master's
``.grad`` and drops the version once no microbatch in flight uses it. Buffers
(BatchNorm statistics) are not versioned: they are the module's own.

Without stashing (flush, gpipe) there is one version, the master itself, and
the stage is simply called; no copy is made.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn
from torch.func import functional_call


class WeightStash:
    def __init__(self, module: nn.Module, stash: bool) -> None:
        self.module = module
        self.stash = stash
        self.master: Dict[str, nn.Parameter] = dict(module.named_parameters())
        # functional_call's weight tying scans the module on every call; only pay for it when a
        # parameter really is registered under two names in this stage
        self._tied = len(list(module.named_parameters(remove_duplicate=False))) != len(self.master)
        # where each parameter lives: (owning submodule's _parameters dict, leaf name), for the swap
        self._slots = [(module.get_submodule(n.rpartition(".")[0])._parameters, n.rpartition(".")[2], n)
                       for n in self.master]
        self.version = 0  # the version the next forward uses
        self._versions: Dict[int, Dict[str, torch.Tensor]] = {}
        self._users: Dict[int, int] = {}  # version -> microbatches in flight on it
        self._mb_version: Dict[int, int] = {}

    @property
    def versions_kept(self) -> int:
        """How many weight versions are alive (PipeDream: one per minibatch in flight)."""
        return len(self._versions)

    def forward(self, mb: int, args: Any, versioned: bool = True,
                wrap: Optional[Callable[[Callable[..., Any], Any], Any]] = None) -> Any:
        """Run the stage for microbatch ``mb`` on the current version and remember which.

        ``versioned=False``: the caller knows no update happens before ``mb``'s
        backward (the last stage's ``F m, B m, STEP``), so the master itself
        is safe to use and no copy is made. ``wrap(call, args)``, if given,
        runs the call (recomputation calls it again in backward: ``call``
        puts the same weight version in place each time).
        """
        run = wrap or (lambda call, a: call(*a))
        if not self.stash or not versioned:
            return run(self.module, args)
        v = self.version
        if v not in self._versions:
            self._versions[v] = {n: p.detach().clone().requires_grad_(p.requires_grad)
                                 for n, p in self.master.items()}
        self._users[v] = self._users.get(v, 0) + 1
        self._mb_version[mb] = v
        weights = self._versions[v]
        if self._tied:
            return run(lambda *a: functional_call(self.module, weights, a, strict=False, tie_weights=True), args)
        return run(lambda *a: self._call_on(weights, a), args)

    def _call_on(self, weights: Dict[str, torch.Tensor], args: Any) -> Any:
        """Call the stage with ``weights`` in its parameter slots, then put the master back.

        What ``functional_call`` does, minus its per-call name resolution and
        checks (a quarter of a millisecond per forward on a GPT stage): the
        slots are resolved once, the swap is two dict writes per parameter.
        """
        slots = self._slots
        for d, leaf, name in slots:
            d[leaf] = weights[name]
        try:
            return self.module(*args)
        finally:
            for d, leaf, name in slots:
                d[leaf] = self.master[name]

    def backward_done(self, mb: int) -> None:
        """Move ``mb``'s gradients onto the master and release its version."""
        if mb not in self._mb_version:  # ran on the master: its gradients are already there
            return
        v = self._mb_version.pop(mb)
        for name, t in self._versions[v].items():
            if t.grad is None:
                continue
            p = self.master[name]
            p.grad = t.grad if p.grad is None else p.grad + t.grad
            t.grad = None
        self._users[v] -= 1
        self._release(v)

    def forget(self, mb: int) -> None:
        """Drop ``mb`` without a backward (its forward produced nothing to differentiate)."""
        if self.stash and mb in self._mb_version:
            v = self._mb_version.pop(mb)
            self._users[v] -= 1
            self._release(v)

    def stepped(self) -> None:
        """The optimizer updated the master: later forwards use a new version."""
        if not self.stash:
            return
        old = self.version
        self.version += 1
        self._release(old)

    def _release(self, v: int) -> None:
        if self._users.get(v, 0) == 0 and v != self.version:
            self._versions.pop(v, None)
            self._users.pop(v, None)
