"""The two cost models, as plain functions that score any stage assignment.

Both models describe one pipeline in steady state and give the time per
microbatch of its slowest part (the *bottleneck*); throughput is one
microbatch per bottleneck. Both assume communication OVERLAPS computation:
a stage's compute and its weight all-reduce run back to back on its devices,
while activations and gradients travel on the links concurrently, so

    stage time_j = max(compute_j / r_j + allreduce_j,  cut times on both sides of j)
    bottleneck   = max_j stage time_j

A cut b (between stage b and b+1) carries ``A_b`` bytes forward (the outputs
of nodes in stages <= b used by any stage > b, so a value used by a
non-adjacent later stage crosses every boundary in between) and as many bytes
of gradients backward: ``cut time = 2 A_b / (B · min(r_b, r_{b+1}))``, since
the r replicas on each side each have their own link.

``fxpipe`` model (default):
  - all-reduce is a ring: ``2 (r-1)/r · P_j / B_allreduce``, charged in full
    per microbatch (conservative: the contracts' schedules all-reduce after
    every backward in 1F1B-stash);
  - values produced by ``is_input`` nodes cost nothing to move: every rank
    loads the model inputs itself.
``pipedream`` model, exactly as PipeDream's optimizer computes it (see
examples/pipedream/README.md): stage time ``(C + 4(r-1)·P/(B·r)) / r``,
cut time as above, input nodes in stage 0 and their activations counted.

Two-level machines (``gpus_per_node`` G, ``intra_bandwidth`` B1 inside a
node, ``bandwidth`` B2 between nodes; K a multiple of G): stages sit on
contiguous ranks (``topology.py``), an all-reduce ring runs at its slowest
link (fxpipe) or as PipeDream's hierarchical optimizer charges whole nodes
(``allreduce_at``), and a cut is charged on its busiest rank with every
replica pair at the bandwidth it crosses (``cut_at``). Without G nothing
changes; with one node (G = K) it is the flat model at B1.

A weight tied across stages (GPT's embedding and output projection) lives
as one copy per stage; every step the runtime sums the copies' gradients over
all ranks of those stages (``fxpipe.runtime.groups``). Each of those stages
pays that all-reduce of the whole group (``tied_sync_s``) besides its
replicas' all-reduce of its other weights, so a tied weight costs time even on
stages without replicas. The solvers cannot see the other holders' replicas
until the plan is complete: they charge the group at the least size it can
have (``tied_floor_s``: the stage's ranks plus ``partner_replicas``, what the
other users of the weight need at the bottleneck searched), which is never
more than ``tied_sync_s``, so their bounds stay bounds, and ``evaluate``
scores the plan they return.

Memory per device of stage j (both models; PipeDream itself only checks
memory on request): weights × versions + one gradient buffer + optimizer state
(a multiple of the weights) + the stage's stashed activations × microbatches in
flight (``in_flight``: one count for the schedule builder, this model, CP-SAT
and the simulator). 1F1B-stash keeps one weight version per microbatch in
flight, the others one version.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from passes.errors import FxpipeError
from passes.partition import topology

if TYPE_CHECKING:  # only annotations: the CLI's parser imports this module for the schedule names
    from passes.costgraph import CostGraph, CostNode

COST_MODELS = ("fxpipe", "pipedream")
SCHEDULES = ("1f1b-stash", "1f1b-flush", "gpipe", "zb-h1", "2bw")  # the one list: the CLI, the runtime and show read it
DEFAULT_SCHEDULE = "1f1b-flush"  # equals single-device training with gradient accumulation
REPLICATION = ("any", "pow2", "none")


@dataclass(frozen=True)
class CostOptions:
    """Everything besides the graph that a plan's cost depends on (units: s, bytes, bytes/s)."""

    devices: int
    bandwidth: float = 1.25e9
    allreduce_bandwidth: Optional[float] = None  # None: same as ``bandwidth``
    cost_model: str = "fxpipe"
    schedule: str = DEFAULT_SCHEDULE
    microbatches: Optional[int] = None  # None: as many as devices
    memory: Optional[int] = None  # bytes per device; None: unchecked
    optimizer_state: float = 1.0  # optimizer bytes per weight byte (SGD momentum: 1, Adam: 2)
    replication: str = "any"
    fewer_devices: bool = False
    gpus_per_node: Optional[int] = None  # None: one flat network at ``bandwidth``
    intra_bandwidth: Optional[float] = None  # inside a node; None: same as ``bandwidth``
    # a search's own restriction, never a plan's option (``as_dict`` leaves it out): every stage that shares a
    # tied weight with another runs exactly this many replicas, ``1f1b-stash``'s rule for one common count
    # (the flat segment DP states it, ``stash_counts.py``); None: free
    tied_replicas: Optional[int] = None
    # with ``tied_replicas``, a relaxation of every count from it to this one (also a search's own): each such
    # stage runs some count of the range, not necessarily the others' (its bound bounds every count of the
    # range at once, its plans may not run); None: the one count ``tied_replicas``
    tied_replicas_upto: Optional[int] = None

    def __post_init__(self) -> None:
        checks = [
            (self.devices >= 1, f"devices must be >= 1, got {self.devices}"),
            (self.bandwidth > 0, f"bandwidth must be > 0 bytes/s, got {self.bandwidth}"),
            (self.ar_bandwidth > 0, f"allreduce bandwidth must be > 0, got {self.allreduce_bandwidth}"),
            (self.cost_model in COST_MODELS, f"cost model {self.cost_model!r} is not one of {COST_MODELS}"),
            (self.schedule in SCHEDULES, f"schedule {self.schedule!r} is not one of {SCHEDULES}"),
            (self.replication in REPLICATION, f"replication {self.replication!r} is not one of {REPLICATION}"),
            (self.num_microbatches >= 1, f"microbatches must be >= 1, got {self.microbatches}"),
            (self.tied_replicas is None or self.tied_replicas in self.allowed_replicas(),
             f"tied replicas {self.tied_replicas} is not an allowed count under --replication {self.replication}"),
            (self.tied_replicas_upto is None or (self.tied_replicas is not None
                                                 and self.tied_replicas <= self.tied_replicas_upto
                                                 and self.tied_replicas_upto in self.allowed_replicas()),
             f"tied replicas up to {self.tied_replicas_upto} needs an allowed count from tied replicas "
             f"{self.tied_replicas} on"),
        ]
        for ok, message in checks:
            if not ok:
                raise FxpipeError(f"partition: {message}")
        self._check_topology()

    def _check_topology(self) -> None:
        """K a multiple of G, and no flat all-reduce bandwidth beside a two-level one."""
        G, K = self.gpus_per_node, self.devices
        if G is None:
            if self.intra_bandwidth is not None:
                raise FxpipeError("partition: --intra-bandwidth needs --gpus-per-node (how many devices share "
                                  "a node); add it, or drop --intra-bandwidth")
            return
        if G < 1:
            raise FxpipeError(f"partition: --gpus-per-node must be >= 1, got {G}")
        if K % G:
            lower, upper = K - K % G, K - K % G + G
            raise FxpipeError(
                f"partition: --devices {K} is not a multiple of --gpus-per-node {G}; use --devices "
                f"{upper}" + (f" or {lower}" if lower else "") + f", or a --gpus-per-node that divides {K}")
        if self.intra_bandwidth is not None and self.intra_bandwidth <= 0:
            raise FxpipeError(f"partition: --intra-bandwidth must be > 0 bytes/s, got {self.intra_bandwidth}")
        if self.allreduce_bandwidth is not None:
            raise FxpipeError("partition: --allreduce-bandwidth is for a flat network; with --gpus-per-node "
                              "all-reduce runs at --intra-bandwidth inside a node and --bandwidth across nodes")

    @classmethod
    def from_dict(cls, saved: Mapping[str, object], **overrides: object) -> "CostOptions":
        """The options ``as_dict`` wrote (a plan's ``options``), with ``overrides``; unknown keys are ignored.

        A two-level machine derives its all-reduce bandwidth, so the resolved
        rate ``as_dict`` writes is left out there.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in saved.items() if k in known}
        if kept.get("gpus_per_node") is not None:
            kept.pop("allreduce_bandwidth", None)
        return cls(**{**kept, **overrides})

    @property
    def intra_bw(self) -> float:
        return self.intra_bandwidth if self.intra_bandwidth is not None else self.bandwidth

    @property
    def ar_bandwidth(self) -> float:
        return self.allreduce_bandwidth if self.allreduce_bandwidth is not None else self.bandwidth

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else default_microbatches(
            self.devices, self.schedule, self.memory)

    def allowed_replicas(self) -> List[int]:
        if self.replication == "none":
            return [1]
        if self.replication == "pow2":
            return [r for r in range(1, self.devices + 1) if r & (r - 1) == 0]
        return list(range(1, self.devices + 1))

    def as_dict(self) -> Dict[str, object]:
        return {
            "devices": self.devices,
            "bandwidth": self.bandwidth,
            "allreduce_bandwidth": self.ar_bandwidth,
            "cost_model": self.cost_model,
            "schedule": self.schedule,
            "microbatches": self.num_microbatches,
            "memory": self.memory,
            "optimizer_state": self.optimizer_state,
            "replication": self.replication,
            "fewer_devices": self.fewer_devices,
            "gpus_per_node": self.gpus_per_node,
            "intra_bandwidth": self.intra_bw if self.gpus_per_node is not None else None,
        }


# ------------------------------------------------------------ formulas


def allreduce_s(param_bytes: float, r: int, opts: CostOptions) -> float:
    """Weight synchronisation time per microbatch of a stage with ``r`` replicas."""
    return float(_allreduce(param_bytes, r, opts))


def _allreduce(param_bytes, r, opts: CostOptions):
    """The all-reduce term of both models (0 at r = 1), elementwise on arrays."""
    r = np.asarray(r, dtype=float)
    if opts.cost_model == "pipedream":
        return 4.0 * (r - 1) * np.asarray(param_bytes, dtype=float) / (opts.bandwidth * r) / r
    return 2.0 * (r - 1) / r * np.asarray(param_bytes, dtype=float) / opts.ar_bandwidth


def allreduce_coeff(r: int, opts: CostOptions) -> float:
    """``r · allreduce_s(P, r) / P``: the weight on P in ``r·T >= C + coeff·P``."""
    return r * allreduce_s(1.0, r, opts)


def allreduce_floor(compute, params, T: float, opts: CostOptions) -> np.ndarray:
    """Per unit of work (``compute`` s, own ``params`` bytes, elementwise), the least device time that
    the stage holding it spends all-reducing those bytes in any plan within T.

    The stage has r replicas with ``r·T >= C + r·allreduce(P, r)`` (every stage time is at least
    ``C/r`` plus its all-reduce), and ``r·allreduce(p, r)`` is linear in the bytes. The stage's r is at
    least the fewest the unit needs alone (``min_replicas`` without cuts, at the faster links of a
    two-level machine: more compute and more bytes never need fewer), and ``least_allreduce_coeff``
    prices r replicas at the least any r' >= r pay, so the units' floors add up to a floor of the
    stages' all-reduce time. That time is no room for compute a relaxation left to the slack of a
    prefix (``chain.ChainSolver._late``), and it lifts ``sum C / K`` (``work_floor.py``). Infinite
    where no allowed count up to K brings the unit under T (no plan exists there)."""
    compute, params = np.asarray(compute, dtype=float), np.asarray(params, dtype=float)
    out = np.zeros(compute.shape)
    some = np.nonzero(compute > T)[0]  # below T one replica may do
    if some.size:
        r = min_replicas(compute[some], params[some], 0.0, 0.0, T, flat_bound(opts, fast=True))
        ok = r <= opts.devices
        out[some[ok]] = least_allreduce_coeff(opts)[r[ok]] * params[some[ok]]
        out[some[~ok]] = math.inf
    return out


def least_allreduce_coeff(opts: CostOptions) -> np.ndarray:
    """Index r (1..K): the least ``r'·allreduce(1 byte, r')`` over allowed counts r' >= r and over every
    placement of r' ranks: on a flat network ``allreduce_coeff``; on a two-level one the ranks fill
    as few nodes as they can (a ring of more than G ranks crosses nodes, at B2; PipeDream's charge
    with the fewest nodes and the fewest ranks in the fullest). Made non-decreasing in r, so a stage
    of more replicas than a unit needs never pays less than the unit's count is charged."""
    r = np.asarray(opts.allowed_replicas(), dtype=np.int64)
    if opts.gpus_per_node is None:
        per = _allreduce(1.0, r, opts)
    else:
        n = -(-r // opts.gpus_per_node)
        per = allreduce_nodes(1.0, r, n, -(-r // n), opts)
    raw = np.full(opts.devices + 2, np.inf)
    raw[r] = r * per
    return np.minimum.accumulate(raw[::-1])[::-1]


def cut_s(cut_bytes: float, r_before: int, r_after: int, opts: CostOptions) -> float:
    """Activations forward plus gradients backward over a boundary."""
    return 2.0 * cut_bytes / (opts.bandwidth * min(r_before, r_after))


def allreduce_at(param_bytes: float, first: int, r: int, opts: CostOptions) -> float:
    """``allreduce_s`` for a stage whose replicas are ranks ``[first, first + r)``."""
    return allreduce_on(param_bytes, topology.span(first, r), opts)


def allreduce_on(param_bytes: float, ranks: Sequence[int], opts: CostOptions) -> float:
    """``allreduce_s`` for a stage whose replicas sit on ``ranks``.

    fxpipe model: one ring at its slowest link (B1 inside one node, else B2). PipeDream model, as its
    hierarchical optimizer charges a stage spread over whole nodes: a ring
    inside each node at B1 (``4(c-1)P/(B1·c)``, c ranks in the fullest node)
    plus a ring of the full weights across the n nodes at B2
    (``4(n-1)P/(B2·n)``), or one flat ring at B2 when that is cheaper; the sum
    is divided by r like PipeDream's flat charge.
    """
    r = len(ranks)
    if opts.gpus_per_node is None:
        return allreduce_s(param_bytes, r, opts)
    counts = topology.node_counts(ranks, opts.gpus_per_node)
    return float(allreduce_nodes(param_bytes, r, len(counts), max(counts, default=0), opts))


def allreduce_nodes(param_bytes, r, n, c, opts: CostOptions):
    """``allreduce_on`` for r ranks over n nodes, c of them in the fullest (elementwise on arrays:
    the placed segment DP charges every offset within a node at once, ``allreduce_span``)."""
    P, r, n, c = (np.asarray(x, dtype=float) for x in (param_bytes, r, n, c))
    safe_r, safe_c, safe_n = np.maximum(r, 1.0), np.maximum(c, 1.0), np.maximum(n, 1.0)
    if opts.cost_model != "pipedream":
        out = 2.0 * (r - 1) / safe_r * P / np.where(n <= 1, opts.intra_bw, opts.bandwidth)
    else:
        inside = 4.0 * (r - 1) * P / (opts.intra_bw * safe_r) / safe_r
        two_level = 4.0 * (c - 1) / (opts.intra_bw * safe_c) + 4.0 * (n - 1) / (opts.bandwidth * safe_n)
        spread = np.minimum(two_level, 4.0 * (r - 1) / (opts.bandwidth * safe_r)) * P / safe_r
        out = np.where(n <= 1, inside, spread)
    return np.where(r <= 1, 0.0, out)


def allreduce_span(param_bytes, first, r, opts: CostOptions):
    """``allreduce_at`` elementwise: stages on ranks ``[first, first + r)`` of a two-level machine."""
    n, c = topology.span_nodes(first, r, opts.gpus_per_node)
    return allreduce_nodes(param_bytes, r, n, c, opts)


def tied_sync_s(param_bytes: float, stage_ranks: Sequence[int], group_ranks: Sequence[int],
                opts: CostOptions) -> float:
    """Seconds per microbatch a stage on ``stage_ranks`` spends keeping a weight tied over ``group_ranks`` in sync.

    The group is every rank of every stage holding the weight; the runtime
    all-reduces its gradient there (``fxpipe.runtime.groups``). It is charged
    like a stage's own all-reduce (``allreduce_on``) over that group; the
    PipeDream model spreads an all-reduce over the r replicas that share the
    stage's microbatches, so its charge is spread over the stage's replicas,
    not the group's (``_spread``). Either way it grows with the group (the ring
    factor grows, and a group's slowest link is no faster than the stage's
    when links between nodes are no faster than inside one), which is what
    lets the solvers charge ``tied_floor_s`` for a group of a known least size.
    """
    return allreduce_on(param_bytes, group_ranks, opts) * _spread(len(stage_ranks), len(group_ranks), opts)


def _spread(stage_n, group_n, opts: CostOptions):
    """The factor on a group all-reduce charged to one stage of it: PipeDream spreads an all-reduce over the
    replicas sharing the stage's microbatches (so ``group / stage``), fxpipe charges the ring in full."""
    return np.asarray(group_n, dtype=float) / stage_n if opts.cost_model == "pipedream" else 1.0


def allreduce_coeff_at(first: int, r: int, opts: CostOptions) -> float:
    """``allreduce_coeff`` for the replicas ``[first, first + r)``."""
    return r * allreduce_at(1.0, first, r, opts)


def cut_at(cut_bytes: float, first_before: int, r_before: int, r_after: int, opts: CostOptions) -> float:
    """``cut_s`` with every replica pair charged the link it crosses (``topology.pair_load``)."""
    return cut_on(cut_bytes, topology.span(first_before, r_before),
                  topology.span(first_before + r_before, r_after), opts)


def cut_on(cut_bytes: float, before: Sequence[int], after: Sequence[int], opts: CostOptions) -> float:
    """``cut_at`` for stages on the given ranks (replica a of a stage on its a-th rank)."""
    if opts.gpus_per_node is None:
        return cut_s(cut_bytes, len(before), len(after), opts)
    load = topology.pair_load(before, after, opts.gpus_per_node, opts.intra_bw, opts.bandwidth)
    return 2.0 * cut_bytes * load


def link_bandwidth(rank: int, peer: int, opts: CostOptions) -> float:
    """Bytes/s between two ranks: ``intra_bandwidth`` inside a node, ``bandwidth`` between nodes or on a
    flat machine (the rates ``cut_on`` charges each replica pair; the simulator sends at them)."""
    if opts.gpus_per_node is None:
        return opts.bandwidth
    same = topology.node_of(rank, opts.gpus_per_node) == topology.node_of(peer, opts.gpus_per_node)
    return opts.intra_bw if same else opts.bandwidth


def flat_bound(opts: CostOptions, fast: bool) -> CostOptions:
    """Flat options charging every link the faster (or the slower) of the two bandwidths.

    No plan costs less under the fast ones, nor more under the slow ones, than
    under the two-level model (``allreduce_at``, ``cut_at``). Solvers that
    cannot see placement (CP-SAT, the warm start) search under these: the fast
    model's bound is a proven lower bound, the slow model's plans are good
    placed ones; every plan is then scored by ``evaluate`` under ``opts``.
    """
    if opts.gpus_per_node is None:
        return opts
    pick = max if fast else min
    return dataclasses.replace(opts, gpus_per_node=None, intra_bandwidth=None, allreduce_bandwidth=None,
                               bandwidth=pick(opts.bandwidth, opts.intra_bw))


def stage_time_s(compute, params, cut_in, cut_out, r, opts: CostOptions, tied=0.0, partners=1):
    """THE stage time of both cost models on a flat network; every solver derives its numbers from it.

    ``compute`` (s, fwd+bwd, summed over the stage), ``params`` (weight bytes
    the stage holds, shared weights once), ``cut_in``/``cut_out`` (bytes
    crossing the boundary before/after it), ``r`` replicas, ``tied`` (the
    part of ``params`` that another stage holds too: charged
    ``tied_floor_s``, the least its sync can cost when the other holders have
    at least ``partners`` replicas, since which stages hold it and with how
    many replicas is only known once the plan is complete). Each
    cut is charged ``2A/(B·r)`` here, so the maximum over stages equals the
    bottleneck with ``min(r_b, r_b+1)``. Works on numpy arrays elementwise
    (the chain DP calls it on thousands of stages at once). A two-level
    machine is scored by ``evaluate`` (placement-aware); the solvers search it
    under the flat models of ``flat_bound``, so passing such options here is a
    mistake.
    """
    if opts.gpus_per_node is not None:
        raise FxpipeError("partition: stage_time_s takes flat options; score a two-level machine with "
                          "evaluate, or search it under flat_bound(opts, fast)")
    r_arr = np.asarray(r, dtype=float)
    cuts = 2.0 * np.maximum(np.asarray(cut_in, dtype=float), np.asarray(cut_out, dtype=float)) / (opts.bandwidth * r_arr)
    tied = np.asarray(tied, dtype=float)
    sync = _allreduce(np.asarray(params, dtype=float) - tied, r_arr, opts) + tied_floor_s(tied, r_arr, opts, partners)
    out = combine_stage_time(compute, r_arr, sync, cuts)
    return float(out) if out.ndim == 0 else out


def tied_floor_s(tied_bytes, r, opts: CostOptions, partners=1):
    """The least ``tied_sync_s`` a stage of ``r`` replicas pays for weights another stage holds too
    (elementwise, flat options), when every other stage holding them has at least ``partners`` replicas
    between them: the group has at least ``r + partners`` ranks.

    ``tied_sync_s`` grows with the group, so charging that size is never above
    the real charge: fxpipe a ring of ``r + partners`` ranks, PipeDream
    ``4(n-1)/n · P/(B·r)`` for ``n = r + partners``. With ``partners = 1`` this
    is exact for a weight tied between two stages of which the other has one
    replica (GPT's embedding and output projection without replicas); the
    segment DP finds larger ``partners`` from the bottleneck
    (``partner_replicas``). Under fxpipe the charge grows with r while the
    compute share falls, so a stage's time is no longer monotone in r
    (``min_replicas`` says why it still finds the fewest).
    """
    r = np.asarray(r, dtype=float)
    group = r + np.asarray(partners, dtype=float)
    return _allreduce(tied_bytes, group, opts) * _spread(r, group, opts)


def tied_across_rates(opts: CostOptions) -> np.ndarray:
    """Per group size g = 0..K of a two-level machine (``opts``), the least ``tied_sync_s`` per byte,
    times the stage's replicas, of a tied group of g ranks that spans two nodes or more: the least
    ``allreduce_nodes`` charge (times g, PipeDream's spread) over every node count n >= 2 such a group
    can touch, each with the fewest ranks its fullest node can hold (ceil(g/n), at most G). Both terms
    of the two-level charge grow with their count, so for each fullest count c <= G the fewest nodes
    that c allows, ``max(2, ceil(g/c))``, is the one to try: G candidates per size, not K.

    The first stage and the last stage of a plan on more than one node sit in different nodes, so a
    weight both hold (GPT's embedding and head) is synced across nodes whatever the placement; the
    flat charge at the faster bandwidth (``tied_floor_s``) lets a relaxation undercharge it several
    times under PipeDream's charges (8 H100-profiled blocks on 256 devices: 3.7/B1 per byte against
    the 19.5/B1 its plan pays, per byte times the stage's replicas). Made non-decreasing in g (the least
    over every larger group too), so charging the least group a stage's partners allow stays a floor."""
    K, G = int(opts.devices), int(opts.gpus_per_node)
    g = np.arange(K + 1, dtype=np.int64)[:, None]
    n = np.maximum(2, -(-g // np.arange(1, G + 1, dtype=np.int64)[None, :]))  # the fewest nodes per fullest count
    each = allreduce_nodes(1.0, g, n, -(-g // n), opts) * g  # with the fewest ranks in the fullest then
    out = np.where(n <= np.maximum(g, 2), each, np.inf).min(axis=1)
    out[:2] = 0.0  # no group of fewer than two ranks
    return np.minimum.accumulate(out[::-1])[::-1]  # at least g ranks: the least over g' >= g


def tied_floor_coeff(r: int, opts: CostOptions, partners: int = 1) -> float:
    """``r · tied_floor_s(P, r) / P`` with ``partners`` partner replicas (one by default): the weight on
    tied bytes in ``r·T >= C + ...`` (CP-SAT, which does not search the partners' replicas), the room
    per tied byte a stage of r replicas spends (``chain.ChainSolver._debt``)."""
    return float(r * tied_floor_s(1.0, r, opts, partners))


def partner_replicas(compute, params, tied, T: float, opts: CostOptions) -> np.ndarray:
    """Fewest replicas of any stage that holds a unit of ``compute`` s and ``params`` weight bytes, of
    which ``tied`` are shared with another stage, when no stage may exceed bottleneck ``T`` (elementwise).

    Such a stage's time is at least the unit's alone (``stage_time_s`` grows with
    compute and weight bytes at a fixed r, and a shared weight's group has at
    least one rank besides the stage), so it needs at least
    ``min_replicas`` of the unit as a stage; ``devices + 1`` means no plan meets T.
    A stage holding a tied weight therefore has at least this many partner
    ranks for every user of the weight outside it (``tied_floor_s``).
    """
    return min_replicas(compute, params, 0.0, 0.0, T, opts, tied)


def combine_stage_time(compute, r, allreduce, comm):
    """Communication overlaps computation: the stage's own work (compute split over
    its r replicas, then the weight all-reduce) or its slower link, whichever is longer."""
    return np.maximum(np.asarray(compute, dtype=float) / r + allreduce, comm)


def min_replicas(compute, params, cut_in, cut_out, T: float, opts: CostOptions, tied=0.0,
                 partners=1) -> np.ndarray:
    """Fewest allowed replicas giving ``stage_time_s <= T`` (elementwise); ``devices + 1`` where none does.

    Relies on two properties of ``stage_time_s`` (both models have them; a
    topology-aware model must keep them): it is at least ``compute / r`` and
    each cut term falls with r, so no r below ``max(C/T, 2A/(B·T))`` can do;
    and from r = 2 on it falls and then rises (quasi-convex), so the counts
    that fit form an interval and the fewest lies between the floor and the
    fastest count. Why: PipeDream's ``(C + b)/r - b/r^2`` (``b = 4P/B``) falls
    for r >= 2, and so does its tied term ``d(1/r - 1/(r(r+q)))`` (``d =
    4P_tied/B``, q ``partners``). fxpipe's time is ``(C - a)/r + a + c -
    c/(r+q)`` (``a``, ``c``: 2/B times the own and the tied bytes): the
    derivative times r^2 is ``-(C - a) + c·(r/(r+q))^2``, which grows with r,
    so it changes sign at most once, from falling to rising (without tied
    bytes, c = 0, it is monotone); taking the max with the falling cut terms
    keeps that shape. So: try the smallest allowed r above the floor; else,
    from r = ia (the floor, at least 2), find the fastest count ``top``
    (the largest allowed r for PipeDream and untied stages; a binary search on
    the slope for fxpipe's tied ones: on a quasi-convex sequence the first r
    whose successor is no faster is the fastest). If the time at ``top`` does
    not fit, no count does (every count from ia on is at least that slow).
    Else the time falls over [ia, top]: fitting ``alpha/r + beta`` through
    both ends (exact for untied fxpipe stages) places the answer, which is
    checked, and bisection settles what the fit missed.
    """
    every = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (compute, params, cut_in, cut_out, tied, partners)))
    if closed_form_applies(opts) and not every[4].any():
        return _plain_replicas(every, cut_in, cut_out, T, opts)
    return _searched_replicas(every, T, opts)


def closed_form_applies(opts: CostOptions) -> bool:
    """Whether the fewest count of an untied stage has a closed form under these options (fxpipe's charges,
    any count, a flat network): ``min_replicas`` then answers by ``_plain_replicas``, and a bound pass
    may count by ``replicas_floor``."""
    return opts.cost_model == "fxpipe" and opts.replication == "any" and opts.gpus_per_node is None


def replicas_floor(c_start, p_start, cut_start, c_end, p_end, cut_end, T: float, opts: CostOptions,
                   span: float, dtype=np.int64) -> np.ndarray:
    """A lower bound on ``min_replicas`` of untied stages from each start point to each end point
    (broadcasting: prefix sums of compute and weight bytes, and the cut at each point), under
    ``closed_form_applies`` options, for a pass that only has to prove T infeasible (a bound): one that needs
    more than K devices on these counts needs more on the exact ones. ``span``: at least
    ``|c| + 2|p|/B_ar`` of every point (the totals); ``dtype``: of the counts (at most K + 1).

    The fewest count is ``max(ceil((C - a)/(T - a)), ceil(2A/(B·T)))`` where C > T, and one replica
    (or the cuts' count) where C <= T (``_untied_replicas``); ``min_replicas`` then checks every stage
    whose ratio may round across a whole number, which took most of its time on the whole-block
    Llama passes of ``segment_plan.finer_bound``. Here every comparison leans the stage's way by a
    margin far above any rounding of the sums (1e-9 of ``span``): the numerator lowered, the
    denominator raised, the cuts' ratios (and C against T through the ratio itself, within twice the
    margin). So a count can only come out low, where a ratio lies within that margin of a whole number
    (or C of T), and nothing needs a check. ``C - a`` is the difference of one term per point (``c -
    2p/B_ar``), and so is ``T - a``, each formed before the arrays broadcast: about ten operations on the
    full (start x end) arrays, where writing the differences first took twenty (the 96-layer Llama's bound
    pass on 1,024 devices: its pool rows' counts, 110 million, 0.60 -> 0.43 s)."""
    K = opts.devices
    two_ar = 2.0 / opts.ar_bandwidth
    c_start, p_start, c_end, p_end = (np.asarray(x, dtype=float) for x in (c_start, p_start, c_end, p_end))
    margin = 1e-9 * (span + T)
    # a pass makes millions of these counts: every term that can is formed per point before the arrays
    # broadcast, and the temporaries are written in place (the same up to rounding far under ``margin``)
    q_start, q_end = two_ar * p_start, two_ar * p_end  # the stage's all-reduce term is their difference, a
    e = np.asarray(np.subtract(c_end - q_end - margin, c_start - q_start))  # C - a, lowered
    d = np.asarray(np.add(T + margin - q_end, q_start))  # T - a, raised
    # where the all-reduce alone reaches T (d <= 0) one replica fits if C <= T (it syncs nothing), no count
    # if C > T (from two on the time is a - (a - C)/r, above (a + C)/2): there the ratio becomes
    # (C - T - margin) over a hair above zero, past K where C > T + margin and at most 0 where not
    bad = d <= 0
    if bad.any():
        np.subtract(e, d, out=e, where=bad)
        np.add(e, margin, out=e, where=bad)
        np.copyto(d, 1e-300, where=bad)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        need = np.ceil(np.divide(e, d, out=e), out=e)
    # where d > 0 the ratio is at most 1 for C <= T + 2·margin: one replica, never above the fewest count
    # (one replica fits from C <= T on; above it every count from two on has the ratio's form)
    np.maximum(need, 1.0, out=need)
    keep = (1.0 - 1e-9) * 2.0 / (opts.bandwidth * T)  # each cut's 2A/(B·r) <= T, lowered
    cuts = [np.asarray(x, dtype=float) for x in (cut_start, cut_end)]
    # the ceiling of the larger cut's ratio is the larger ceiling: each side's before they broadcast (a pool's
    # rows against a segment's points), the larger first where both hold one per stage
    for cut in [np.maximum(*cuts)] if cuts[0].shape == cuts[1].shape else cuts:
        cut_need = np.ceil(cut * keep)
        if cut_need.size and float(np.max(cut_need)) > 1.0:
            inside = np.broadcast_shapes(need.shape, cut_need.shape) == need.shape
            need = np.maximum(need, cut_need, out=need if inside else None)
    np.minimum(need, K + 1.0, out=need)
    return need.astype(dtype)


def _searched_replicas(every: List[np.ndarray], T: float, opts: CostOptions) -> np.ndarray:
    """``min_replicas`` by search (see there) on the broadcast columns ``every``."""
    allowed = np.asarray(opts.allowed_replicas(), dtype=np.int64)
    top = len(allowed) - 1
    C, c_in, c_out = every[0], every[2], every[3]
    floor = np.maximum(C, 2.0 * np.maximum(c_in, c_out) / opts.bandwidth) / T
    lo = np.searchsorted(allowed, np.maximum(1.0, np.ceil(floor * (1 - 1e-12))))
    out = np.full(C.shape, opts.devices + 1, dtype=np.int64)
    flat_out = out.reshape(-1)
    pos = np.nonzero((lo <= top).ravel())[0]  # the stages still open, as flat positions
    sel = np.unravel_index(pos, C.shape)
    cols, lo = [x[sel] for x in every], lo[sel]  # their numbers, narrowed as answers are found

    def time_at(index, which=slice(None)):
        C_, P_, i_, o_, t_, q_ = (x[which] for x in cols)
        return stage_time_s(C_, P_, i_, o_, allowed[index], opts, t_, q_)

    def settle(found, index):
        """Record the answers ``found`` (a mask of the open stages) and keep the others open."""
        nonlocal pos, cols
        flat_out[pos[found]] = allowed[index[found]]
        pos, cols = pos[~found], [x[~found] for x in cols]
        return ~found

    rest = settle(time_at(lo) <= T, lo)
    if not pos.size:
        return out
    ia = np.maximum(lo[rest], min(int(np.searchsorted(allowed, 2)), top))
    fa = time_at(ia)
    rest = settle(fa <= T, ia)
    ia, fa = ia[rest], fa[rest]
    tops = np.full(ia.shape, top)
    if opts.cost_model == "fxpipe":  # a tied weight's ring grows with r (see above)
        bent = np.nonzero(cols[4] > 0)[0]
        if bent.size:
            tops[bent] = fastest_index(lambda idx, k: time_at(idx, bent[k]), ia[bent], tops[bent])
    ft = time_at(tops)
    keep = (ft <= T) & (ia < tops)  # the answer lies in (ia, tops]; none fits the others
    pos, cols = pos[keep], [x[keep] for x in cols]
    ia, fa, ft, tops = ia[keep], fa[keep], ft[keep], tops[keep]
    if not pos.size:
        return out
    ra, rt = allowed[ia].astype(float), allowed[tops].astype(float)
    alpha = (fa - ft) / (1.0 / ra - 1.0 / rt)
    beta = ft - alpha / rt
    with np.errstate(divide="ignore", invalid="ignore"):
        est = np.where(T > beta, alpha / (T - beta), rt)
    e = np.clip(np.searchsorted(allowed, np.nan_to_num(est, nan=rt) * (1 - 1e-9)), ia + 1, tops)
    fe = time_at(e) <= T
    fp = np.where(e - 1 > ia, time_at(e - 1) <= T, False)
    rest = settle(fe & ~fp, e)  # bisect on (lo2 - 1, hi2]: time at hi2 fits, below lo2 does not
    lo2 = np.where(fe, ia + 1, e + 1)[rest]
    hi2 = np.where(fe, e - 1, tops)[rest]
    while (lo2 < hi2).any():
        mid = (lo2 + hi2) // 2
        good = time_at(mid) <= T
        hi2 = np.where((lo2 < hi2) & good, mid, hi2)
        lo2 = np.where((lo2 < hi2) & ~good, mid + 1, lo2)
    flat_out[pos] = allowed[hi2]
    return out


def _plain_replicas(every: List[np.ndarray], cut_in, cut_out, T: float, opts: CostOptions) -> np.ndarray:
    """``min_replicas`` of untied stages under fxpipe's charges on a flat network with any count: the
    closed form of ``_untied_replicas`` with its checks left to the few stages that may need them.

    Where no rounding question arises the answer is ``max(1 or ceil((C - a)/(T - a)), ceil(2A/(B·T)))``
    (``_untied_replicas`` says why), at most K. A stage goes to ``_untied_replicas`` (and its doubtful
    ones to the search) where that could be off: its compute ratio within 1e-6 (relative) of a whole number
    (``_untied_replicas`` checks within ``_EDGE`` times a spread that stays under 801 while C and T
    both lie more than 1/400 from a, relative to their sum with a, the other case sent on too), C
    within 1e-6 of T, a cut ratio near a whole number k >= 1 (where the cuts come per start and per
    end, each side's before they broadcast: the larger of two is one of them), or a compute term that
    rises with r (C <= a) under a count the cuts raised. Same answers as the closed form on every stage
    (tests), in about half its array operations a stage (counted in the code): on a whole-block Llama
    pass (``segment_plan.finer_bound``) its checks over millions of stages took most of the pass.
    Where every cut and every stage's compute fits one replica, that is the answer at once."""
    C, P = every[0], every[1]
    K = opts.devices
    scale = opts.bandwidth * T
    if not scale > 0 or not C.ndim:  # T = 0 (no ratio to take) or one stage: the checked closed form
        return _checked_replicas(every, T, opts)
    cut_in, cut_out = (np.asarray(x, dtype=float) for x in (cut_in, cut_out))
    if 2.0 * max(float(np.max(cut_in, initial=0.0)), float(np.max(cut_out, initial=0.0))) / scale < 1 - 1e-6:
        cut_need, near_cut = 0.0, False  # every cut well within one replica's time: no count comes from cuts
        if np.all(C <= T):
            return np.ones(C.shape, dtype=np.int64)  # and the compute: one replica, as stage_time_s rounds it
    else:  # as stage_time_s rounds them; a ratio near a whole number k >= 1 (near 0 the count is 1 either way)
        per_stage = np.size(cut_in) + np.size(cut_out) > C.size  # a segment's own pairs: the larger cut's ratio
        # once, else (a pool's rows against a segment's points) each side's before they broadcast
        ratios = [2.0 * x / scale for x in ([np.maximum(cut_in, cut_out)] if per_stage else [cut_in, cut_out])]
        cut_need = functools.reduce(np.maximum, [np.ceil(x) for x in ratios])  # ceil of the larger: the larger ceil
        near_cut = functools.reduce(np.logical_or, [(x > 0.5) & _near_whole(x, _CHECKED) for x in ratios])
    a = 2.0 * P / opts.ar_bandwidth
    e, d = C - a, T - a
    falls = (C > T) & (d > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = e / d
        top = np.ceil(ratio)
        need = np.where(falls, top, np.where(C <= T, 1.0, np.inf))
        check = falls & _near_whole(ratio, _CHECKED)
    need = np.maximum(need, cut_need)
    check |= np.abs(e) * 400.0 < C + a
    check |= np.abs(d) * 400.0 < T + a
    check |= np.abs(C - T) <= 1e-6 * T
    check |= near_cut
    check |= (C <= a) & (need > 1)
    out = np.where(need <= K, need, K + 1).astype(np.int64)
    some = np.nonzero(check)
    if some[0].size:
        out[some] = _checked_replicas([x[some] for x in every], T, opts)
    return out


def _checked_replicas(every: List[np.ndarray], T: float, opts: CostOptions) -> np.ndarray:
    """``_untied_replicas`` with its doubtful stages searched: ``min_replicas`` on the columns ``every``."""
    out, doubtful = _untied_replicas(*every[:4], T, opts)
    if doubtful.any():  # near C = 2P/B_ar or T = 2P/B_ar rounding decides: the search
        out[doubtful] = _searched_replicas([x[doubtful] for x in every], T, opts)
    return out


def _untied_replicas(C: np.ndarray, P: np.ndarray, c_in: np.ndarray, c_out: np.ndarray, T: float,
                     opts: CostOptions) -> Tuple[np.ndarray, np.ndarray]:
    """``min_replicas`` under fxpipe's charges on a flat network, any count, no tied bytes, in closed form,
    and where it is in doubt (a mask for the search to answer).

    The time is ``max((C - a)/r + a, 2A/(B·r))`` with ``a = 2P/B_ar``: where ``C > a`` it falls with r,
    so the fewest count is ``max(ceil((C - a)/(T - a)), ceil(2A/(B·T)))`` when ``T > a`` (none fits
    when ``T <= a``: every count takes more than ``a``); where ``C <= a`` it rises from C at r = 1, so
    one replica or none. The general search evaluated the stage time six times or more per stage
    and copied its columns as answers settled: on a Llama's wide blocks 40-70 % of a DP pass. Rounding
    can put the closed form one off where a ratio it rounds up lies within a hair of a whole number, so
    those answers are checked on ``stage_time_s`` (it fits, one fewer does not) and moved until it is.
    Where C or T lies within 1e-9 of ``a`` the time is flat in r up to rounding, which may make counts
    fit out of order: those are the doubtful ones."""
    K = opts.devices
    a = 2.0 * P / opts.ar_bandwidth
    doubtful = (a > 0) & ((np.abs(C - a) <= 1e-9 * a) | ((np.abs(T - a) <= 1e-9 * a) & (C > T)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (C - a) / (T - a)
        need = np.where(C <= T, 1.0, np.where((C > a) & (T > a), np.ceil(ratio), np.inf))
        cut = 2.0 * np.maximum(c_in, c_out)
        need = np.maximum(need, np.where(cut > 0, np.ceil(cut / (opts.bandwidth * T)), 0.0))
        # rounding can move a count only where a ratio it is the ceiling of lies within a hair of a whole
        # number, the hair widened where C or T nears a (the differences cancel): only those are checked,
        # the rest are exact (the checks took about a third of a whole-block Llama DP pass, profiled)
        falls = (C > T) & (C > a) & (T > a)
        spread = np.where(falls, 1.0 + (C + a) / (C - a) + (T + a) / (T - a), 1.0)
        edge = (np.abs(C - T) <= _EDGE * T) | _near_whole(np.where(falls, ratio, 0.5), spread) \
            | _near_whole(np.where(cut > 0, cut / (opts.bandwidth * T), 0.5), 1.0)
    edge = np.broadcast_to(edge, need.shape)
    # a finite count past K is checked at K if it is at an edge (rounding may have put it one over)
    r = np.where(np.isfinite(need) & ~doubtful & ((need <= K) | edge), np.clip(need, 1.0, K), K + 1).astype(np.int64)
    flat_r, cols, edge = r.reshape(-1), [x.reshape(-1) for x in (C, P, c_in, c_out)], edge.reshape(-1)
    fits = lambda k, n: stage_time_s(*(x[k] for x in cols), n, opts) <= T  # noqa: E731
    # where C <= a the compute term rises with r: the count the cuts need fits, or no count does
    rises = np.nonzero((np.broadcast_to(C <= a, need.shape).reshape(-1)) & (flat_r > 1) & (flat_r <= K))[0]
    flat_r[rises[~fits(rises, flat_r[rises])]] = K + 1
    k = np.nonzero((flat_r <= K) & edge)[0]
    while k.size:  # up while the count does not fit
        k = k[~fits(k, flat_r[k])]
        flat_r[k] += 1
        k = k[flat_r[k] <= K]
    k = np.nonzero((flat_r > 1) & (flat_r <= K) & edge)[0]
    while k.size:  # down while one fewer fits
        k = k[fits(k, flat_r[k] - 1)]
        flat_r[k] -= 1
        k = k[flat_r[k] > 1]
    return r, doubtful


_EDGE = 1e-9  # relative distance to a whole number within which ``_untied_replicas`` checks its count
_CHECKED = 1000.0  # ``_plain_replicas`` sends on ratios within this many ``_EDGE`` (1e-6) of a whole number


def _near_whole(x: np.ndarray, spread) -> np.ndarray:
    """Whether each ratio lies within ``_EDGE`` times ``spread`` (relative) of a whole number."""
    return np.abs(x - np.round(x)) <= _EDGE * spread * np.maximum(np.abs(x), 1.0)


def fastest_index(time_at, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per element, the index in [lo, hi] of the least ``time_at(index, which)`` when the times fall and
    then rise (quasi-convex): the first index whose successor is no faster, by bisection on the slope."""
    lo, hi = lo.copy(), hi.copy()
    while True:
        k = np.nonzero(lo < hi)[0]
        if not k.size:
            return lo
        mid = (lo[k] + hi[k]) // 2
        rising = time_at(mid + 1, k) >= time_at(mid, k)
        hi[k] = np.where(rising, mid, hi[k])
        lo[k] = np.where(rising, lo[k], mid + 1)


def default_microbatches(devices: int, schedule: str, memory: Optional[int] = None) -> int:
    """Microbatches per step when none are asked for: ``4 x devices``, so the 1F1B bubble
    ``(S-1)/(M+S-1)`` stays under 20 % on any number of stages ``S <= devices``.

    1F1B (flush, stash) and ZB-H1 keep at most a pipeline's depth of microbatches in
    flight whatever ``M`` is, so a longer step costs no memory. GPipe keeps all ``M``:
    with a memory limit it stays at ``devices`` (a larger step could make the plan
    infeasible); say ``--microbatches`` to choose.
    """
    if schedule == "gpipe" and memory is not None:
        return devices
    return 4 * devices


def counts_comm(node: CostNode, opts: CostOptions) -> bool:
    """Whether a node's output costs bandwidth when it crosses a boundary."""
    return opts.cost_model == "pipedream" or not node.is_input


def in_flight(stage: int, replicas: Sequence[int], schedule: str, microbatches: Optional[int] = None) -> int:
    """THE number of microbatches whose activations one device of ``stage`` holds at once.

    The schedule builder runs this many forwards before the first backward
    (``fxpipe.schedule``); memory (``memory_bytes``), CP-SAT's memory
    constraint and the simulator follow from it. ``microbatches``: those of
    one action list (a replica gets at most ``ceil(M / r_j)`` of them); None
    for a list long enough not to cap it (a 1F1B-stash run does not drain
    between steps, so its plans are costed that way).

    - ``gpipe``: every microbatch of the step, ``ceil(M / r_j)``.
    - ``1f1b-stash``: PipeDream's "number of optimal active minibatches",
      ``ceil(sum_{k>=j} r_k / r_j)``: the forwards the stages downstream
      absorb before the first gradient returns.
    - ``1f1b-flush``: ``n_{S-1} = 1``, ``n_j = 1 + ceil(r_{j+1} n_{j+1} / r_j)``.
      A rank of stage j runs ``F(y + (n_j - 1) r_j)`` just before ``B(y)``,
      and stage j+1 asks for its next forward right after a backward, so
      ``(n_j - 1) r_j >= r_{j+1} n_{j+1}`` keeps a replicated stage downstream
      fed; the rule implies PipeDream's count (``r_j n_j >= sum_{k>=j} r_k``)
      and equals it without replicas (Megatron's warm-up ``S - j - 1`` plus
      one). On 1-2-1 the input stage holds 5, not 4: with 4 the middle stage
      starves and the pipeline runs at 2/3 of its rate.
    - ``zb-h1``: 1F1B-flush's order with each ``W`` deferred until the stage
      has run as many backwards as the deepest stage's window: every stage
      holds ``max_k n_k`` of 1F1B-flush, the input stage's count.
    """
    if schedule == "zb-h1":  # the deepest window of the whole plan
        return in_flight_all(replicas, schedule, microbatches)[stage]
    return in_flight_all(replicas[stage:], schedule, microbatches)[0]  # a suffix's windows are its own


def in_flight_all(replicas: Sequence[int], schedule: str, microbatches: Optional[int] = None) -> List[int]:
    """``in_flight`` of every stage at once, in one pass from the last stage."""
    S = len(replicas)
    caps = [math.inf if microbatches is None else math.ceil(microbatches / r) for r in replicas]
    if schedule == "gpipe":
        if microbatches is None:
            raise FxpipeError("partition: gpipe holds every microbatch of a step; say how many (microbatches)")
        return [int(c) for c in caps]
    if schedule == "1f1b-stash":
        behind = list(itertools.accumulate(reversed(replicas)))[::-1]  # devices of each stage and those after it
        windows = [math.ceil(behind[j] / replicas[j]) for j in range(S)]
    elif schedule in ("1f1b-flush", "2bw", "zb-h1"):  # 2bw: flush's order, without the drain
        windows = _flush_windows(replicas)
        if schedule == "zb-h1":  # a microbatch's activations live until its deferred W
            windows = [max(windows)] * S
    else:
        raise FxpipeError(f"partition: schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    return [int(min(w, c)) for w, c in zip(windows, caps)]


def _flush_windows(replicas: Sequence[int]) -> List[int]:
    """1F1B-flush's forwards before the first backward per stage, uncapped (``in_flight`` says why)."""
    windows = [1] * len(replicas)
    for j in range(len(replicas) - 2, -1, -1):
        windows[j] = 1 + math.ceil(replicas[j + 1] * windows[j + 1] / replicas[j])
    return windows


def most_in_flight(opts: CostOptions) -> int:
    """An upper bound of ``in_flight`` on every layout of ``opts.devices`` ranks (1F1B-flush:
    ``r_j n_j <= 2 r_j - 1 + r_{j+1} n_{j+1}``, so ``n_j < 2K``); CP-SAT's domain for the count."""
    K, M = opts.devices, opts.num_microbatches
    return {"1f1b-stash": K, "1f1b-flush": min(2 * K, M), "zb-h1": min(2 * K, M), "gpipe": M,
            "2bw": 2 * K}[opts.schedule]


def planned_microbatches(opts: CostOptions) -> Optional[int]:
    """Microbatches per action list that a plan's memory is costed for (``in_flight``); a 1F1B-stash
    or 2BW run never drains, so its count is not capped by ``microbatches``."""
    return None if opts.schedule in ("1f1b-stash", "2bw") else opts.num_microbatches


def weight_versions(stage: int, replicas: Sequence[int], opts: CostOptions) -> int:
    """Weight copies a device keeps: one per microbatch in flight with stashing, two with 2BW (the
    previous step's weights and the current ones), else one."""
    if opts.schedule == "1f1b-stash":
        return in_flight(stage, replicas, opts.schedule, planned_microbatches(opts))
    return 2 if opts.schedule == "2bw" else 1


def device_memory_bytes(param_bytes, act_bytes, versions: int, flight: int, extra_copies: float):
    """THE bytes one device holds: weights × (``versions`` kept + ``extra_copies``: one gradient buffer
    and the optimizer state) + activations × ``flight`` microbatches (the simulator passes what it runs).
    An int; elementwise on arrays of bytes (``polish.py`` scores many stages at once)."""
    total = np.rint(np.asarray(param_bytes, dtype=float) * (versions + extra_copies)
                    + np.asarray(act_bytes, dtype=float) * flight)
    return int(total) if total.ndim == 0 else total


def memory_terms(stage: int, replicas: Sequence[int], opts: CostOptions) -> Tuple[int, int, float]:
    """``device_memory_bytes``' weight versions, microbatches in flight and extra copies for stage
    ``stage`` as the plan's schedule runs it."""
    flight = in_flight(stage, replicas, opts.schedule, planned_microbatches(opts))
    return weight_versions(stage, replicas, opts), flight, 1 + opts.optimizer_state


def memory_bytes(param_bytes: int, act_bytes: int, stage: int, replicas: Sequence[int], opts: CostOptions) -> int:
    """``device_memory_bytes`` of stage ``stage`` as the plan's schedule runs it."""
    return device_memory_bytes(param_bytes, act_bytes, *memory_terms(stage, replicas, opts))


def param_bytes_of(graph: CostGraph, nodes: Sequence[str]) -> int:
    """Weight bytes a stage holds: shared parameters (tied weights) count once per stage."""
    total = 0
    names = set()
    for name in nodes:
        node = graph.nodes[name]
        if node.params and graph.param_sizes:
            names.update(node.params)
        else:
            total += node.param_bytes
    return total + sum(graph.param_sizes.get(p, 0) for p in names)


# ------------------------------------------------------------ evaluation


def activation_bytes(graph: CostGraph, nodes: Iterable[str]) -> int:
    """Bytes a stage keeps per microbatch in flight: the outputs of its nodes (model inputs are loaded, not kept)."""
    return sum(graph.nodes[n].out_bytes for n in nodes if n in graph.nodes and not graph.nodes[n].is_input)


def shared_weights(graph: CostGraph) -> set:
    """Names of the weights more than one node uses (tied weights, wherever the nodes sit)."""
    users: Dict[str, int] = {}
    for node in graph.nodes.values():
        for p in set(node.params):
            users[p] = users.get(p, 0) + 1
    return {p for p, n in users.items() if n > 1}


def tied_weights(graph: CostGraph, assignment: Mapping[str, int]) -> Dict[Tuple[int, ...], int]:
    """Bytes of the weights used by more than one stage, by the stages that hold them (one all-reduce group each)."""
    users: Dict[str, set] = {}
    for name, node in graph.nodes.items():
        if name in assignment and graph.param_sizes:
            for p in node.params:
                users.setdefault(p, set()).add(assignment[name])
    out: Dict[Tuple[int, ...], int] = {}
    for p, stages in users.items():
        if len(stages) > 1:
            key = tuple(sorted(stages))
            out[key] = out.get(key, 0) + int(graph.param_sizes.get(p, 0))
    return out


def assignment_of(stages: Iterable) -> Dict[str, int]:
    """node -> stage, from a plan's stage records (anything with ``index`` and ``nodes``)."""
    return {n: s.index for s in stages for n in s.nodes}


@dataclass
class StagePlan:
    """One stage as the cost model scores it: the record ``Plan`` stores and show, the simulator and the CLI read.

    Times are per microbatch; ``fwd_s``/``bwd_s`` one microbatch on one device.
    """

    index: int
    nodes: List[str]
    replicas: int
    ranks: List[int]
    fwd_s: float
    bwd_s: float
    compute_s: float  # (fwd_s + bwd_s) / replicas
    allreduce_s: float  # the replicas' all-reduce plus the sync of tied weights (tied_sync_s)
    comm_s: float  # the slower of its two cuts
    time_s: float  # the cost model's stage time (combine_stage_time)
    param_bytes: int  # weights held (a tied weight counts on every stage holding it)
    send_bytes: int  # bytes sent to later stages per microbatch
    memory_bytes: int  # predicted peak per device
    rank_nodes: List[int] = field(default_factory=list)  # the machine node of each rank in ``ranks``
    act_bytes: int = 0  # activations kept per microbatch in flight (activation_bytes)
    tied_bytes: int = 0  # weights it shares with other stages, synced over all their ranks (tied_weights)


@dataclass
class Evaluation:
    stages: List[StagePlan]
    cut_bytes: List[int] = field(default_factory=list)

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def peak_memory_bytes(self) -> int:
        return max(s.memory_bytes for s in self.stages)


def cut_bytes_of(graph: CostGraph, assignment: Mapping[str, int], num_stages: int, opts: CostOptions) -> List[int]:
    """Bytes crossing each boundary b (stage b -> b+1), forward direction."""
    cuts = [0] * max(num_stages - 1, 0)
    last_use: Dict[str, int] = {}
    for u, v in graph.edges:
        last_use[u] = max(last_use.get(u, -1), assignment[v])
    for u, last in last_use.items():
        node = graph.nodes[u]
        if counts_comm(node, opts):
            for b in range(assignment[u], last):
                cuts[b] += node.out_bytes
    return cuts


def evaluate(graph: CostGraph, assignment: Mapping[str, int], replicas: Sequence[int], opts: CostOptions,
             ranks: Optional[Sequence[Sequence[int]]] = None) -> Evaluation:
    """Score an assignment (every node -> stage) with per-stage ``replicas``.

    ``ranks``: where each stage's replicas sit (replica a on ``ranks[j][a]``);
    default the contiguous placement of ``topology.py``. Only a two-level
    machine (``opts.gpus_per_node``) makes placement matter.
    """
    num_stages = len(replicas)
    members: List[List[str]] = [[] for _ in range(num_stages)]
    for name in graph.nodes:
        members[assignment[name]].append(name)
    cuts = cut_bytes_of(graph, assignment, num_stages, opts)
    send = [0] * num_stages
    for u, v in {(u, assignment[v]) for u, v in graph.edges}:
        if v > assignment[u] and counts_comm(graph.nodes[u], opts):
            send[assignment[u]] += graph.nodes[u].out_bytes
    placed = [list(x) for x in ranks] if ranks is not None else topology.stage_ranks(replicas)
    tied = tied_weights(graph, assignment)
    stages = []
    for j, names in enumerate(members):
        r = replicas[j]
        fwd = sum(graph.nodes[n].fwd_s for n in names)
        bwd = sum(graph.nodes[n].bwd_s for n in names)
        params = param_bytes_of(graph, names)
        acts = activation_bytes(graph, names)
        comm = 0.0
        if j > 0:
            comm = max(comm, cut_on(cuts[j - 1], placed[j - 1], placed[j], opts))
        if j < num_stages - 1:
            comm = max(comm, cut_on(cuts[j], placed[j], placed[j + 1], opts))
        mine = {group: nbytes for group, nbytes in tied.items() if j in group}
        ar = allreduce_on(params - sum(mine.values()), placed[j], opts)
        ar += sum(tied_sync_s(nbytes, placed[j], [x for k in group for x in placed[k]], opts)
                  for group, nbytes in mine.items())
        stages.append(StagePlan(
            index=j, nodes=names, replicas=r, ranks=placed[j], fwd_s=fwd, bwd_s=bwd, compute_s=(fwd + bwd) / r,
            allreduce_s=ar, comm_s=comm, time_s=float(combine_stage_time(fwd + bwd, r, ar, comm)),
            param_bytes=params, send_bytes=send[j], memory_bytes=memory_bytes(params, acts, j, replicas, opts),
            rank_nodes=[topology.node_of(x, opts.gpus_per_node) for x in placed[j]], act_bytes=acts,
            tied_bytes=sum(mine.values()),
        ))
    return Evaluation(stages=stages, cut_bytes=cuts)


def data_parallel(graph: CostGraph, opts: CostOptions) -> Evaluation:
    """All devices as replicas of one stage, under the same cost model."""
    return evaluate(graph, {n: 0 for n in graph.nodes}, [opts.devices], opts)


# ------------------------------------------------------------ activation recomputation


def stage_input_bytes(graph: CostGraph, assignment: Mapping[str, int], stage: int) -> int:
    """Bytes a stage keeps per microbatch when it recomputes: the values it takes in (model inputs, received)."""
    used = {u for u, v in graph.edges if assignment[v] == stage and (assignment[u] != stage or graph.nodes[u].is_input)}
    return sum(graph.nodes[u].out_bytes for u in used)


def recompute_cost(stage: StagePlan, in_bytes: int, index: int, replicas: Sequence[int],
                   opts: CostOptions) -> StagePlan:
    """``stage`` recomputing its activations: every backward pays one more forward; per microbatch in
    flight only its inputs stay, plus one microbatch's activations alive during the recompute. Under
    ``zb-h1`` the microbatches between their ``B`` and their deferred ``W`` (its window less 1F1B-flush's)
    keep what ``W`` reads, counted as their activations (an upper bound: a deferred Linear layer keeps its
    input and its output's gradient, ``fxpipe.runtime.deferred``)."""
    r = stage.replicas
    compute = (2 * stage.fwd_s + stage.bwd_s) / r
    kept = memory_bytes(stage.param_bytes, in_bytes, index, replicas, opts) + stage.act_bytes
    if opts.schedule == "zb-h1":
        M = planned_microbatches(opts)
        kept += (in_flight(index, replicas, "zb-h1", M) - in_flight(index, replicas, "1f1b-flush", M)) * stage.act_bytes
    time_s = float(combine_stage_time(2 * stage.fwd_s + stage.bwd_s, r, stage.allreduce_s, stage.comm_s))
    return dataclasses.replace(stage, compute_s=compute, time_s=time_s, memory_bytes=int(kept))


def recompute_choice(graph: CostGraph, assignment: Mapping[str, int], replicas: Sequence[int],
                     opts: CostOptions) -> List[bool]:
    """Per stage, after the partition: recompute iff its memory without recomputation exceeds
    ``opts.memory`` and recomputing lowers it (a stage whose inputs outweigh its activations gains nothing).

    The partitioner itself still plans without recomputation (its memory
    limit may thus reject a partition that recomputation would fit).
    """
    if opts.memory is None:
        return [False] * len(replicas)
    ev = evaluate(graph, assignment, replicas, opts)
    return [s.memory_bytes > opts.memory and recompute_cost(
                s, stage_input_bytes(graph, assignment, j), j, replicas, opts).memory_bytes < s.memory_bytes
            for j, s in enumerate(ev.stages)]
