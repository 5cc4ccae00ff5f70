"""Where a rank gets microbatch ``g``'s inputs and targets.

Every rank reads the data itself (model inputs are cheap to load everywhere;
the split never ships them): the stages that consume model inputs pick their
positional inputs, the last stage the targets. All ranks must therefore see
the same sequence, so ``batches()`` must be deterministic (seed it).

A model file's ``batches()`` yields ``(inputs, targets)``; an item holding
exactly one microbatch (the example's batch size) is one microbatch, an item
holding ``M`` times that is a whole step and is cut into ``M`` along dim 0.
When ``batches()`` runs out it starts again (a new epoch). Without
``batches()`` every microbatch is the example minibatch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple

import torch

from passes.errors import FxpipeError

Micro = Tuple[Tuple[Any, ...], Any]


class DataError(FxpipeError):
    """``batches()`` yielded something the pipeline cannot cut into microbatches."""


_NOTHING = "batches() yielded nothing"


def pair(item: Any) -> Tuple[Any, Any]:
    """``(inputs, targets)`` of one item ``batches()`` yielded."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise DataError(f"batches() must yield (inputs, targets) pairs, got {type(item).__name__}")
    return item[0], item[1]


def first_pair(batches: Callable[[], Iterable[Any]]) -> Tuple[Any, Any]:
    """The first ``(inputs, targets)`` of a fresh ``batches()`` stream."""
    for item in batches():
        return pair(item)
    raise DataError(_NOTHING)


def as_tuple(x: Any) -> Tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def batch_dim(inputs: Sequence[Any]) -> int:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise DataError("batches() yielded inputs without any batched tensor")


def _chunk(x: Any, n: int, i: int) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        return x.chunk(n, dim=0)[i]
    if isinstance(x, (tuple, list)):
        return type(x)(_chunk(y, n, i) for y in x)
    return x


class RepeatExample:
    """Every microbatch is the example minibatch (no ``batches()``)."""

    def __init__(self, inputs: Sequence[Any], targets: Any) -> None:
        self.item = (tuple(inputs), targets)

    def __call__(self, g: int) -> Micro:
        return self.item


class FromBatches:
    """Microbatch ``g`` of the stream ``batches()`` yields; restarts it at the end."""

    def __init__(self, batches: Callable[[], Iterable[Any]], micro_size: int, microbatches: int) -> None:
        self.batches = batches
        self.micro_size = micro_size
        self.microbatches = microbatches
        self._it: Optional[Iterator[Any]] = None
        self._next = 0  # global index of the next microbatch the stream gives
        self._cache: Dict[int, Micro] = {}

    def __call__(self, g: int) -> Micro:
        if g < self._next and g not in self._cache:
            self._it, self._next, self._cache = None, 0, {}  # went back (resume): replay from the start
        while g >= self._next:
            for item in self._cut(self._pull()):
                self._cache[self._next] = item
                self._next += 1
        for old in [k for k in self._cache if k < g - 4 * self.microbatches]:
            del self._cache[old]
        return self._cache[g]

    def _pull(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.batches())
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
        raise DataError(_NOTHING)

    def _cut(self, item: Any) -> Sequence[Micro]:
        inputs, targets = pair(item)
        inputs = as_tuple(inputs)
        n = batch_dim(inputs)
        if n == self.micro_size:
            return [(inputs, targets)]
        if n == self.micro_size * self.microbatches:
            m = self.microbatches
            return [(tuple(_chunk(x, m, i) for x in inputs), _chunk(targets, m, i)) for i in range(m)]
        raise DataError(f"batches() yielded a batch of {n} samples; the pipeline needs one microbatch "
                        f"({self.micro_size}, the example's batch size) or one step "
                        f"({self.micro_size} x {self.microbatches} microbatches = {self.micro_size * self.microbatches})")
