"""Runs one rank's action list: the schedule decides the order, this only obeys.

One small handler per action kind (as a flat instruction interpreter):

- ``RECV_F m`` / ``RECV_B m`` post receives into microbatch ``m``'s mailbox;
  they are waited right before the ``F m`` / ``B m`` that needs them (the
  schedule posts them one compute action early, ``fxpipe.schedule``).
- ``F m`` runs the stage on the weight version the stash hands out, inside a
  ``passes.comm.MailboxTransport`` bound for ``m``; the last stage also
  computes the loss (scaled by ``1/M`` in flush, gpipe and 2bw, so the step's
  gradient is the gradient of the mean microbatch loss). With ``precision``
  bf16/fp16 the stage and the loss run under autocast and sent values are
  cast to the split's wire dtype (``fxpipe.runtime.precision``); with
  ``recompute`` the stage's activations are recomputed in ``B m``
  (``fxpipe.runtime.recompute``).
- ``B m`` runs autograd from the loss (last stage) and from the values the
  stage sent, with the gradients received for them (``MailboxTransport`` with
  ``sent_as_roots``; received values are leaves whose ``.grad`` is then
  collected for ``SEND_B``: no Python autograd Function per message). After it, ``m``'s
  graph, loss and outputs are dropped: activations live from ``F m`` to
  ``B m`` only; the mailbox stays until its gradients are sent.
- In a list with ``W`` actions (``zb-h1``), ``B m`` leaves the weight
  gradients to ``W m``. A stage of Linear and convolution layers (and norms,
  embeddings) runs one ordinary backward in ``B m`` with those layers'
  weight products deferred (``fxpipe.runtime.deferred``: each call's input
  and output gradient kept, ``dy^T x`` computed in ``W m``); any other stage computes
  only the received values' gradients in ``B m`` and keeps the graph for
  ``W m`` (``fxpipe.runtime.wgrad``), unless it recomputes: then its whole
  backward runs in ``B m`` (``fxpipe.runtime.recompute`` says why).
- ``SEND_F m`` / ``SEND_B m`` ship the mailbox contents (asynchronously).
  A send holds its tensor until it is waited; ``B g`` first waits the sends
  of microbatches ``<= g - lag`` (see ``send_lag``), so a long run (one
  1f1b-stash action list) keeps a few microbatches' sends, not all of them.
- ``ALLREDUCE`` combines gradients over replicas and tied copies.
- ``STEP`` steps the optimizer, clears gradients and, with stashing, starts a
  new weight version (``fxpipe.runtime.stash``: 2bw keeps the old one for
  the next batch). With fp16 the loss scaler first unscales the gradients
  and, if any rank saw inf/nan, every rank skips the update.

Microbatch numbers in an action list are local to that list; ``run`` is given
the global number of the list's microbatch 0, which picks the data and makes
message tags unique across steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from fxpipe.loader import loss_problem
from fxpipe.runtime.deferred import Deferred, WeightGradDeferral, defer_weight_grads
from fxpipe.runtime.failure import check_loss, mark_action
from fxpipe.runtime.groups import GradReducer
from fxpipe.runtime.optim import allow_in_place, run_step
from fxpipe.runtime.precision import LossScaler, autocast, wire_value
from fxpipe.runtime.recompute import Buffers, recomputed
from fxpipe.runtime.stash import WeightStash
from fxpipe.runtime.trace import Tracer
from fxpipe.runtime.transport import P2P
from fxpipe.runtime.wgrad import WeightGrad, backward_input
from fxpipe.schedule import in_flight
from passes import comm
from passes.errors import FxpipeError

# g -> (model inputs of microbatch g, its targets)
DataFn = Callable[[int], Tuple[Sequence[Any], Any]]
LossFn = Callable[[Any, Any], torch.Tensor]


class ExecutorError(FxpipeError):
    """An action list asked for something impossible (backward before forward, ...)."""


@dataclass
class _InFlight:
    box: comm.MailboxTransport
    loss: Optional[torch.Tensor] = None
    forwarded: bool = False
    wgrad: Optional[Union[WeightGrad, Deferred]] = None  # between B m and W m of a split backward

    @property
    def holds_graph(self) -> bool:
        """An autograd graph of this microbatch is still alive (its B or its W not run yet)."""
        return self.loss is not None or bool(self.box.sent) or self.wgrad is not None


class _Program(NamedTuple):
    actions: Sequence[Action]
    steps: List[Tuple[Callable[[Action, int], None], Action]]
    updated: List[int]  # microbatches with an optimizer step between their F and B
    split: bool  # W actions: each backward in an input half (B) and a weight half (W)


class Executor:
    def __init__(self, *, rank: int, layout: Layout, stage: int, module: nn.Module, input_indices: Sequence[int],
                 is_last: bool, stash: WeightStash, optimizer: torch.optim.Optimizer, p2p: P2P,
                 reducer: GradReducer, data: DataFn, loss_fn: Optional[LossFn], loss_scale: float,
                 tracer: Optional[Tracer] = None, flatten: Callable[[Sequence[Any]], Sequence[Any]] = list,
                 unflatten: Callable[[Any], Any] = lambda out: out, precision: str = "fp32",
                 recompute: bool = False, scaler: Optional[LossScaler] = None) -> None:
        self.rank, self.layout, self.stage = rank, layout, stage
        self.module, self.input_indices, self.is_last = module, list(input_indices), is_last
        self.stash, self.optimizer, self.p2p, self.reducer = stash, optimizer, p2p, reducer
        self.data, self.loss_fn, self.loss_scale = data, loss_fn, loss_scale
        self.flatten, self.unflatten = flatten, unflatten  # model inputs -> stage inputs; outputs back
        self.tracer = tracer or Tracer(rank, enabled=False)
        self.inflight: Dict[int, _InFlight] = {}
        self.losses: List[Tuple[int, Any]] = []  # (global microbatch, loss) on the last stage
        # off the CPU a loss stays a device tensor until the next optimizer step (``settle_losses``):
        # reading it at once would make the host wait for the forward every microbatch
        self.defer_loss = p2p.device.type != "cpu"
        self.on_step: Optional[Callable[[], None]] = None  # called after every optimizer step
        # called before every optimizer step with the STEP's global mb (-1: flush/gpipe): lr, clipping
        self.before_step: Optional[Callable[[int], None]] = None
        self._versioned: set = set()  # microbatches with an optimizer step between their F and B
        self._handlers = {Kind.F: self._forward, Kind.B: self._backward, Kind.SEND_F: self._send_f,
                          Kind.RECV_F: self._recv_f, Kind.SEND_B: self._send_b, Kind.RECV_B: self._recv_b,
                          Kind.ALLREDUCE: self._allreduce, Kind.STEP: self._step, Kind.W: self._weight_grad}
        self._compiled: Optional[_Program] = None  # the last action list's, reused while the list is the same
        # a split backward's Linear and convolution weight gradients deferred to W (set up at the first
        # split list; False: the stage does not qualify, ``defer_weight_grads``)
        self._deferral: Union[None, bool, WeightGradDeferral] = None
        self._stage_of = {r: layout.stage_of(r) for r in range(layout.world_size)}
        self._lag = send_lag(layout)
        self.recompute, self.scaler = recompute, scaler
        self._buffers = Buffers(module) if recompute else None  # a recompute must not update BatchNorm again
        self._autocast = lambda: autocast(precision, p2p.device)
        self._wire_dtypes = {w.tag: p2p.dtype_of(w) for w in p2p.wires if w.tensor is not None
                             and w.src_stage == stage} if precision != "fp32" else {}

    def run(self, actions: Sequence[Action], base: int = 0, final: bool = True) -> None:
        """Execute ``actions`` in order; microbatch ``m`` of the list is global microbatch ``base + m``.

        ``final=False``: more of the same list follows (``loop.windows``), so
        microbatches may stay in flight and sends posted; the last piece checks
        that none is left.
        """
        compiled = self._program(actions)
        self._versioned = {base + m for m in compiled.updated}
        self._split = compiled.split  # zb-h1
        if self._split and self._deferral is None:
            # a stage that receives no gradient-carrying value has no input half: its whole backward
            # waits for W as it is, nothing to defer
            receives = any(w.dst_stage == self.stage and w.carries_grad for w in self.p2p.wires)
            self._deferral = (receives and defer_weight_grads(self.module)) or False
        if self._deferral:
            self._deferral.enabled = self._split
        self._input_done: set = set()  # microbatches past B and before W
        tracing = self.tracer.enabled
        for handler, a in compiled.steps:
            g = base + a.mb if a.mb >= 0 else -1
            try:
                if tracing:
                    with self.tracer.span(str(a), "comm" if a.is_send or a.is_recv else "compute", mb=g):
                        handler(a, g)
                else:  # no span bookkeeping per action when not tracing
                    handler(a, g)
            except BaseException as exc:  # the worker's one-line error names this action
                mark_action(exc, a, g)
                raise
        if not final:
            return
        self.p2p.wait_sends()
        if any(f.holds_graph for f in self.inflight.values()):
            left = sorted(m for m, f in self.inflight.items() if f.holds_graph)
            raise ExecutorError(f"rank {self.rank}: the action list ended with microbatches {left} "
                                "forwarded but never backwarded")
        self.inflight.clear()

    def live_counts(self) -> Dict[str, int]:
        """What this rank holds now; a long run must keep every count bounded by the schedule's in-flight count.

        ``graphs``: microbatches whose autograd graph (activations) is alive;
        ``mailboxes``: microbatches with any state (a graph, or gradients not
        yet sent); ``weight_versions``: stashed weight copies; ``sends`` /
        ``recvs``: messages posted and not yet waited.
        """
        return {"weight_versions": self.stash.versions_kept,
                "graphs": sum(1 for f in self.inflight.values() if f.holds_graph),
                "mailboxes": len(self.inflight), "sends": self.p2p.pending_sends,
                "recvs": self.p2p.pending_recvs}

    def _program(self, actions: Sequence[Action]) -> "_Program":
        """Each action with its handler, the microbatches that need a weight version of their own
        (``_updated_in_flight``) and whether backwards are split in B and W.

        Worked out once per action list (the loop runs the same list every
        step): per action, the run then costs one call, no lookups.
        """
        if self._compiled is None or self._compiled.actions is not actions:
            self._compiled = _Program(actions, [(self._handlers[a.kind], a) for a in actions],
                                      _updated_in_flight(actions), any(a.kind is Kind.W for a in actions))
        return self._compiled

    def _box(self, g: int) -> comm.MailboxTransport:
        if g not in self.inflight:
            # inbox: fresh irecv buffers; backward from the sent values themselves (no token Functions)
            self.inflight[g] = _InFlight(comm.MailboxTransport(owns_inbox=True, sent_as_roots=True))
        return self.inflight[g].box

    def _peer_stage(self, a: Action) -> int:
        stage = self._stage_of.get(a.peer)
        return self.layout.stage_of(a.peer) if stage is None else stage  # unknown rank: the layout's error

    # ------------------------------------------------------------ compute
    def _forward(self, a: Action, g: int) -> None:
        box = self._box(g)
        self.p2p.complete(g, "F")
        inputs, targets = self.data(g) if self.input_indices or self.is_last else ((), None)
        flat = self.flatten(inputs) if self.input_indices else ()
        args = [flat[i] for i in self.input_indices]
        wrap = (lambda call, a: recomputed(call, a, box, self._buffers)) if self.recompute else None
        with comm.bind(box), torch.enable_grad(), self._autocast():
            # the runtime's mailbox keeps what the stage sent (``box.sent``): the graph returns no tokens
            outputs, _ = self.stash.forward(g, args, versioned=g in self._versioned, wrap=wrap)
            loss = self._loss(self.unflatten(outputs), targets) if self.is_last else None
        for tag, dtype in self._wire_dtypes.items():  # autocast outputs cross in the split's dtype
            if tag in box.outbox:
                box.outbox[tag] = wire_value(box.outbox[tag], dtype, tag)
        state = self.inflight[g]
        state.forwarded = True
        if loss is not None:
            if self.defer_loss:
                self.losses.append((g, loss.detach()))
            else:  # on the CPU at once: a NaN stops before it reaches the gradients (fxpipe.runtime.failure)
                self.losses.append((g, float(loss.detach())))
                check_loss(self.losses[-1][1])
            scale = self.loss_scale * (self.scaler.scale if self.scaler is not None else 1.0)
            state.loss = loss * scale if scale != 1.0 else loss
        if state.loss is None and not box.sent:
            self.stash.forget(g)

    def _loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        if self.loss_fn is None:
            raise ExecutorError("the last stage needs a loss function (define loss_fn in the model file)")
        loss = self.loss_fn(outputs, targets)
        problem = loss_problem(loss)
        if problem:
            raise ExecutorError(problem)
        return loss

    def _backward(self, a: Action, g: int) -> None:
        state = self.inflight.get(g)
        if state is None or not state.forwarded:
            raise ExecutorError(f"rank {self.rank}: {a} before its forward (global microbatch {g})")
        self.p2p.release_sends(g - self._lag)
        self.p2p.complete(g, "B")
        sent, sent_grads = state.box.backward_roots()  # the values sent downstream, with their gradients
        roots = ([state.loss] if state.loss is not None else []) + sent
        grads = ([torch.ones_like(state.loss)] if state.loss is not None else []) + sent_grads
        if self._split:
            self._input_done.add(g)
        if roots and self._split and self._deferral:
            self._deferral.collect()  # one whole backward, the layers' weight products left for W
            try:
                torch.autograd.backward(roots, grads)
            finally:
                state.wgrad = self._deferral.done()
        elif roots and self._split and not self.recompute:
            self._backward_input(state, roots, grads)
        elif roots:  # (a split list on a recomputing stage that does not defer: whole here, W empty,
            # since each of W's engine calls would recompute the forward again: ``fxpipe.runtime.recompute``)
            torch.autograd.backward(roots, grads)
            self.stash.backward_done(g)
        state.box.collect_grads()  # received values' gradients (a split backward put them there already)
        state.box.sent.clear()
        state.loss = None
        state.box.received.clear()  # its edges point back at the mailbox: a cycle only the collector would free
        if state.wgrad is None:  # the weight half may still need the gradients received for B
            state.box.grad_in.clear()
        state.box.inbox.clear()
        if not state.box.grad_out and state.wgrad is None:  # nothing left to send or compute: drop it now
            self.inflight.pop(g, None)

    def _backward_input(self, state: _InFlight, roots: List[torch.Tensor], root_grads: List[torch.Tensor]) -> None:
        """The input half of a split backward: received values' gradients into the mailbox, the rest kept."""
        box = state.box
        tags = list(box.received)
        grads, state.wgrad = backward_input(roots, root_grads, [box.received[t] for t in tags])
        for tag, grad in zip(tags, grads):
            if grad is not None:
                box.grad_out[tag] = grad

    def _weight_grad(self, a: Action, g: int) -> None:
        if g not in self._input_done:
            raise ExecutorError(f"rank {self.rank}: {a} before B{a.mb} (global microbatch {g})")
        self._input_done.discard(g)
        state = self.inflight.get(g)
        if state is None or state.wgrad is None:
            return  # its forward left nothing to differentiate
        state.wgrad.run()
        state.wgrad = None
        state.box.grad_in.clear()
        self.stash.backward_done(g)
        if not state.box.grad_out:
            self.inflight.pop(g, None)

    def _allreduce(self, a: Action, g: int) -> None:
        self.stash.gather_grads()
        self.reducer()

    def settle_losses(self) -> None:
        """Every loss still held as a device tensor read into a float and checked: before each update
        (a non-finite loss then stops the run before any weight takes it) and before a step's report."""
        for i, (g, value) in enumerate(self.losses):
            if isinstance(value, torch.Tensor):
                self.losses[i] = (g, float(value))
                check_loss(self.losses[i][1])

    def _step(self, a: Action, g: int) -> None:
        self.settle_losses()
        self.stash.gather_grads()
        # fp16: unscale and agree on skipping first (every rank), so the hook clips true gradients
        apply = self.scaler is None or self.scaler.prepare_step(self.stash.master.values())
        if self.before_step is not None:
            self.before_step(g)  # learning rate, clipping: collective, so it runs on a skipped step too
        self.stash.before_update()
        if apply:
            allow_in_place(self.optimizer, not self.stash.holds_master)
            run_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.stash.stepped()
        if self.on_step is not None:
            self.on_step()

    # ------------------------------------------------------------ communication
    def _send_f(self, a: Action, g: int) -> None:
        state = self.inflight.get(g)
        if state is None:
            raise ExecutorError(f"rank {self.rank}: {a} before F{a.mb}")
        self.p2p.send_forward(state.box, g, self.stage, self._peer_stage(a), a.peer)

    def _recv_f(self, a: Action, g: int) -> None:
        self.p2p.recv_forward(self._box(g), g, self.stage, self._peer_stage(a), a.peer)

    def _send_b(self, a: Action, g: int) -> None:
        state = self.inflight.get(g)
        if state is not None and (state.loss is not None or state.box.sent):
            raise ExecutorError(f"rank {self.rank}: {a} before B{a.mb}")
        # A missing state means B left no gradient to return: the peer gets zeros.
        box = state.box if state is not None else comm.MailboxTransport()
        self.p2p.send_backward(box, g, self.stage, self._peer_stage(a), a.peer)
        if state is not None and not box.grad_out and state.wgrad is None:
            self.inflight.pop(g, None)

    def _recv_b(self, a: Action, g: int) -> None:
        self.p2p.recv_backward(self._box(g), g, self.stage, self._peer_stage(a), a.peer)


