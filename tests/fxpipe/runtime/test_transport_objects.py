"""Non-tensor values crossing between ranks: one bundle per microbatch and link, received like a tensor.

Two gloo ranks. The receiver posts its receives for three microbatches before
the sender sends anything (as the schedule's early receives do) and completes
them out of order; every value arrives as sent, a pickle longer than one
message included. The message count is what the change is for: a tensor and a
bundle per microbatch (plus the rest of a long pickle), not two messages per value.
"""
from __future__ import annotations

from typing import Any, List

import torch

from fxpipe.runtime.transport import OBJECT_BYTES, P2P, wires_of
from passes.comm import MailboxTransport
from passes.meta import TensorMeta, ValueMeta
from tests.fxpipe.runtime.fakes import Edge
from tests.fxpipe.runtime.harness import spawn

EDGES = [Edge("t", 0, 1, ValueMeta(TensorMeta((3,), "torch.float32", True))),
         Edge("size", 0, 1, ValueMeta(4)), Edge("heads", 0, 1, ValueMeta(2)), Edge("names", 0, 1, ValueMeta("<list>"))]


def _values(mb: int) -> dict:
    long = [f"value {i} of microbatch {mb}" for i in range(200)] if mb == 1 else ["short"]  # mb 1: > 1 message
    return {"t": torch.full((3,), float(mb)), "size": 4 + mb, "heads": torch.Size([2, mb]), "names": long}


def _exchange(rank: int) -> Any:
    p2p = P2P(wires_of(EDGES), torch.device("cpu"), timeout_s=20.0)
    if rank == 1:
        boxes = [MailboxTransport() for _ in range(3)]
        for mb, box in enumerate(boxes):
            p2p.recv_forward(box, mb, 1, 0, peer=0)
        got = {}
        for mb in (2, 0, 1):
            p2p.complete(mb, "F")
            got[mb] = dict(boxes[mb].inbox)
        return got
    counts: List[int] = []
    for mb in range(3):
        box = MailboxTransport()
        box.outbox.update(_values(mb))
        before = p2p.pending_sends
        p2p.send_forward(box, mb, 0, 1, peer=1)
        counts.append(p2p.pending_sends - before)
    p2p.wait_sends()
    return counts


def test_non_tensor_values_arrive_as_one_bundle_posted_early() -> None:
    assert len(repr(_values(1)["names"]).encode()) > OBJECT_BYTES  # the long one really needs a second message
    sent, got = spawn(_exchange, 2).ok()
    assert sent == [2, 3, 2]  # tensor + bundle; the long pickle adds one message for its rest
    for mb in range(3):
        want = _values(mb)
        assert torch.equal(got[mb].pop("t"), want.pop("t"))
        assert got[mb] == want, mb
