"""Activation recomputation for a stage: keep its inputs, recompute the rest in backward.

The stage's forward runs inside ``torch.utils.checkpoint`` (non-reentrant):
autograd keeps the graph but none of the tensors it saved; the backward runs
the forward again to get them. What stays alive per microbatch in flight is
the stage's inputs (model inputs and received values) instead of every
activation, for one extra forward per backward.

Two things make a pipeline stage different from a plain module:

- its forward talks to the mailbox (``passes.comm.send/recv``). The recompute
  happens inside ``B m``, long after ``m``'s values were received and sent, so
  it must not touch the mailbox again: the first run records every received
  value, the recompute gets the same values back (same ``requires_grad``, so
  autograd saves the same tensors) and its sends go nowhere;
- with weight stashing the recompute must see the weights the forward saw:
  ``WeightStash.forward`` hands this module the whole call (version swap
  included) as ``call``, so the recompute swaps the same version in again;
- with a split backward (``zb-h1``) a Linear or convolution layer's deferred
  weight gradient needs the layer's input in ``W``: the recompute hands it
  over (``fxpipe.runtime.deferred.Replayed``), so it lives from ``B`` to
  ``W`` only. A stage whose backward splits on the autograd graph
  (``fxpipe.runtime.wgrad``) would recompute its forward again for every
  engine call in ``W``; recomputing, it runs its whole backward in ``B``
  (the executor) and its ``W`` is empty.

Randomness (dropout) is replayed: checkpoint restores the RNG state, and the
autocast state, of the first run. Buffers the forward writes (BatchNorm's
running statistics and batch count) must change once per microbatch, as
without recomputation, so ``Buffers`` puts them back after every recompute
(``torch.utils.checkpoint`` alone would update them twice), and the
recompute reads them as the microbatch's forward found them: other
microbatches' forwards have updated them since, and a forward whose output
depends on one (a running statistic used in training, a counter) would
otherwise recompute other activations. Which buffers a stage writes is found
on its first forward: BatchNorm's kernel updates its running statistics
without bumping their version counter, so the values are compared too. Each
microbatch in flight keeps a copy of those buffers (BatchNorm: two vectors
and a count a layer).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from fxpipe.runtime.deferred import Replayed, replaying
from passes.capture_check import restore_buffers
from passes import comm
from passes.errors import FxpipeError

RECOMPUTE = ("none", "all", "auto")


class _Recording:
    """First run: the mailbox itself, remembering what each ``recv`` returned."""

    def __init__(self, box: comm.Transport) -> None:
        self.box = box
        self.received: Dict[str, Any] = {}

    def send(self, tag: str, value: Any, dst: int) -> Any:
        return self.box.send(tag, value, dst)

    def recv(self, tag: str, src: int, shape: Any, dtype: Any, requires_grad: bool) -> Any:
        value = self.box.recv(tag, src, shape, dtype, requires_grad)
        self.received[tag] = value
        return value


class _Replay:
    """Recompute: the recorded values again, and sends that go nowhere."""

    def __init__(self, received: Dict[str, Any]) -> None:
        self.received = received

    def send(self, tag: str, value: Any, dst: int) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value.new_zeros(())  # the token's value is never used: the recompute's graph is dropped
        return None

    def recv(self, tag: str, src: int, shape: Any, dtype: Any, requires_grad: bool) -> Any:
        value = self.received[tag]
        if isinstance(value, torch.Tensor):
            if value.requires_grad:  # not a leaf, as the first forward's (comm's recv): the stage may
                return value.detach().requires_grad_().clone()  # write it in place (ReLU(inplace=True))
            return value.detach()
        return value


class Buffers:
    """The buffers a stage's forward writes: as each microbatch's forward found them during its
    recompute, and as they are after it.

    ``first_run`` wraps a forward and returns its output with a copy of those
    buffers from before it; on the stage's first forward it compares every
    buffer before and after (version counter and value) and remembers those
    written. ``as_before(copy)`` then runs a recompute on that copy and writes
    the current values back after it. A buffer the first forward leaves alone
    is never copied.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.written: Optional[List[torch.Tensor]] = None

    def first_run(self, call: Callable[[], Any]) -> Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor]]]:
        if self.written is not None:
            found = [(b, b.detach().clone()) for b in self.written]
            return call(), found
        before = {id(b): (b, b._version, b.detach().clone()) for b in self.module.buffers()}
        out = call()
        self.written = [b for b, version, old in before.values()
                        if b._version != version or not torch.equal(b, old)]
        return out, [(b, old) for b, version, old in before.values() if any(b is w for w in self.written)]

    @contextmanager
    def as_before(self, found: List[Tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
        now = [(b, b.detach().clone()) for b, _ in found]
        restore_buffers(found)
        try:
            yield
        finally:
            restore_buffers(now)


def recomputed(call: Callable[..., Any], args: Sequence[Any], box: comm.Transport,
               buffers: Optional[Buffers] = None) -> Any:
    """``call(*args)`` with ``box`` bound, its activations recomputed in backward instead of kept; the
    recompute leaves ``buffers`` (the stage's, ``Buffers``) as it found them."""
    recording = _Recording(box)
    state: Dict[str, Optional[Any]] = {"first": recording}
    calls = Replayed()  # deferred weight gradients' inputs, from the recompute (``fxpipe.runtime.deferred``)

    found: List[Tuple[torch.Tensor, torch.Tensor]] = []  # the written buffers as the forward found them

    def run(*a: Any) -> Any:
        first = state["first"]
        state["first"] = None
        with comm.bind(first if first is not None else _Replay(recording.received)), replaying(calls, first is None):
            if buffers is None:
                return call(*a)
            if first is not None:
                out, kept = buffers.first_run(lambda: call(*a))
                found.extend(kept)
                return out
            with buffers.as_before(found):
                return call(*a)

    return checkpoint(run, *args, use_reentrant=False)


def check_recompute(mode: str) -> None:
    """Raise unless ``mode`` is one of ``RECOMPUTE``."""
    if mode not in RECOMPUTE:
        raise FxpipeError(f"--recompute {mode!r} is not one of {', '.join(RECOMPUTE)}")


def recomputes(mode: str, auto_stages: Optional[Sequence[int]], stage: int) -> bool:
    """Whether ``stage`` recomputes under ``--recompute mode`` (auto: the planner's per-stage choice)."""
    check_recompute(mode)
    if mode == "auto":
        return stage in (auto_stages or ())
    return mode == "all"


def auto_stages(split: Any, memory: Optional[int], log: Callable[[str], None] = print) -> List[int]:
    """``--recompute auto``: the stages whose predicted memory without recomputation exceeds ``memory``.

    Needs the split's plan and profile (a split made in this run); without
    ``memory`` no stage recomputes. A stage still over ``memory`` with
    recomputation is logged, not refused (the prediction is an estimate).
    """
    from passes.partition.costmodel import evaluate, recompute_choice, recompute_cost, stage_input_bytes

    plan, graph = getattr(split, "plan", None), getattr(split, "profile", None)
    if memory is None:
        log("--recompute auto without --memory: no stage recomputes")
        return []
    if plan is None or graph is None:
        raise FxpipeError("--recompute auto needs the plan and profile of a split made in this run; "
                          "drop --split, or use --recompute all")
    opts = plan.cost_options(memory=memory)
    assignment, replicas = plan.assignment(), [s.replicas for s in plan.stages]
    choice = recompute_choice(graph, assignment, replicas, opts)
    for j, s in enumerate(evaluate(graph, assignment, replicas, opts).stages):
        again = recompute_cost(s, stage_input_bytes(graph, assignment, j), j, replicas, opts)
        note = " (still over --memory)" if choice[j] and again.memory_bytes > memory else ""
        log(f"--recompute auto: stage {j} predicted {s.memory_bytes / 2**20:.1f} MiB, "
            f"{again.memory_bytes / 2**20:.1f} MiB recomputing: {'recompute' if choice[j] else 'keep'}{note}")
    return [j for j, yes in enumerate(choice) if yes]