def send_lag(layout: Layout) -> int:
    """How many microbatches back a send is certainly received: at ``B g``, sends of ``<= g - lag`` are.

    A send completes once its receiver posted the matching receive (gloo
    waits for that). A peer posts the receive of microbatch ``m`` after its
    earlier actions, which wait only for messages of microbatches up to
    ``m`` plus its forwards in flight (1F1B; GPipe's forwards wait on the
    stage before, which posts all of them before any backward) and for its
    replicas' all-reduce (up to ``m + r - 1``). At ``B g`` this rank has
    posted every send of the microbatches before ``g``, so once ``g - m``
    exceeds both bounds the peer needs nothing more from this rank and the
    wait returns at once: no new ordering, no deadlock. The 1F1B-flush count
    bounds every schedule's forwards in flight: it is at least PipeDream's
    (1f1b-stash), and zb-h1 and 2bw run flush's windows.
    """
    ahead = max(in_flight(layout, j, "1f1b-flush") for j in range(layout.num_stages))
    return ahead + max(layout.replicas) + 1


def _updated_in_flight(actions: Sequence[Action]) -> List[int]:
    """Microbatches whose forward and backward on this rank have a ``STEP`` between them.

    Only those need a weight version of their own; the others can run on
    the master weights, which no update touches while they are in flight.
    """
    out, open_mbs = [], set()
    for a in actions:
        if a.kind is Kind.F:
            open_mbs.add(a.mb)
        elif a.kind is Kind.B:
            open_mbs.discard(a.mb)
        elif a.kind is Kind.STEP:
            out.extend(open_mbs)
            open_mbs.clear()
    return out
