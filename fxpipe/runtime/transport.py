"""Moving mailbox contents between ranks with torch.distributed point-to-point.

A stage graph never touches the wire: its ``send``/``recv`` calls fill and empty
a ``passes.comm.MailboxTransport`` (one per microbatch). This module ships what
the schedule's ``SEND_*``/``RECV_*`` actions name:

- ``SEND_F``: every value in the outbox tagged for the peer's stage;
- ``RECV_F``: posts one ``irecv`` per value the peer's stage sends here, into a
  buffer allocated from the split's ``ValueMeta`` (shape and dtype known ahead,
  so no size handshake);
- ``SEND_B`` / ``RECV_B``: the gradients of those values, for every edge whose
  value is a floating tensor. A gradient that autograd did not produce (the
  value did not influence the loss) travels as zeros, so both sides always
  agree on the message count without a handshake.

Non-tensor values (sizes, Python scalars) are pickled into a byte tensor and
sent as a length header followed by the payload; the receiver completes that
pair inside the receive action so that, on NCCL, messages between two ranks
are posted in the same order on both sides.

Message tags are derived from (edge index, microbatch, direction), so gloo
matches every message exactly even when several microbatches are in flight.
Sends are asynchronous (as the schedule validator assumes: sends are
buffered); each handle is kept, with its tensor, until it is waited. Gloo
never reports a send complete before ``wait()`` (``is_completed()`` stays
False), so polling cannot free them: the executor calls ``release_sends``
with a microbatch old enough that every peer has certainly posted the
matching receive (see ``Executor``), and the wait returns at once.
Receives are waited lazily, right before the forward or backward that needs
them, so a receive posted early overlaps with compute. On CPU the posts
themselves go through one thread (``fxpipe.runtime.poster``): gloo can hold
the caller for milliseconds while posting.
"""
from __future__ import annotations

import math
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from fxpipe.runtime.poster import poster
from passes.comm import MailboxTransport
from passes.errors import FxpipeError
from passes.meta import TensorMeta, ValueMeta

# direction codes inside a tag
_FWD, _BWD, _HDR, _PAY = 0, 1, 2, 3
_TAG_WINDOW = 4096  # microbatches in flight never come close to this


class TransportError(FxpipeError):
    """A peer vanished, timed out, or sent a value that does not match the split."""


@contextmanager
def peer_guard(what: str) -> Iterator[None]:
    """Turn a collective's failure (gloo: "Connection closed by peer", a timeout) into a ``TransportError``."""
    try:
        yield
    except RuntimeError as exc:
        raise TransportError(f"{what}: lost a peer (it failed, was killed, or timed out): {exc}") from exc


@dataclass(frozen=True)
class Wire:
    """One comm edge as the transport sees it (index = its position in the split)."""

    index: int
    tag: str
    src_stage: int
    dst_stage: int
    value: ValueMeta

    @property
    def tensor(self) -> Optional[TensorMeta]:
        return self.value.spec if self.value.is_tensor else None

    @property
    def carries_grad(self) -> bool:
        t = self.tensor
        return t is not None and torch_dtype(t.dtype).is_floating_point


