"""The schedule's instruction set: what one rank does, one action at a time.

A schedule is a pure function producing ``{rank: [Action, ...]}``; the executor
walks each list in order and never reorders it; the simulator and the validator
walk the same lists. An action prints compactly (``F3``, ``SEND_F3>r2``,
``STEP``) and ``Action.parse`` reads that form back, so schedules can be
written by hand in tests.

Kinds:
- ``F m`` / ``B m``: forward / backward of microbatch (or minibatch) ``m`` on
  this rank's stage;
- ``W m``: the weight-gradient half of ``m``'s backward. In a list that has
  ``W`` actions, ``B m`` computes only the gradients of the stage's inputs
  (what the previous stage waits for) and ``W m`` the parameters' gradients
  (zero-bubble schedules, ``zb-h1``); in a list without, ``B m`` does both;
- ``SEND_F m >peer`` / ``RECV_F m <peer``: activations of ``m`` to/from rank
  ``peer`` (every value tagged for that pair of stages, batched);
- ``SEND_B m >peer`` / ``RECV_B m <peer``: gradients of those activations;
- ``ALLREDUCE``: average gradients over this stage's replica group (and sum
  the gradients of parameters tied across stages);
- ``STEP``: optimizer step (``m`` = the weight version it creates, or -1).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    STEP = "STEP"


_SENDS = (Kind.SEND_F, Kind.SEND_B)
_RECVS = (Kind.RECV_F, Kind.RECV_B)


@dataclass(frozen=True, slots=True)  # no __dict__: a long stash or 2bw run holds millions of them
class Action:
    kind: Kind
    mb: int = -1
    peer: int = -1

    @property
    def is_send(self) -> bool:
        return self.kind in _SENDS

    @property
    def is_recv(self) -> bool:
        return self.kind in _RECVS

    def __str__(self) -> str:
        s = self.kind.value
        if self.mb >= 0:
            s += str(self.mb)
        if self.is_send:
            s += f">r{self.peer}"
        elif self.is_recv:
            s += f"<r{self.peer}"
        return s

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = re.fullmatch(r"([A-Z_]+?)(\d*)(?:([<>])r(\d+))?", text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (examples: F3, B0, W0, SEND_F2>r1, RECV_B2<r3, STEP)")
        kind = Kind(m[1])
        mb = int(m[2]) if m[2] else -1
        peer = int(m[4]) if m[4] else -1
        return cls(kind, mb, peer)
