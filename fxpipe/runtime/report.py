"""Per-step loss and throughput, printed by the last stage.

A step ends, for flush and gpipe, when its action list has run (optimizer
step included); with ``1f1b-stash`` and ``2bw`` the pipeline never stops
between steps, so a step ends when the last stage is about to apply the
step's last update (``backward_done`` is called then). samples/s is the step's samples over the wall
time since the previous step ended (checkpoint writing excluded); with ``every`` > 1 (``--log-every``)
a line shows the rate over the steps since the previous line. The
learning rate and, when clipping, the gradient norm follow the loss: the
global norm (flush, gpipe) or, with stash, the largest norm of the last
stage's updates in the step (``fxpipe.runtime.clipping``).

With a replicated last stage, flush and gpipe sum the loss over its replicas
(one small all-reduce per step). With stash and 2bw the step lines show
replica 0's microbatches only, to keep collectives out of the running
pipeline (the first line says so); ``finish`` then sums every step over the
replicas once, after the last step, so the losses a run returns
(``TrainResult.losses``, ``fxpipe.train``, result.json) cover every microbatch,
and prints the first and last of them.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from fxpipe.actions import Kind
from fxpipe.runtime.transport import peer_guard


class Reporter:
    def __init__(self, steps: int, microbatches: int, samples_per_step: int, printing: bool,
                 losses: List[Tuple[int, Any]], loss_group: Optional[Any] = None,
                 notes: Optional[Callable[[int], str]] = None, settle: Optional[Callable[[], None]] = None,
                 final_group: Optional[Any] = None, device: Optional[torch.device] = None,
                 every: int = 1) -> None:
        """``notes(step)``: more of the step line after the loss (the learning rate, the gradient norm);
        ``settle()``: reads into floats (and checks) losses the executor still holds as device tensors;
        ``loss_group``: the replicas summed at every step; ``final_group``: those summed by ``finish``;
        ``device``: where the sums cross (NCCL groups take no CPU tensor); ``every``: print every that
        many steps (and the last), with samples/s over the steps since the previous line."""
        self.steps, self.M, self.samples = steps, microbatches, samples_per_step
        self.notes, self.settle = notes, settle
        self.printing, self.losses, self.loss_group = printing, losses, loss_group
        self.final_group, self.device = final_group, device or torch.device("cpu")
        self.left: Dict[int, int] = {}
        self.totals: List[Tuple[float, float]] = []  # per step: sum of losses, microbatches (over the replicas
        # summed so far: every step's with ``loss_group``, this replica's alone until ``finish`` with ``final_group``)
        self.samples_per_s: List[float] = []
        self.t_last = time.perf_counter()
        self.every = every
        self._line_s, self._line_steps = 0.0, 0  # the steps since the last printed line, and their seconds
        self._said = False  # the note on replica 0's share, before the first line (stash, 2bw)

    def expect(self, actions: Sequence[Any], base: int) -> None:
        """Count, per step, the updates this rank runs in ``actions`` (stash: one per minibatch; 2bw: one)."""
        for a in actions:
            if a.kind is Kind.STEP and a.mb >= 0:
                s = (base + a.mb) // self.M
                self.left[s] = self.left.get(s, 0) + 1

    def backward_done(self, g: int) -> None:
        s = g // self.M
        if s not in self.left:
            return
        self.left[s] -= 1
        if not self.left[s]:
            del self.left[s]
            self.step_done(s)

    def restart_clock(self) -> None:
        self.t_last = time.perf_counter()

    def step_done(self, s: int) -> None:
        if self.settle is not None:
            self.settle()
        now = time.perf_counter()
        took = max(now - self.t_last, 1e-9)
        sps = self.samples / took
        self.t_last = now
        mine = [l for g, l in self.losses if g // self.M == s]
        self.losses[:] = [(g, l) for g, l in self.losses if g // self.M != s]
        total = torch.tensor([sum(mine), float(len(mine))], dtype=torch.float64, device=self.device)
        if self.loss_group is not None:
            with peer_guard("all-reduce of the step's loss"):
                dist.all_reduce(total, group=self.loss_group)
        self.totals.append((float(total[0]), float(total[1])))  # floats: no tensor kept per step
        loss = self.totals[-1][0] / max(self.totals[-1][1], 1.0)  # this step's alone: step_losses is every step
        self.samples_per_s.append(sps)
        self._line_s, self._line_steps = self._line_s + took, self._line_steps + 1
        due = (s + 1) % self.every == 0 or s + 1 == self.steps
        if self.printing and due:
            if self.final_group is not None and not self._said:
                self._said = True
                print("the step lines show the loss of the last stage's replica 0 (its share of the "
                      "microbatches); the run's losses cover every replica", flush=True)
            rate = self.samples * self._line_steps / self._line_s
            notes = self.notes(s) if self.notes is not None else ""
            print(f"step {s + 1}/{self.steps}  loss {loss:.6f}{notes}  samples/s {rate:.1f}", flush=True)
        if due:
            self._line_s, self._line_steps = 0.0, 0

    def finish(self) -> None:
        """Collective over ``final_group`` (every replica of the last stage): each step's loss over all of them."""
        if self.final_group is None or not self.totals:
            return
        total = torch.tensor(self.totals, dtype=torch.float64, device=self.device)
        with peer_guard("all-reduce of the run's losses"):
            dist.all_reduce(total, group=self.final_group)
        self.totals = [(s, c) for s, c in total.tolist()]
        if self.printing:
            losses = self.step_losses
            print(f"over every replica: loss {losses[0]:.6f} at step 1, {losses[-1]:.6f} at step {len(losses)}"
                  if len(losses) > 1 else f"over every replica: loss {losses[0]:.6f}", flush=True)

    @property
    def step_losses(self) -> List[float]:
        """Each step's mean loss so far."""
        return [s / max(c, 1.0) for s, c in self.totals]


class StepStats:
    """Per step: the learning rate used and (clipping) the largest gradient norm this rank saw,
    before clipping.

    Steps arrive in order on a rank (stash: its updates follow minibatch
    order). The open step's norm stays a device tensor until the step closes
    (one host read per step, not per update); closed steps are plain floats.
    """

    def __init__(self, clipping: bool) -> None:
        self.clipping = clipping
        self.last: Optional[int] = None  # the step recorded last
        self.lrs: List[float] = []
        self.norms: List[float] = []
        self._open: Optional[torch.Tensor] = None

    def record(self, step: int, lr: float, norm: Optional[torch.Tensor]) -> None:
        if self.last != step:
            self._close()
            self.last = step
            self.lrs.append(lr)
        if norm is not None:
            self._open = norm if self._open is None else torch.maximum(norm, self._open)

    def _close(self) -> None:
        if self._open is not None:
            self.norms.append(float(self._open))
            self._open = None

    def note(self, step: int) -> str:
        """The step line's part after the loss (``step``: the last one recorded)."""
        if self.last != step:
            return ""
        self._close()
        text = f"  lr {self.lrs[-1]:.4g}"
        if self.clipping and self.norms:
            text += f"  grad norm {self.norms[-1]:.4g}"
        return text

    def done(self) -> Tuple[List[float], List[float]]:
        """The learning rates and norms of every step recorded."""
        self._close()
        return self.lrs, self.norms
