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

Non-tensor values (sizes, Python scalars) that one stage sends another for a
microbatch travel together, pickled into one message of ``OBJECT_BYTES``: an
8-byte length, then the pickle (a longer pickle sends its rest as a second
message). One message, of a size known ahead, is received like a tensor: on
gloo it is posted early and waited in the compute that uses it. Sent one by one
with a length header each, as before, six shape values of a GPT stage made
twelve messages that the receiver waited in turn while the sender's one
posting thread competed with its compute for Python's lock: the next stage
waited milliseconds per microbatch. On NCCL, which matches messages by order
alone, the receive action still completes the bundle where it stands, so both
sides post in the same order.

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
OBJECT_BYTES = 1024  # one message of a microbatch's non-tensor values: length + pickle (a few shapes fit)
_LEN = 8


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
    objects: Optional[List[Wire]] = None  # a bundle of these non-tensor values (``buf``: its first message)
    rest_tag: int = 0  # where a bundle longer than OBJECT_BYTES sends the rest


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
        if objects:  # tensors first, then one bundle: one order on both sides
            data = pickle.dumps([value for _, value in objects])
            first = bytearray(OBJECT_BYTES)
            first[:_LEN] = len(data).to_bytes(_LEN, "little")
            k = min(len(data), OBJECT_BYTES - _LEN)
            first[_LEN:_LEN + k] = data[:k]
            w = objects[0][0]
            self._isend(torch.frombuffer(first, dtype=torch.uint8), peer, self._tag(w, mb, _HDR), mb)
            if len(data) > k:
                self._isend(torch.frombuffer(bytearray(data[k:]), dtype=torch.uint8), peer,
                            self._tag(w, mb, _PAY), mb)

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
        if objects:
            buf = torch.empty(OBJECT_BYTES, dtype=torch.uint8, device=self.device)
            work = self._post(dist.irecv, buf, peer, self._tag(objects[0], mb, _HDR))
            bundle = _Pending(work, buf, box.inbox, objects[0].tag, peer, f"RECV_F{mb} (non-tensor values)",
                              objects, self._tag(objects[0], mb, _PAY))
            if self.device.type == "cpu":  # gloo matches tags: waited with the tensors, in the compute
                pending.append(bundle)
            else:  # NCCL matches by order: finish here, before any later receive from this peer is posted
                self._file(bundle)

    def _file(self, p: _Pending) -> None:
        """Wait for a received message and put its value(s) in the mailbox."""
        self._wait(p.work, p.what, p.peer)
        if p.objects is None:
            p.store[p.tag] = p.buf
            return
        first = p.buf.cpu().numpy().tobytes()
        n = int.from_bytes(first[:_LEN], "little")
        data = first[_LEN:_LEN + n]
        if n > len(data):
            rest = torch.empty(n - len(data), dtype=torch.uint8, device=self.device)
            self._wait(self._post(dist.irecv, rest, p.peer, p.rest_tag), p.what, p.peer)
            data += rest.cpu().numpy().tobytes()
        values = pickle.loads(data)
        for w, value in zip(p.objects, values):
            p.store[w.tag] = value

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
            self._file(p)

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
