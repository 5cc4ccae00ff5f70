"""Weight versions for one stage: the forward's weights are the backward's weights.

PipeDream's 1F1B keeps several minibatches in flight per stage and updates the
weights after every backward, so by the time minibatch ``m`` runs its
backward the stage's weights have moved on. Correct gradients need the weights
``m``'s forward saw. PipeDream swapped them in with ``load_state_dict``; on
current PyTorch autograd rejects that, because the saved tensors of ``m``'s
graph were modified in place.

So the stash never mutates a tensor that a graph saved. The module's own
parameters are the *master* that the optimizer updates; a forward that an
update will overtake runs on a *version*: a dict of tensors put in the
parameter slots for the call (as ``torch.func.functional_call`` does; that
function itself when a parameter is tied under two names). How a version is
made depends on the optimizer:

- *copy-free* (``fxpipe.runtime.optim``'s out-of-place optimizers): a version
  is a set of aliases (``.data``) of the master's tensors. The optimizer then
  rebinds each parameter to a new tensor instead of writing the old one, so
  the aliases keep the weights the forward saw, and the stash copies nothing (the
  optimizer's step may: AdamW and SGD with momentum clone before torch's fused step);
- *copy* (any in-place optimizer): a version is a set of detached clones.

Either is made lazily at the first forward that needs it. The backward
accumulates into the version's ``.grad``; ``gather_grads`` (before the
update reads them) moves that into the master's ``.grad``, and
``backward_done`` drops the version once no microbatch in flight uses it and
no later forward will (PipeDream frees a version after its last backward).
Buffers (BatchNorm statistics) are not versioned: they are the module's own.

Which version a forward uses: the newest (``1f1b-stash``), or with
``batch=M`` (``2bw``) the version ``b - 1`` for global microbatch ``g`` of
batch ``b = g // M`` (version ``k`` = the weights after ``k`` updates), which
``before_update`` keeps alive across the update that makes version ``b``.

Without stashing (flush, gpipe) there is one version, the master itself, and
the stage is simply called; no copy is made.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set

import torch
import torch.nn as nn
from torch.func import functional_call

from passes.errors import FxpipeError


class StashError(FxpipeError):
    """A forward asked for a weight version the stash no longer (or not yet) holds."""


class WeightStash:
    def __init__(self, module: nn.Module, stash: bool, copy_free: bool = False, batch: Optional[int] = None) -> None:
        """``copy_free``: the optimizer updates out of place (versions alias the master);
        ``batch``: 2bw's batch size (forwards of batch ``b`` use version ``b - 1``)."""
        self.module = module
        self.stash = stash
        self.copy_free, self.batch = copy_free, batch
        self.master: Dict[str, nn.Parameter] = dict(module.named_parameters())
        self._names = list(self.master)
        self._params = list(self.master.values())
        # functional_call's weight tying scans the module on every call; only pay for it when a
        # parameter really is registered under two names in this stage
        self._tied = len(list(module.named_parameters(remove_duplicate=False))) != len(self.master)
        # where each parameter lives: (owning submodule's _parameters dict, leaf name), for the swap
        self._slots = [(module.get_submodule(n.rpartition(".")[0])._parameters, n.rpartition(".")[2])
                       for n in self._names]
        self.version = 0  # the master's version: updates applied so far
        # version -> its tensors, in the master's order (lists: every per-microbatch walk is a zip)
        self._versions: Dict[int, List[torch.Tensor]] = {}
        self._users: Dict[int, int] = {}  # version -> microbatches in flight on it
        self._mb_version: Dict[int, int] = {}
        self._pending: Set[int] = set()  # versions holding gradients the master has not received yet

    @property
    def versions_kept(self) -> int:
        """How many weight versions are alive (PipeDream: one per minibatch in flight)."""
        return len(self._versions)

    def forward(self, mb: int, args: Any, versioned: bool = True,
                wrap: Optional[Callable[[Callable[..., Any], Any], Any]] = None) -> Any:
        """Run the stage for microbatch ``mb`` on its version (see the module docstring) and remember which.

        ``versioned=False``: the caller knows no update happens before ``mb``'s
        backward (the last stage's ``F m, B m, STEP``), so the master itself
        is safe to use and no copy is made. ``wrap(call, args)``, if given,
        runs the call (recomputation calls it again in backward: ``call``
        puts the same weight version in place each time).
        """
        run = wrap or (lambda call, a: call(*a))
        if not self.stash:
            return run(self.module, args)
        v = self._version_of(mb)
        if v == self.version and not versioned:
            return run(self.module, args)
        if v == self.version:
            self.keep_current()
        elif v not in self._versions:
            raise StashError(f"microbatch {mb} needs weight version {v}, but this stage is at version "
                             f"{self.version} and keeps {sorted(self._versions)}: the schedule runs it out of order")
        self._users[v] = self._users.get(v, 0) + 1
        self._mb_version[mb] = v
        weights = self._versions[v]
        if self._tied:
            named = dict(zip(self._names, weights))
            return run(lambda *a: functional_call(self.module, named, a, strict=False, tie_weights=True), args)
        return run(lambda *a: self._call_on(weights, a), args)

    def _version_of(self, mb: int) -> int:
        return self.version if self.batch is None else max(0, mb // self.batch - 1)

    def keep_current(self) -> None:
        """Make the current weights a version of their own (aliases or copies), once; the first
        forward after an update that needs a version of its own does it."""
        if self.version not in self._versions:
            # copy-free: ``.data`` shares the storage but not the version counter, so the optimizer's
            # in-place work on the parameter's next tensor does not look like a write to this one
            take = (lambda p: p.data) if self.copy_free else (lambda p: p.detach().clone())
            self._versions[self.version] = [take(p).requires_grad_(p.requires_grad) for p in self._params]

    def before_update(self) -> None:
        """Called right before the optimizer changes the master: 2bw's next batch runs on these weights."""
        if self.stash and self.batch is not None:
            self.keep_current()

    @property
    def holds_master(self) -> bool:
        """A kept version aliases the master's current tensors: an update must not write them in place."""
        return self.copy_free and self.version in self._versions

    def _call_on(self, weights: List[torch.Tensor], args: Any) -> Any:
        """Call the stage with ``weights`` in its parameter slots, then put the master back.

        What ``functional_call`` does, minus its per-call name resolution and
        checks (a quarter of a millisecond per forward on a GPT stage): the
        slots are resolved once, the swap is two dict writes per parameter.
        """
        slots = self._slots
        for (d, leaf), w in zip(slots, weights):
            d[leaf] = w
        try:
            return self.module(*args)
        finally:
            for (d, leaf), p in zip(slots, self._params):
                d[leaf] = p

    def backward_done(self, mb: int) -> None:
        """``mb``'s backward ran: release its version once nothing needs it (its gradients reach the
        master at ``gather_grads``, or when the version is dropped)."""
        if mb not in self._mb_version:  # ran on the master: its gradients are already there
            return
        v = self._mb_version.pop(mb)
        self._pending.add(v)
        self._users[v] -= 1
        self._release(v)

    def gather_grads(self) -> None:
        """Move the gradients that versions accumulated onto the master; call before reading the
        master's gradients (all-reduce, clipping, the update).

        Once per update, not per microbatch: autograd already sums the
        microbatches of one version in its ``.grad``, so each version's sum
        moves once, and where the master has no gradient yet (every
        ``1f1b-stash`` update, the first version of a ``2bw`` batch) the
        move is a hand-over, with no pass over the gradients.
        """
        for v in sorted(self._pending):
            self._move_grads(self._versions[v])
        self._pending.clear()

    def _move_grads(self, weights: List[torch.Tensor]) -> None:
        """A version's gradients onto the master: handed over where the master has none, otherwise
        added in place in one ``foreach`` call (no new gradient tensor per parameter)."""
        into, add = [], []
        for p, t in zip(self._params, weights):
            g = t.grad
            if g is None:
                continue
            t.grad = None
            if p.grad is None:
                p.grad = g
            else:
                into.append(p.grad)
                add.append(g)
        if into:
            torch._foreach_add_(into, add)

    def forget(self, mb: int) -> None:
        """Drop ``mb`` without a backward (its forward produced nothing to differentiate)."""
        if self.stash and mb in self._mb_version:
            v = self._mb_version.pop(mb)
            self._users[v] -= 1
            self._release(v)

    def stepped(self) -> None:
        """The optimizer updated the master: later forwards use a newer version."""
        if not self.stash:
            return
        self.version += 1
        for v in list(self._versions):
            self._release(v)

    def older_state(self) -> Optional[Dict[str, Any]]:
        """What a checkpoint needs besides the master (2bw, at a step boundary): the version the next
        batch's forwards run on (``version - 1``), with the master's version number; None elsewhere."""
        if not self.stash or self.batch is None or self.version == 0:
            return None
        older = self._versions.get(self.version - 1)
        if older is None:
            raise StashError(f"2bw checkpoint at version {self.version}: version {self.version - 1}, which the "
                             "next batch runs on, is not kept")
        return {"version": self.version, "older": {n: t.detach().clone() for n, t in zip(self._names, older)}}

    def load_older_state(self, state: Dict[str, Any]) -> None:
        """``older_state`` back (``--resume``): the master's version number and the version before it."""
        older = state["older"]
        missing = [n for n in self._names if n not in older]
        if missing:
            raise StashError(f"the checkpoint's older 2bw weights lack {missing[0]}")
        self.version = int(state["version"])
        self._versions[self.version - 1] = [
            older[n].to(p.device, p.dtype).requires_grad_(p.requires_grad) for n, p in zip(self._names, self._params)]

    def _release(self, v: int) -> None:
        """Drop ``v`` once no microbatch in flight uses it and no later forward will."""
        oldest_needed = self.version if self.batch is None else self.version - 1
        if self._users.get(v, 0) == 0 and v < oldest_needed:
            if v in self._pending:  # its gradients still count
                self._pending.discard(v)
                self._move_grads(self._versions[v])
            self._versions.pop(v, None)
            self._users.pop(v, None)