def torch_dtype(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name.split(".")[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"unknown dtype {name!r} in the split's value metadata")
    return dtype


def wires_of(edges: Sequence[Any]) -> List[Wire]:
    """Number the split's ``CommEdge`` list; tags must be unique (they key mailboxes)."""
    wires = [Wire(i, e.tag, e.src_stage, e.dst_stage, e.value) for i, e in enumerate(edges)]
    seen: Dict[str, Wire] = {}
    for w in wires:
        if w.tag in seen:
            raise TransportError(f"comm tag '{w.tag}' is used by two edges ({seen[w.tag].src_stage}->"
                                 f"{seen[w.tag].dst_stage} and {w.src_stage}->{w.dst_stage}); "
                                 "the split must give every (value, consumer stage) its own tag")
        seen[w.tag] = w
    return wires


@dataclass
class _Pending:
    work: Any
    buf: torch.Tensor
    store: Dict[str, Any]
    tag: str
    peer: int
    what: str


class P2P:
    """Point-to-point mover for one rank. ``on_wait`` lets the tracer time waits."""

    def __init__(self, wires: Sequence[Wire], device: torch.device, timeout_s: float,
                 on_wait: Optional[Callable[[str], Any]] = None, threaded: bool = True) -> None:
        self.wires = list(wires)
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.on_wait = on_wait
        self._sends: List[Tuple[int, Any, torch.Tensor, int]] = []  # (microbatch, work, tensor, peer), in order
        self._recvs: Dict[Tuple[int, str], List[_Pending]] = {}
        self._pairs: Dict[Tuple[int, int], List[Wire]] = {}  # per-microbatch lookups, computed once
        self._dtypes: Dict[int, torch.dtype] = {w.index: torch_dtype(w.tensor.dtype) for w in self.wires
                                                if w.tensor is not None}
        self._grads = {w.index for w in self.wires if w.carries_grad}
        self._poster = poster() if device.type == "cpu" and threaded else None

    def _tag(self, wire: Wire, mb: int, code: int) -> int:
        return (((mb % _TAG_WINDOW) * len(self.wires) + wire.index) << 2) | code

    def _between(self, src: int, dst: int) -> List[Wire]:
        got = self._pairs.get((src, dst))
        if got is None:
            got = self._pairs[(src, dst)] = [w for w in self.wires if w.src_stage == src and w.dst_stage == dst]
        return got

    def dtype_of(self, w: Wire) -> torch.dtype:
        """The dtype wire ``w`` carries (the split's record of the value)."""
        return self._dtypes[w.index]

    def _empty(self, w: Wire) -> torch.Tensor:
        return torch.empty(w.tensor.shape, dtype=self._dtypes[w.index], device=self.device)

    @property
    def pending_sends(self) -> int:
        """Sends posted and not yet waited (each holds its tensor)."""
        return len(self._sends)

    @property
    def pending_recvs(self) -> int:
        """Receives posted and not yet filed in their mailbox."""
        return sum(len(p) for p in self._recvs.values())

    def tensors_only(self, src: int, dst: int) -> bool:
        """Whether every value from stage ``src`` to ``dst`` is a tensor (its receive never blocks)."""
        return all(w.tensor is not None for w in self._between(src, dst))

    # ------------------------------------------------------------ sends
    def _isend(self, t: torch.Tensor, peer: int, tag: int, mb: int) -> None:
        t = t.detach().to(self.device).contiguous()
        self._sends.append((mb, self._post(dist.isend, t, peer, tag), t, peer))

    def _post(self, op: Callable[..., Any], buf: torch.Tensor, peer: int, tag: int) -> Any:
        """Post an ``isend``/``irecv`` (on CPU through the poster thread, ``fxpipe.runtime.poster``).

        gloo raises at once when the peer's connection is already gone; through
        the poster that error comes out of the handle's wait instead.
        """
        if self._poster is not None:
            return self._poster.post(op, buf, peer, tag=tag)
        try:
            return op(buf, peer, tag=tag)
        except RuntimeError as exc:
            raise self._lost("posting a message", peer, exc) from exc

    def send_forward(self, box: MailboxTransport, mb: int, my_stage: int, peer_stage: int, peer: int) -> None:
        objects = []
        for w in self._between(my_stage, peer_stage):
            if w.tag not in box.outbox:
                raise TransportError(f"SEND_F{mb}: stage {my_stage} produced no value for tag '{w.tag}' "
                                     f"(to stage {peer_stage}); its graph has no send for it")
            value = box.outbox.pop(w.tag)
            if w.tensor is None:
                objects.append((w, value))
                continue
            _check(value, w, mb, self._dtypes[w.index])
            self._isend(value, peer, self._tag(w, mb, _FWD), mb)
        for w, value in objects:  # headers first, payloads after: one order on both sides
            payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
            self._isend(torch.tensor([payload.numel()], dtype=torch.int64), peer, self._tag(w, mb, _HDR), mb)
            self._isend(payload, peer, self._tag(w, mb, _PAY), mb)

    def send_backward(self, box: MailboxTransport, mb: int, my_stage: int, peer_stage: int, peer: int) -> None:
        """Gradients of the values ``peer_stage`` sent here, back to it."""
        for w in self._between(peer_stage, my_stage):
            if w.index not in self._grads:
                continue
            grad = box.grad_out.pop(w.tag, None)
            if grad is None:
                grad = torch.zeros(w.tensor.shape, dtype=self._dtypes[w.index])
            self._isend(grad, peer, self._tag(w, mb, _BWD), mb)

    def release_sends(self, upto: float) -> None:
        """Wait for, and drop, every send of a microbatch ``<= upto``: their tensors are freed.

        Only safe for microbatches whose receives every peer has certainly
        posted (a send completes once its receiver is ready); the caller picks
        ``upto`` so. The list holds a few microbatches' sends, so the scan is short.
        """
        keep = []
        for send in self._sends:
            if send[0] <= upto:
                self._wait(send[1], f"a send of microbatch {send[0]}", send[3])
            else:
                keep.append(send)
        self._sends = keep

    def wait_sends(self) -> None:
        """Wait for every send still pending (the end of an action list)."""
        self.release_sends(math.inf)

    # ------------------------------------------------------------ receives
    def recv_forward(self, box: MailboxTransport, mb: int, my_stage: int, peer_stage: int, peer: int) -> None:
        pending = self._recvs.setdefault((mb, "F"), [])
        objects = []
        for w in self._between(peer_stage, my_stage):
            if w.tensor is None:
                objects.append(w)
                continue
            buf = self._empty(w)
            work = self._post(dist.irecv, buf, peer, self._tag(w, mb, _FWD))
            pending.append(_Pending(work, buf, box.inbox, w.tag, peer, f"RECV_F{mb}"))
        for w in objects:
            box.inbox[w.tag] = self._recv_object(w, mb, peer)

    def _recv_object(self, w: Wire, mb: int, peer: int) -> Any:
        head = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(self._post(dist.irecv, head, peer, self._tag(w, mb, _HDR)), f"RECV_F{mb} '{w.tag}'", peer)
        payload = torch.empty(int(head.item()), dtype=torch.uint8, device=self.device)
        self._wait(self._post(dist.irecv, payload, peer, self._tag(w, mb, _PAY)), f"RECV_F{mb} '{w.tag}'", peer)
        return pickle.loads(payload.cpu().numpy().tobytes())

    def recv_backward(self, box: MailboxTransport, mb: int, my_stage: int, peer_stage: int, peer: int) -> None:
        pending = self._recvs.setdefault((mb, "B"), [])
        for w in self._between(my_stage, peer_stage):
            if w.index not in self._grads:
                continue
            buf = self._empty(w)
            work = self._post(dist.irecv, buf, peer, self._tag(w, mb, _BWD))
            pending.append(_Pending(work, buf, box.grad_in, w.tag, peer, f"RECV_B{mb}"))

    def complete(self, mb: int, direction: str) -> None:
        """Wait for the receives of ``mb`` (``"F"`` or ``"B"``) and file them in their mailbox."""
        for p in self._recvs.pop((mb, direction), []):
            self._wait(p.work, p.what, p.peer)
            p.store[p.tag] = p.buf

    def _wait(self, work: Any, what: str, peer: int) -> None:
        span = self.on_wait(what) if self.on_wait else None
        try:
            if span is not None:
                with span:
                    work.wait(self.timeout)
            else:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._lost(what, peer, exc) from exc

    def _lost(self, what: str, peer: int, exc: Exception) -> TransportError:
        who = f"rank {peer}" if peer >= 0 else "a peer"
        return TransportError(f"{what}: lost {who} (it failed, was killed, or took longer than the "
                              f"{self.timeout.total_seconds():.0f} s timeout): {exc}".strip())


def _check(value: Any, w: Wire, mb: int, dtype: torch.dtype) -> None:
    meta = w.tensor
    if not isinstance(value, torch.Tensor):
        raise TransportError(f"tag '{w.tag}' (stage {w.src_stage}->{w.dst_stage}): the split recorded a "
                             f"tensor but microbatch {mb} produced a {type(value).__name__}")
    if value.shape != tuple(meta.shape) or value.dtype != dtype:
        raise TransportError(
            f"tag '{w.tag}' (stage {w.src_stage}->{w.dst_stage}): microbatch {mb} produced "
            f"{tuple(value.shape)} {value.dtype}, the split recorded {tuple(meta.shape)} {meta.dtype}; "
            "every microbatch must have the example microbatch's shape (split again with that shape)"
        )
