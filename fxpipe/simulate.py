"""Discrete-event simulation of a schedule over predicted costs.

The simulator replays the validator's legal execution order
(``validate.execution_order``) with a clock per rank, so it runs exactly the
lists the executor runs. Model, chosen to match the runtime:

- ``F m`` / ``B m`` take the stage's per-microbatch ``fwd_s`` / ``bwd_s``
  (one device; a replica runs whole microbatches, so no division by ``r``);
  on a rank whose list has ``W`` actions, ``B m`` takes ``bwd_s - wgrad_s``
  and ``W m`` takes ``wgrad_s``;
- a send is posted and the rank moves on (``isend``); the bytes travel over
  the (sender, receiver) channel at ``bandwidth`` after ``latency_s``, one
  message at a time per channel; with ``overlap_comm=False`` the sender waits
  for its transfer (a blocking send). A plan's channels run at the rate its
  cost model charges that pair of ranks (``costmodel.link_bandwidth``: inside
  or between nodes on a two-level machine);
- a receive is posted where it stands (``irecv``); the ``F m`` / ``B m``
  that uses the message waits until it arrived: that wait is a bubble;
- posting a send or a receive costs its rank ``post_s`` of its own time;
- ``ALLREDUCE`` starts when the last member of its group arrives and takes the
  largest ``allreduce_s`` in the group (a plan's: its replicas' all-reduce
  plus the sync of tied weights, ``costmodel.tied_sync_s``);
- memory on a rank is the cost model's (``costmodel.device_memory_bytes``)
  with the counts the run reaches: parameter bytes x (live weight versions,
  the current one plus those stashed for microbatches in flight, + the extra
  copies) + activation bytes x microbatches in flight (forward done, backward
  not yet).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from passes.partition.costmodel import (DEFAULT_SCHEDULE, CostOptions, activation_bytes, assignment_of,
                                        device_memory_bytes, link_bandwidth)

from fxpipe import sharing
from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from fxpipe.validate import ScheduleError, execution_order, reduce_groups
from passes.partition.costmodel import default_microbatches


BUSY = ("compute", "allreduce", "step", "send_blocking", "post", "recv")  # activities that are work, not bubble
Bandwidth = Union[float, Callable[[int, int], float]]  # bytes/s, or bytes/s of the channel (rank, peer)


@dataclass(frozen=True)
class ActionCosts:
    """What each action of one stage costs one of its devices (seconds, bytes per microbatch).

    The simulator's input, not the plan's stage record (``StagePlan``): it
    splits sends by destination and adds the optimizer step, which a plan
    does not price; ``costs_from_plan`` derives it from a plan.
    """

    fwd_s: float
    bwd_s: float
    send_bytes: Mapping[int, int] = field(default_factory=dict)  # destination stage -> activation bytes
    allreduce_s: float = 0.0
    param_bytes: int = 0
    activation_bytes: int = 0  # kept from F m until B m (W m when the backward is split)
    step_s: float = 0.0
    extra_copies: float = 0.0  # weight-sized buffers besides the versions (a plan's: gradients + optimizer state)
    wgrad_s: Optional[float] = None  # the weight-gradient share of bwd_s; None: half

    @property
    def w_s(self) -> float:
        """Seconds of ``W m``: ``wgrad_s``, or half the backward (a matmul's dX and dW cost the same flops)."""
        return self.bwd_s / 2 if self.wgrad_s is None else min(self.wgrad_s, self.bwd_s)


@dataclass(frozen=True)
class Event:
    """One action on one rank's timeline and what the rank did: ``activity`` is compute, send, recv,
    wait, allreduce, step..."""

    rank: int
    start: float
    end: float
    action: Action
    activity: str


@dataclass
class SimResult:
    schedule: str  # its name
    microbatches: int
    samples_per_microbatch: int
    events: Dict[int, List[Event]]
    step_s: float                 # makespan of the whole schedule
    samples_per_s: float          # every microbatch of the schedule x samples / step_s (2bw: several steps)
    steady_samples_per_s: float   # from the input stage's backward rate in the middle of the run
    bubble_fraction: float        # idle share of ranks x step_s
    busy_s: Dict[int, float]
    peak_memory: Dict[int, int]
    steps: int = 1  # the steps ``step_s`` covers (2bw's window: several, with no drain between them)

    def idle_s(self, rank: int, t0: float, t1: float) -> float:
        """Time in ``[t0, t1]`` when ``rank`` neither computes nor all-reduces."""
        busy = 0.0
        for e in self.events[rank]:
            if e.activity in BUSY:
                busy += max(0.0, min(e.end, t1) - max(e.start, t0))
        return (t1 - t0) - busy


def simulate(schedule: Mapping[int, Sequence[Action]], costs: Sequence[ActionCosts], layout: Layout, *,
             bandwidth: Bandwidth = math.inf, latency_s: float = 0.0, overlap_comm: bool = True,
             samples_per_microbatch: int = 1, tied_stages: Optional[Sequence[int]] = None,
             overhead_s: float = 0.0, post_s: float = 0.0, post_per_byte_s: float = 0.0,
             cores: Optional[int] = None) -> SimResult:
    """Run ``schedule`` against ``costs`` (one ``ActionCosts`` per stage).

    ``bandwidth``: bytes/s of every channel, or a function of (rank, peer).

    ``overhead_s`` is added to every forward, backward and weight-gradient
    action: the runtime's own cost per action (Python dispatch, autograd
    bookkeeping), which profiles of single operators do not see. ``post_s``
    plus ``post_per_byte_s`` times the message's bytes: the CPU one send or
    receive costs its rank (on gloo the posting and the poster's and gloo's
    threads moving the bytes, ``fxpipe.runtime.postcost``). ``cores``: CPU cores
    the ranks share (``fxpipe.sharing``); None: one device per rank.
    """
    if len(costs) != layout.num_stages:
        raise ValueError(f"{len(costs)} stage costs for a layout of {layout.num_stages} stages")
    tied = getattr(schedule, "tied_stages", ()) if tied_stages is None else tied_stages
    order = list(execution_order(schedule, reduce_groups(layout, tied)))
    stretch: Dict[Tuple[int, int], float] = {}
    shared = cores is not None and len(schedule) > cores
    for _ in range(sharing.ROUNDS if shared else 1):
        sim = _Clock(schedule, costs, layout, bandwidth, latency_s, overlap_comm, overhead_s, post_s,
                     post_per_byte_s, stretch)
        for step in order:
            if len(step.ranks) > 1 or step.action.kind is Kind.ALLREDUCE:
                sim.barrier(step.ranks, step.action)
            else:
                sim.run(step.ranks[0], step.action)
        if shared:
            stretch = sharing.slowdown(sim.events, cores, BUSY, stretch)
    return _result(schedule, sim, samples_per_microbatch)


class _Clock:
    """Per-rank clocks, channel availability, message arrivals and memory."""

    def __init__(self, schedule, costs, layout, bandwidth, latency_s, overlap_comm, overhead_s, post_s,
                 post_per_byte_s, stretch) -> None:
        self.costs, self.layout = costs, layout
        self.bandwidth, self.latency_s, self.overlap = bandwidth, latency_s, overlap_comm
        self.overhead_s, self.post_s, self.post_per_byte_s = overhead_s, post_s, post_per_byte_s
        self.split = {r for r, acts in schedule.items() if any(a.kind is Kind.W for a in acts)}
        self.posted: Dict[Tuple[int, bool, int], List[tuple]] = {}  # (rank, forward?, mb) -> message keys
        self.t = {r: 0.0 for r in schedule}
        self.events: Dict[int, List[Event]] = {r: [] for r in schedule}
        self.channel_free: Dict[Tuple[int, int], float] = {}
        self.arrival: Dict[tuple, float] = {}
        self.version = {r: 0 for r in schedule}
        self.flight: Dict[int, Dict[int, int]] = {r: {} for r in schedule}  # mb -> weight version
        # 2bw: batch b's forwards run on version b - 1 (fxpipe.schedule), whatever the rank is at
        self.batch = schedule.microbatches if getattr(schedule, "name", None) == "2bw" else None
        self.peak = {r: 0 for r in schedule}
        self.stretch = stretch  # (rank, n-th busy event) -> slowdown from sharing cores
        self.busy_n = {r: 0 for r in schedule}

    def stage(self, rank: int) -> ActionCosts:
        return self.costs[self.layout.stage_of(rank)]

    def _add(self, rank: int, dur: float, action: Action, activity: str) -> None:
        if activity in BUSY:
            dur *= self.stretch.get((rank, self.busy_n[rank]), 1.0)
            self.busy_n[rank] += 1
        start = self.t[rank]
        self.t[rank] = start + dur
        self.events[rank].append(Event(rank, start, start + dur, action, activity))

    def run(self, rank: int, a: Action) -> None:
        c = self.stage(rank)
        split = rank in self.split
        if a.kind is Kind.F:
            self._wait_messages(rank, a)
            self._add(rank, c.fwd_s + self.overhead_s, a, "compute")
            self.flight[rank][a.mb] = self.version[rank] if self.batch is None else max(0, a.mb // self.batch - 1)
            self._memory(rank, c)
        elif a.kind is Kind.B:
            self._wait_messages(rank, a)
            self._add(rank, c.bwd_s - (c.w_s if split else 0.0) + self.overhead_s, a, "compute")
            if not split:
                self.flight[rank].pop(a.mb, None)
        elif a.kind is Kind.W:
            self._add(rank, c.w_s + self.overhead_s, a, "compute")
            self.flight[rank].pop(a.mb, None)
        elif a.kind is Kind.STEP:
            self._add(rank, c.step_s, a, "step")
            self.version[rank] += 1
            self._memory(rank, c)
        elif a.is_send:
            self._send(rank, a)
        elif a.is_recv:
            self._recv(rank, a)
        else:
            self._add(rank, 0.0, a, "allreduce")

    def _nbytes(self, rank: int, a: Action) -> int:
        """Bytes of the message a send or receive moves: an activation this stage sends forward (and its
        gradient coming back), or one the peer's stage sends here (and the gradient going back)."""
        me, peer = self.layout.stage_of(rank), self.layout.stage_of(a.peer)
        if a.kind in (Kind.SEND_F, Kind.RECV_B):
            return int(self.costs[me].send_bytes.get(peer, 0))
        return int(self.costs[peer].send_bytes.get(me, 0))

    def _post_cost(self, nbytes: int) -> float:
        return self.post_s + self.post_per_byte_s * nbytes

    def _send(self, rank: int, a: Action) -> None:
        nbytes = self._nbytes(rank, a)
        if self.post_s or self.post_per_byte_s:
            self._add(rank, self._post_cost(nbytes), a, "post")
        start = max(self.t[rank], self.channel_free.get((rank, a.peer), 0.0))
        rate = self.bandwidth(rank, a.peer) if callable(self.bandwidth) else self.bandwidth
        wire = nbytes / rate if rate > 0 else 0.0
        arrive = start + self.latency_s + wire
        self.channel_free[(rank, a.peer)] = arrive
        self.arrival[(a.kind is Kind.SEND_F, a.mb, rank, a.peer)] = arrive
        if self.overlap:
            self.events[rank].append(Event(rank, start, arrive, a, "send"))
        else:
            self.t[rank] = start
            self._add(rank, arrive - start, a, "send_blocking")

    def _recv(self, rank: int, a: Action) -> None:
        self.posted.setdefault((rank, a.kind is Kind.RECV_F, a.mb), []).append((a.kind is Kind.RECV_F, a.mb,
                                                                                   a.peer, rank))
        self._add(rank, self._post_cost(self._nbytes(rank, a)), a, "recv")

    def _wait_messages(self, rank: int, a: Action) -> None:
        """Before ``F m`` / ``B m``: wait until every message posted for it has arrived."""
        keys = self.posted.pop((rank, a.kind is Kind.F, a.mb), ())
        arrive = max((self.arrival[k] for k in keys), default=0.0)
        if arrive > self.t[rank]:
            self._add(rank, arrive - self.t[rank], a, "wait")

    def barrier(self, ranks: Sequence[int], a: Action) -> None:
        start = max(self.t[r] for r in ranks)
        dur = max(self.stage(r).allreduce_s for r in ranks)
        for r in ranks:
            if start > self.t[r]:
                self.events[r].append(Event(r, self.t[r], start, a, "wait"))
            self.t[r] = start
            self._add(r, dur, a, "allreduce")

    def _memory(self, rank: int, c: ActionCosts) -> None:
        inflight = self.flight[rank]
        versions = len(set(inflight.values()) | {self.version[rank]})
        now = device_memory_bytes(c.param_bytes, c.activation_bytes, versions, len(inflight), c.extra_copies)
        self.peak[rank] = max(self.peak[rank], now)


def _result(schedule, sim: _Clock, samples: int) -> SimResult:
    makespan = max([e.end for evs in sim.events.values() for e in evs] + [0.0])
    busy = {r: sum(e.end - e.start for e in evs if e.activity in BUSY) for r, evs in sim.events.items()}
    world = max(len(sim.events), 1)
    ran = len({a.mb for acts in schedule.values() for a in acts if a.kind is Kind.F})  # 2bw: steps x M
    M = getattr(schedule, "microbatches", 0) or ran
    bubble = 1.0 - sum(busy.values()) / (world * makespan) if makespan > 0 else 0.0
    return SimResult(
        schedule=getattr(schedule, "name", "custom"), microbatches=M, samples_per_microbatch=samples,
        events=sim.events, step_s=makespan,
        samples_per_s=ran * samples / makespan if makespan > 0 else math.inf,
        steady_samples_per_s=_steady_rate(sim, samples) or (ran * samples / makespan if makespan > 0 else math.inf),
        bubble_fraction=bubble, busy_s=busy, peak_memory=dict(sim.peak), steps=max(1, ran // max(M, 1)))


def _steady_rate(sim: _Clock, samples: int) -> Optional[float]:
    """Samples/s from the input stage's backward completions in the middle half of the run."""
    ends = sorted(e.end for r in sim.layout.ranks(0) for e in sim.events.get(r, ()) if e.action.kind is Kind.B
             and e.activity == "compute")
    if len(ends) < 4:
        return None
    lo, hi = len(ends) // 4, (3 * len(ends)) // 4
    if ends[hi] <= ends[lo]:
        return None
    return samples * (hi - lo) / (ends[hi] - ends[lo])


# ------------------------------------------------------------ plans

def link_bytes(graph, stage_of: Mapping[str, int]) -> Dict[Tuple[int, int], int]:
    """Bytes per microbatch on each link ``(a, b)``: one copy of a value per consumer stage.

    Values of input nodes are not sent (every rank loads model inputs).
    """
    out: Dict[Tuple[int, int], int] = {}
    consumers: Dict[str, set] = {}
    for u, v in graph.edges:
        if u in stage_of and v in stage_of and stage_of[v] != stage_of[u] and not graph.nodes[u].is_input:
            consumers.setdefault(u, set()).add(stage_of[v])
    for u, stages in consumers.items():
        for b in stages:
            key = (stage_of[u], b)
            out[key] = out.get(key, 0) + int(graph.nodes[u].out_bytes)
    return out


def costs_from_plan(plan, graph=None) -> Tuple[List[ActionCosts], List[Tuple[int, int]]]:
    """``ActionCosts`` per stage and the links, from a ``Plan`` (and its profile if known).

    Times, all-reduce (tied weights included) and the weight copies besides
    the versions are the plan's. With the profile, bytes per link,
    activation bytes and ``W``'s share of each backward (``weight_grad_s``)
    come from the graph; without it, each stage's ``send_bytes`` goes to the
    next stage, the activations are the plan's and ``W`` is half a backward.
    """
    extra = 1.0 + plan_options(plan).optimizer_state  # a gradient buffer and the optimizer state
    S = len(plan.stages)
    if graph is not None:
        per_link = link_bytes(graph, assignment_of(plan.stages))
        acts = [activation_bytes(graph, s.nodes) for s in plan.stages]
    else:
        per_link = {(j, j + 1): int(s.send_bytes) for j, s in enumerate(plan.stages[:-1])}
        acts = [int(s.act_bytes) for s in plan.stages]
    costs = []
    for j, s in enumerate(plan.stages):
        sends = {b: n for (a, b), n in per_link.items() if a == j}
        costs.append(ActionCosts(fwd_s=float(s.fwd_s), bwd_s=float(s.bwd_s), send_bytes=sends,
                                 allreduce_s=float(s.allreduce_s), param_bytes=int(s.param_bytes),
                                 activation_bytes=int(acts[j]), extra_copies=extra,
                                 wgrad_s=None if graph is None else weight_grad_s(graph, s.nodes, j, per_link)))
    links = sorted(per_link) if per_link or S == 1 else [(j, j + 1) for j in range(S - 1)]
    return costs, links


def weight_grad_s(graph, nodes: Sequence[str], stage: int, links: Mapping[Tuple[int, int], int]) -> float:
    """The share of a stage's backward that ``W`` runs under a split backward (``zb-h1``), from its profile.

    A node using parameters spends about half its backward on their gradients
    (a matmul's dX and dW cost the same flops); a node without any, none (the
    attention scores and activations run in ``B``). An estimate: a norm's or
    an embedding's weight gradient, which ``fxpipe.runtime.deferred`` leaves
    in ``B``, is charged here like a matmul's. A stage that receives nothing
    has no input half: its whole backward is ``W`` (``fxpipe.runtime.wgrad``).
    """
    if stage not in receiving(links):
        return sum(graph.nodes[n].bwd_s for n in nodes)
    return sum(graph.nodes[n].bwd_s for n in nodes if graph.nodes[n].param_bytes or graph.nodes[n].params) / 2


def receiving(links: Iterable[Tuple[int, int]]) -> Set[int]:
    """The stages that receive a value over ``links`` ((src, dst) pairs): a stage that receives none has no
    input-gradient half of its backward (``weight_grad_s``; the executor's recomputing stages)."""
    return {b for _, b in links}


def plan_options(plan) -> CostOptions:
    """The ``CostOptions`` a plan (or a stand-in with its fields) was made under."""
    return CostOptions.from_dict({"devices": plan.devices, **(getattr(plan, "options", None) or {})})


def plan_bandwidth(plan) -> Bandwidth:
    """The channels' bytes/s as the plan's cost model charges them (``costmodel.link_bandwidth``);
    unlimited when the plan names no bandwidth."""
    if not (getattr(plan, "options", None) or {}).get("bandwidth"):
        return math.inf
    opts = plan_options(plan)
    if opts.gpus_per_node is None:
        return opts.bandwidth
    return lambda rank, peer: link_bandwidth(rank, peer, opts)


def simulate_plan(plan, schedule: Optional[str] = None, microbatches: Optional[int] = None, graph=None,
                  tied_stages: Optional[Sequence[int]] = None, links: Optional[Sequence[Tuple[int, int]]] = None,
                  step_s: Optional[Sequence[float]] = None, compute_scale: float = 1.0,
                  recompute: Optional[Sequence[bool]] = None, defers: Optional[Sequence[bool]] = None,
                  **sim_options) -> Tuple[SimResult, "object"]:
    """Build the schedule a plan asks for and simulate it; returns ``(result, schedule)``.

    ``links`` (e.g. ``SplitModel.links``) override the links read from the
    profile; ``tied_stages`` (e.g. the split's) default to the plan's stages
    that share a weight with another (``StagePlan.tied_bytes``); ``step_s``: per stage, the optimizer step's seconds (the plan has
    none: the optimizer is a training option); ``compute_scale``: multiplies
    every forward and backward (workers running more threads than the
    profile's, ``fxpipe.runtime.threadcost``); ``recompute``: per stage, whether it
    recomputes its activations (``fxpipe.runtime.recompute``): its ``B`` runs the
    forward again; ``W`` keeps its share of the backward where the stage defers
    its Linear and convolution weight gradients (``defers``: per stage, as
    ``fxpipe.runtime.deferred.qualifies`` says; default every stage), and is
    empty where it does not or where the stage receives nothing (the executor
    runs such a stage's whole backward in ``B`` when it recomputes);
    ``sim_options`` go to ``simulate`` (``overlap_comm``, ``latency_s``...).
    """
    from fxpipe.schedule import build_schedule

    opts = dict(getattr(plan, "options", {}) or {})
    schedule = schedule or opts.get("schedule") or DEFAULT_SCHEDULE
    layout = Layout.of([s.replicas for s in plan.stages])
    M = max(int(microbatches or opts.get("microbatches")
                or default_microbatches(layout.world_size, schedule, opts.get("memory"))), max(layout.replicas))
    if schedule == "1f1b-stash" and not microbatches:  # a window long enough to show the steady state
        M = max(M, 4 * layout.world_size)
    costs, found = costs_from_plan(plan, graph)
    if step_s is not None:
        if len(step_s) != len(costs):
            raise ScheduleError(f"step_s has {len(step_s)} entries for a plan of {len(costs)} stages")
        costs = [dataclasses.replace(c, step_s=float(t)) for c, t in zip(costs, step_s)]
    links = list(links) if links is not None else found
    if recompute is not None:
        for name, flags in (("recompute", recompute), ("defers", defers)):
            if flags is not None and len(flags) != len(costs):
                raise ScheduleError(f"{name} has {len(flags)} entries for a plan of {len(costs)} stages")
        receives = receiving(links)
        keeps_w = [j in receives and (defers is None or bool(defers[j])) for j in range(len(costs))]
        costs = [dataclasses.replace(c, bwd_s=c.bwd_s + c.fwd_s, wgrad_s=c.w_s if keeps_w[j] else 0.0)
                 if again else c for j, (c, again) in enumerate(zip(costs, recompute))]
    if compute_scale != 1.0:
        costs = [dataclasses.replace(c, fwd_s=c.fwd_s * compute_scale, bwd_s=c.bwd_s * compute_scale,
                                     wgrad_s=None if c.wgrad_s is None else c.wgrad_s * compute_scale) for c in costs]
    if schedule == "1f1b-stash":
        M = _round_up_for_stash(M, layout)
    if not tied_stages:
        tied_stages = [s.index for s in plan.stages if s.tied_bytes]
    # 2bw: steps without a drain between them (the second on the first's weights), as many as make a
    # window of 4 x devices microbatches, like the stash window above: the one fill and drain weigh little
    steps = {"steps": max(2, -(-4 * layout.world_size // M))} if schedule == "2bw" else {}
    built = build_schedule(schedule, layout, M, links, tied_stages, **steps)
    sim_options.setdefault("bandwidth", plan_bandwidth(plan))
    result = simulate(built, costs, layout, samples_per_microbatch=int(plan.batch_size or 1), **sim_options)
    return result, built


def simulate_split(split_model, schedule: Optional[str] = None, microbatches: Optional[int] = None, graph=None,
                   **sim_options) -> SimResult:
    """Predict a run of a ``SplitModel`` (its plan, links and tied stages): what ``fxpipe train`` compares with.

    ``graph`` defaults to the split's ``profile`` (set by ``fxpipe.split``).
    """
    if getattr(split_model, "plan", None) is None:
        raise ScheduleError("this split has no plan to predict from; split it with fxpipe.split / `fxpipe split`")
    tied = sorted({s for stages in (getattr(split_model, "tied", None) or {}).values() for s in stages})
    graph = graph if graph is not None else getattr(split_model, "profile", None)
    result, _ = simulate_plan(split_model.plan, schedule, microbatches, graph=graph, tied_stages=tied,
                              links=list(split_model.links), **sim_options)
    return result


def _round_up_for_stash(M: int, layout: Layout) -> int:
    need = 1
    for r in layout.replicas:
        need = need * r // math.gcd(need, r)
    return -(-M // need) * need


__all__ = ["ActionCosts", "Event", "SimResult", "costs_from_plan", "link_bytes", "plan_bandwidth", "simulate",
           "simulate_plan", "simulate_split"]
