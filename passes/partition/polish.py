"""A finished plan's stage boundaries searched again on the graph's own nodes.

The searches cut where their units end: narrowed, chained or paired units on
a Llama block (``wide_segments.py``), coarsened units for CP-SAT, folded
shape reads. The graph's nodes allow finer cuts than any of them sees, but
the whole lattice of a wide block is too large to search (6,790 downsets a
Llama attention block). ``polished`` searches a corridor around the plan
instead: each boundary may move within a window of nodes beside it (the
last nodes of the stage before it, the first of the stage after, in graph
order; at most half of either, at most ``POINTS`` downsets of the window),
and one minimax DP over the boundaries picks every boundary's place at once,
keeping each stage's replica count and ranks. The plan itself lies in the
corridor, so the answer is never slower; the search repeats around each new
plan while it gets faster and time is left, cutting windows in two orders in
turn (graph order, and one branch at a time: on 24 Llama layers each found
plans the other did not). Once neither order helps, rounds that also move
replicas (one more or one fewer a stage, as many devices in all) follow,
without a memory limit (the microbatches in flight depend on every count),
under replication ``any``, and on a two-level machine where the stages sit
on consecutive ranks in stage order (a stage's ranks then shift by the
devices moved before it, and the DP charges its all-reduce and links where
they land): a boundary that cannot move for want of slack on either side
may move once a replica changes stage (24 Llama layers: 128 devices 0.31 %
faster, 256 devices 0.25 %). Then a replicated stage may split in two
(``_split``; its parts share its replicas, in counts the options allow), and
the split plan is polished again and kept where it ends faster: a stage
count the rounds cannot change, and an all-reduce fewer replicas pay less of.

Windows of neighbouring boundaries never overlap (each takes under half of
the stage between them), so any choice of points is a plan: stages stay
convex, in graph order, and non-empty (an answer where a stage keeps only an
input or an output is refused). Inputs, nodes nobody reads (the
outputs) and nodes holding a weight another node uses (tied weights) stay
where they are, so a window ends before them. Stage times are
``costmodel.evaluate``'s (its all-reduce, link and memory terms are linear in
the bytes a stage holds, so a point carries its running sums); the caller
scores the answer with ``evaluate`` itself.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from passes.costgraph import CostGraph
from passes.partition import topology
from passes.partition.costmodel import (CostOptions, activation_bytes, allreduce_on, combine_stage_time,
                                        counts_comm, cut_on, device_memory_bytes, evaluate, memory_terms,
                                        param_bytes_of, shared_weights, tied_sync_s, tied_weights)
from passes.partition.result import OPTIMAL_GAP, PartitionResult
from passes.partition.wide_segments import topological

POINTS = 256  # downsets a boundary's window may have (``_grown`` stops adding nodes there): 1,024 found the
# same plans on 24 Llama layers, 2-3x slower
MOVES = 2  # devices the stages before a boundary may have given up or taken in all, in a round that moves
# replicas (1 and 3 found the same plans on 24 Llama layers, 128 and 256 devices)
WINDOW = 24  # nodes a window takes from each side of a boundary, at most
SPLIT_TRIES = 8  # splits in a row that did not help, after which the polish stops trying (the winning ones
# came first to sixth: 24 Llama layers on 16 and 32 devices, an H100 GPT on nodes of 8; where none wins, each
# try is a whole polish, and trying every stage held the answer to the limit: 8 blocks on 512 devices, pow2)


class _Graph:
    """What every round needs of the graph: order, neighbours, and which nodes may move."""

    def __init__(self, graph: CostGraph) -> None:
        self.graph = graph
        self.succ: Dict[str, List[str]] = {name: [] for name in graph.nodes}
        self.pred: Dict[str, List[str]] = {name: [] for name in graph.nodes}
        for u, v in graph.edges:
            self.succ[u].append(v)
            self.pred[v].append(u)
        # two orders make two kinds of window (``polished`` alternates them): graph order (the earliest
        # ready node first), and one that finishes a branch before the next (on 24 Llama layers each found
        # plans the other missed)
        names = list(graph.nodes)
        place = {name: i for i, name in enumerate(names)}
        edges = [(place[u], place[v]) for u, v in graph.edges]
        self.orders = [{names[i]: k for k, i in enumerate(topological(edges, list(range(len(names))), lifo))}
                       for lifo in (False, True)]
        shared = shared_weights(graph)
        self.fixed = {name for name, node in graph.nodes.items()
                      if node.is_input or not self.succ[name] or shared.intersection(node.params)}
        self.work = {name: node.fwd_s + node.bwd_s for name, node in graph.nodes.items()}
        self.params = {name: param_bytes_of(graph, [name]) for name in graph.nodes}
        self.acts = {name: activation_bytes(graph, [name]) for name in graph.nodes}


def _downsets(nodes: List[str], g: _Graph, limit: int) -> Optional[List[int]]:
    """Bitmasks over ``nodes`` (in graph order) of the subsets closed under predecessors among ``nodes``;
    None past ``limit``."""
    index = {name: i for i, name in enumerate(nodes)}
    need = [sum(1 << index[u] for u in g.pred[name] if u in index) for name in nodes]
    found: List[int] = [0]
    for i in range(len(nodes)):  # each set so far, with node i added where its predecessors are in
        grown = [s | (1 << i) for s in found if s & need[i] == need[i]]
        found += grown
        if len(found) > limit:
            return None
    return found


class _Window:
    """One boundary's points: the plan's prefix less ``out`` (its stage's last nodes) plus a subset of
    ``out`` + ``into`` (the next stage's first nodes) closed under predecessors."""

    def __init__(self, g: _Graph, stage: Dict[str, int], b: int, out: List[str], into: List[str],
                 masks: List[int], totals: Tuple[float, float, float], crossing: set, opts: CostOptions) -> None:
        self.nodes = out + into
        self.masks = masks
        # a window holds at most 2 * WINDOW nodes, so a point's mask fits an int64
        rows = ((np.array(masks, dtype=np.int64)[:, None] >> np.arange(len(self.nodes))) & 1).astype(float)
        own = lambda field: np.array([field[n] for n in self.nodes], dtype=float)
        base = [t - float(own(f)[:len(out)].sum()) for t, f in zip(totals, (g.work, g.params, g.acts))]
        self.work = base[0] + rows @ own(g.work)  # the prefix's sums at each point
        self.params = base[1] + rows @ own(g.params)
        self.acts = base[2] + rows @ own(g.acts)
        self.cut = self._cuts(g, stage, b, set(out), rows > 0, crossing, opts)

    def _cuts(self, g: _Graph, stage: Dict[str, int], b: int, out: set, rows: np.ndarray, crossing: set,
              opts: CostOptions) -> np.ndarray:
        """Bytes crossing the boundary at each point: values made in the prefix and read after it
        (``crossing``: the nodes whose values cross it in the plan)."""
        index = {n: i for i, n in enumerate(self.nodes)}
        base = lambda u: stage[u] <= b and u not in out
        near = {u for n in self.nodes for u in g.pred[n] if base(u)}
        cut = np.zeros(len(self.masks))
        for u in crossing:  # the prefix's values read beyond the window whatever the point
            if u not in near and u not in index and counts_comm(g.graph.nodes[u], opts):
                cut += g.graph.nodes[u].out_bytes
        for u in near | set(self.nodes):
            if not counts_comm(g.graph.nodes[u], opts):
                continue
            inside = rows[:, index[u]] if u in index else True
            later = [v for v in g.succ[u] if not base(v)]
            if any(v not in index for v in later):
                read = True  # some reader runs after the window whatever the point
            else:
                read = np.zeros(len(self.masks), dtype=bool)
                for v in later:
                    read = read | ~rows[:, index[v]]
            cut += g.graph.nodes[u].out_bytes * (inside & read)
        return cut


def _windows(g: _Graph, stage: Dict[str, int], members: List[List[str]], opts: CostOptions, deadline: float,
             ) -> Optional[List[_Window]]:
    """One window per boundary (see the module docstring); None past ``deadline``."""
    crossing: List[set] = [set() for _ in range(len(members) - 1)]
    for u, readers in g.succ.items():
        for b in range(stage[u], max((stage[v] for v in readers), default=-1)):
            crossing[b].add(u)
    windows = []
    sums = [0.0, 0.0, 0.0]
    for b in range(len(members) - 1):
        for i, field in enumerate((g.work, g.params, g.acts)):
            sums[i] += sum(field[n] for n in members[b])
        if time.monotonic() > deadline:
            return None
        left, right = members[b], members[b + 1]
        out, into, masks = _grown(left, right, g)
        windows.append(_Window(g, stage, b, out, into, masks, tuple(sums), crossing[b], opts))
    return windows


def _grown(left: List[str], right: List[str], g: _Graph) -> Tuple[List[str], List[str], List[int]]:
    """A boundary's window: nodes taken one at a time from each side in turn (under half of either
    stage, at most ``WINDOW`` a side) while its downsets stay within ``POINTS``."""
    sides = [0, 0]
    most = [min(WINDOW, (len(left) - 1) // 2), min(WINDOW, (len(right) - 1) // 2)]
    masks: List[int] = [0]
    while True:
        grew = False
        for side in (0, 1):
            if sides[side] >= most[side]:
                continue
            sides[side] += 1
            found = _downsets(_tail(left, sides[0], g) + _head(right, sides[1], g), g, POINTS)
            if found is None:
                sides[side] -= 1
                most[side] = sides[side]
            else:
                masks, grew = found, True
        if not grew:
            out, into = _tail(left, sides[0], g), _head(right, sides[1], g)
            return out, into, masks


def _tail(nodes: List[str], n: int, g: _Graph) -> List[str]:
    """The last ``n`` of a stage's nodes (graph order), after its last node that may not move."""
    out = nodes[len(nodes) - n:] if n > 0 else []
    fixed = [i for i, name in enumerate(out) if name in g.fixed]
    return out[fixed[-1] + 1:] if fixed else out


def _head(nodes: List[str], n: int, g: _Graph) -> List[str]:
    """The first ``n`` of a stage's nodes (graph order), before its first node that may not move."""
    into = nodes[:n]
    fixed = [i for i, name in enumerate(into) if name in g.fixed]
    return into[:fixed[0]] if fixed else into


def _moves(replicas: Sequence[int], tied_stages: set, in_order: bool, opts: CostOptions,
           moves: int) -> List[List[int]]:
    """Each stage's replica changes a round may make: none (``moves`` 0, a memory limit, replication other
    than ``any``, a two-level machine whose stages do not sit on consecutive ranks in stage order, not
    ``in_order``, or one of ``tied_stages``, holding a tied weight, whose sync depends on its group), else
    one replica fewer or more (at least one)."""
    if moves == 0 or opts.memory is not None or opts.replication != "any" or \
            (opts.gpus_per_node is not None and not in_order):
        return [[0] for _ in replicas]
    return [[0] if j in tied_stages else [d for d in (-1, 0, 1) if r + d >= 1] for j, r in enumerate(replicas)]


def _round(g: _Graph, assignment: Dict[str, int], replicas: Sequence[int], ranks: Sequence[Sequence[int]],
           opts: CostOptions, deadline: float, order: int = 0, moves: int = 0, cache: Optional[dict] = None,
           ) -> Optional[Tuple[Dict[str, int], List[int], float]]:
    """The best plan in the corridor around ``assignment`` (windows cut in ``g.orders[order]``), its
    replicas and its bottleneck as the DP scored it; None past ``deadline``.

    ``moves``: how many devices the stages before any boundary may have given up or taken in all, each
    stage one replica more or fewer (``_moves`` says where); the plan ends on as many devices as before
    (no more, with ``fewer_devices``), its stages on consecutive ranks in stage order, so a stage's ranks
    shift by the devices moved before it (on a two-level machine a stage holding a tied weight keeps its
    ranks: none moved before it). Without moves every stage keeps its replicas and ranks. ``cache``: the
    all-reduce and link charges per set of ranks, kept between a polish's rounds (same options; on nodes
    of 8 working them out was half of a round's time).

    The DP is a minimax over the boundaries. A stage's time is the larger of its own work (compute over
    its replicas plus its all-reduce) and its links, so each link is charged once, at its boundary, with
    the replica counts of the stages on both sides of it: the state after stage j is (boundary j's point,
    devices moved so far, stage j's change).
    """
    S = len(replicas)
    if S < 2:
        return None
    members: List[List[str]] = [[] for _ in range(S)]
    for name in sorted(assignment, key=g.orders[order].__getitem__):
        members[assignment[name]].append(name)
    windows = _windows(g, assignment, members, opts, deadline)
    if windows is None:
        return None
    tied = tied_weights(g.graph, assignment)
    tied_bytes = [sum(v for k, v in tied.items() if j in k) for j in range(S)]
    tied_s = [sum(tied_sync_s(v, ranks[j], [x for k in grp for x in ranks[k]], opts)
                  for grp, v in tied.items() if j in grp) for j in range(S)]
    own_params = [param_bytes_of(g.graph, m) - sum(g.params[n] for n in m) for m in members]  # shared, per stage
    tied_stages = {j for group in tied for j in group}
    memory = [memory_terms(j, replicas, opts) for j in range(S)]
    total = [sum(field.values()) for field in (g.work, g.params, g.acts)]
    in_order = [list(r) for r in ranks] == topology.stage_ranks(replicas)
    change = _moves(replicas, tied_stages, in_order, opts, moves)
    span = moves if any(len(c) > 1 for c in change) else 0
    D = 2 * span + 1  # devices moved so far, -span .. span
    first_rank = np.cumsum([0] + list(replicas))
    shifts = range(-span, span + 1)
    flat = opts.gpus_per_node is None  # where only replica counts matter, not which ranks

    def on(j: int, d: int, shift: int) -> Optional[Sequence[int]]:
        """Stage j's ranks with its count changed by d and ``shift`` devices moved before it (None where
        that would start below rank 0: a state no plan reaches); a ``range`` where they are consecutive.
        On a flat machine only the count matters (``per_state`` asks once for every state), so the shift
        is left out."""
        if d == 0 and (shift == 0 or flat) and not in_order:
            return ranks[j]
        start = int(first_rank[j]) + (0 if flat else shift)
        return range(start, start + replicas[j] + d) if start >= 0 else None

    known = {} if cache is None else cache
    charge = {"sync": lambda r: allreduce_on(1.0, r, opts), "link": lambda x, y: cut_on(1.0, x, y, opts)}

    def key(what: str, placed: List[Sequence[int]]) -> tuple:
        """The cache's key: the counts on a flat machine; else consecutive ranks as (first, count) moved
        by whole nodes to start in the first node (the all-reduce and the links depend on how the ranks
        fall into nodes, not on which nodes: ``topology.node_counts``, ``pair_load``), other rank sets
        whole."""
        if flat:
            return (what, *(len(r) for r in placed))
        if all(isinstance(r, range) for r in placed):
            base = min(r.start for r in placed) // opts.gpus_per_node * opts.gpus_per_node
            return (what, *((r.start - base, len(r)) for r in placed))
        return (what, *(tuple(r) for r in placed))

    def per_state(what: str, *stages) -> np.ndarray:
        """``charge[what]`` of the ranks of ``stages`` ((stage, change, devices moved before it less those
        before stage j)) for each state m (devices moved before stage j): inf where a stage has no ranks."""
        def one(m):
            placed = [on(j, d, m + extra) for j, d, extra in stages]
            if any(r is None for r in placed):
                return math.inf
            k = key(what, placed)
            if k not in known:
                known[k] = charge[what](*placed)
            return known[k]
        return np.full(D, one(0)) if flat else np.array([one(m) for m in shifts])

    def work(j, lo: Optional[_Window], hi: Optional[_Window], d: int) -> np.ndarray:
        """Stage ``j``'s own time (no links) with ``d`` replicas more, between each point of ``lo`` (rows;
        None: the start) and of ``hi`` (columns; None: the end), for each state (the last axis)."""
        at = lambda w, field, end: (getattr(w, field)[:, None] if w is lo else getattr(w, field)[None, :]) \
            if w is not None else np.array([[end]])
        compute = at(hi, "work", total[0]) - at(lo, "work", 0.0)
        params = at(hi, "params", total[1]) - at(lo, "params", 0.0) + own_params[j]
        ar = per_state("sync", (j, d, 0))
        reached = np.isfinite(ar)
        t = combine_stage_time(compute[:, :, None], replicas[j] + d,
                               np.where(reached, ar, 0.0) * (params - tied_bytes[j])[:, :, None] + tied_s[j], 0.0)
        t = np.where(reached, t, math.inf)
        if opts.memory is not None:
            acts = at(hi, "acts", total[2]) - at(lo, "acts", 0.0)
            t = np.where((device_memory_bytes(params, acts, *memory[j]) <= opts.memory)[:, :, None], t, math.inf)
        return np.broadcast_to(t, (compute.shape[0], compute.shape[1], D))

    # best[i][p, m]: the slowest stage or link up to stage j, ending at boundary j's point p, with m - span
    # devices moved, stage j changed by change[j][i]
    best = []
    for d in change[0]:
        row = np.full((len(windows[0].masks), D), math.inf)
        if abs(d) <= span:
            row[:, span + d] = work(0, None, windows[0], d)[0, :, span]
        best.append(row)
    came: List[Tuple[List[np.ndarray], List[np.ndarray]]] = []  # per stage j >= 1: per change, argmin p, argmin i
    for j in range(1, S):
        lo, hi = windows[j - 1], (windows[j] if j < S - 1 else None)
        nxt, by_p, by_i = [], [], []
        for d in change[j]:
            # the link at boundary j - 1, charged with both sides' counts; the best earlier change per point
            linked = np.stack([np.maximum(b, _times_cut(per_state("link", (j - 1, e, -e), (j, d, 0)), lo.cut))
                               for b, e in zip(best, change[j - 1])])
            pick = np.argmin(linked, axis=0)  # (P, D)
            A = np.take_along_axis(linked, pick[None], axis=0)[0]
            if not flat and j in tied_stages:  # its ranks, and so its group's sync, as they were
                A = np.where(np.arange(D) == span, A, math.inf)
            both = np.maximum(A[:, None, :], work(j, lo, hi, d))  # (P, Q, D)
            p = np.argmin(both, axis=0)  # (Q, D)
            val = np.take_along_axis(both, p[None], axis=0)[0]
            row = np.full_like(val, math.inf)  # shifted by d devices
            if d >= 0:
                row[:, d:] = val[:, :D - d]
            else:
                row[:, :D + d] = val[:, -d:]
            nxt.append(row)
            by_p.append(p)
            by_i.append(pick)
        best = nxt
        came.append((by_p, by_i))
        if time.monotonic() > deadline:
            return None
    # one point at the end; as many devices as before (``fewer_devices``: no more)
    end = np.stack(best)[:, 0, :span + 1] if opts.fewer_devices else np.stack(best)[:, 0, span:span + 1]
    i, m = np.unravel_index(int(np.argmin(end)), end.shape)
    worst = float(end[i, m])
    m += 0 if opts.fewer_devices else span
    if not math.isfinite(worst):
        return None
    point, counts = [0] * (S - 1), list(replicas)
    q = 0
    for j in range(S - 1, 0, -1):
        d = change[j][i]
        counts[j] = replicas[j] + d
        m -= d  # devices moved before stage j
        by_p, by_i = came[j - 1]
        p = int(by_p[i][q, m])
        i = int(by_i[i][p, m])
        point[j - 1], q = p, p
    counts[0] = replicas[0] + change[0][i]
    new = dict(assignment)
    for b, w in enumerate(windows):
        mask = w.masks[point[b]]
        for k, name in enumerate(w.nodes):
            new[name] = b if (mask >> k) & 1 else b + 1
    return new, counts, worst


def _times_cut(link: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """Seconds per state (columns) a boundary's link takes at each point (rows): inf for a state no plan
    reaches (``link`` inf), also where nothing crosses."""
    reached = np.isfinite(link)
    return np.where(reached, np.where(reached, link, 0.0) * cut[:, None], math.inf)


def _working(g: _Graph, assignment: Mapping[str, int]) -> set:
    """The stages that run some node that is neither an input nor an output: a window keeps one node of
    each stage, which could be one of those, and a polished plan must keep every working stage so."""
    return {assignment[n] for n, node in g.graph.nodes.items() if not node.is_input and g.succ[n]}


def polished(graph: CostGraph, assignment: Mapping[str, int], replicas: Sequence[int],
             ranks: Sequence[Sequence[int]], opts: CostOptions, deadline: float = math.inf, moves: int = 0,
             ) -> Optional[Tuple[Dict[str, int], List[int], List[List[int]]]]:
    """A faster plan (assignment, replicas, ranks) in the corridor (see the module docstring), or None
    where none is found before ``deadline``. ``moves``: see ``_round``; rounds that keep the replicas come
    first, those that move them (slower) once neither order helps, then (with ``moves``) stages split in
    two (``_splits``), each split plan polished again and kept where it ends faster."""
    g = _Graph(graph)
    plan = (dict(assignment), list(replicas), [list(r) for r in ranks])
    start = evaluate(graph, plan[0], plan[1], opts, ranks=plan[2]).bottleneck_s
    cache: dict = {}
    plan, now = _descended(g, plan, start, opts, deadline, moves, cache)
    better, failed = True, 0
    while moves and better and time.monotonic() < deadline:  # until no split helps
        better = False
        for j, first in _splits(g, plan, opts):
            if time.monotonic() >= deadline or failed >= SPLIT_TRIES:
                break
            cut = _split(g, plan[0], plan[1], j, first)
            if cut is None:
                continue
            split = (cut[0], cut[1], topology.stage_ranks(cut[1]))
            found, t = _descended(g, split, evaluate(graph, *cut, opts, ranks=split[2]).bottleneck_s, opts,
                                  deadline, moves, cache)
            if t < now:
                plan, now, better, failed = found, t, True, 0
                break
            failed += 1
    return plan if now < start else None


def _descended(g: _Graph, plan: Tuple[Dict[str, int], List[int], List[List[int]]], now: float, opts: CostOptions,
               deadline: float, moves: int, cache: dict,
               ) -> Tuple[Tuple[Dict[str, int], List[int], List[List[int]]], float]:
    """``plan`` (scored ``now``) after rounds while one helps (see ``polished``), with its score."""
    graph = g.graph
    current, counts, placed = plan
    working = _working(g, current)
    kinds = [(order, 0) for order in range(len(g.orders))]
    kinds += [(order, moves) for order in range(len(g.orders))] if moves else []
    kind, stuck = 0, 0
    while time.monotonic() < deadline and stuck < len(kinds):  # until no kind of round helps
        order, moved = kinds[kind]
        found = _round(g, current, counts, placed, opts, deadline, order, moved, cache)
        if found is None:
            break
        new, reps, _ = found
        at = placed if reps == counts else topology.stage_ranks(reps)
        ev = evaluate(graph, new, reps, opts, ranks=at)
        if ev.bottleneck_s < now and _working(g, new) >= working and \
                (opts.memory is None or ev.peak_memory_bytes <= opts.memory):
            current, counts, placed, now, stuck = new, reps, at, ev.bottleneck_s, 0
        else:
            kind, stuck = (kind + 1) % len(kinds), stuck + 1
    return (current, counts, placed), now


def _splits(g: _Graph, plan: Tuple[Dict[str, int], List[int], List[List[int]]], opts: CostOptions,
            ) -> List[Tuple[int, int]]:
    """The splits to try on ``plan``: (stage, replicas of its first part) for each stage of two or more
    replicas (one replica, half, all but one to the first part, where both parts' counts are allowed:
    under ``pow2`` halves only), slowest stage first; none with a memory limit (the microbatches in
    flight depend on every count), on a two-level machine whose stages do not sit on consecutive ranks
    in stage order, or for a stage holding a tied weight (its sync depends on its group).

    Why: a replicated stage pays an all-reduce of its weights that two stages of fewer replicas each
    pay less of (one replica: none), and the rounds keep the stage count, so they cannot find that. On
    24 Llama layers and 32 devices the segment DP's last stage held three replicas and spent 0.48 ms of
    its 4.94 ms in the all-reduce: split into one replica and two, then another stage of two into two of
    one, the plan ran 0.3 % faster (4.944 -> 4.928 ms), within 1 % of the bound."""
    assignment, replicas, ranks = plan
    in_order = [list(r) for r in ranks] == topology.stage_ranks(replicas)
    if opts.memory is not None or (opts.gpus_per_node is not None and not in_order):
        return []
    tied_stages = {j for group in tied_weights(g.graph, assignment) for j in group}
    allowed = set(opts.allowed_replicas())
    times = [s.time_s for s in evaluate(g.graph, assignment, replicas, opts, ranks=ranks).stages]
    out = []
    for j in sorted(range(len(replicas)), key=lambda j: -times[j]):
        r = replicas[j]
        if r >= 2 and j not in tied_stages:
            out += [(j, first) for first in sorted({1, r // 2, r - 1}) if {first, r - first} <= allowed]
    return out


def _split(g: _Graph, assignment: Mapping[str, int], replicas: Sequence[int], j: int, first: int,
           ) -> Optional[Tuple[Dict[str, int], List[int]]]:
    """Stage ``j`` cut in two where its compute (in graph order) reaches ``first / replicas[j]`` of the
    whole: the first part with ``first`` replicas, the rest with the others; None where a part would
    hold no working node. A prefix of a convex stage in a topological order is convex, and nothing in
    the rest feeds it, so the plan stays one (the rounds after it move the new boundary)."""
    names = sorted((n for n, s in assignment.items() if s == j), key=g.orders[0].__getitem__)
    target = sum(g.work[n] for n in names) * first / replicas[j]
    run, cut = 0.0, len(names)
    for i, name in enumerate(names):
        run += g.work[name]
        if run >= target:
            cut = i + 1
            break
    head = set(names[:cut])
    new = {n: s + (1 if s > j or (s == j and n not in head) else 0) for n, s in assignment.items()}
    working = _working(g, new)
    if j not in working or j + 1 not in working:
        return None
    return new, list(replicas[:j]) + [first, replicas[j] - first] + list(replicas[j + 1:])


def reserve(time_limit: float) -> float:
    """Seconds of a ``partition`` call's limit kept for ``result``: 5 % of it, at most half a second. A
    round takes 0.05-0.15 s on 24 Llama layers (28-192 stages), a whole polish about 3 s on 96 layers and
    512 devices (140 stages, cut at the limit), and the first rounds gain the most; the searches' bounds
    lose what they would have done in that time (24 Llama layers on 512 devices: 1.87 -> 2.22 % open with
    0.3 or 0.5 s less, same plan: the bound's last pass there ends at the edge of the limit)."""
    return min(0.5, 0.05 * time_limit)


def result(graph: CostGraph, found: PartitionResult, deadline: float,
           progress: Optional[Callable[[str], None]] = None) -> PartitionResult:
    """``found`` with its boundaries (and where ``_moves`` allows, its replica counts) ``polished`` where that
    makes it faster (same bound, so a smaller gap); as it is where it is proven (OPTIMAL) or has one stage."""
    if found.status == "OPTIMAL" or len(found.replicas) < 2:
        return found
    ranks = [s.ranks for s in found.stages]
    opts = found.options
    new = polished(graph, found.assignment, found.replicas, ranks, opts, deadline, moves=MOVES)
    if new is None:
        return found
    assignment, replicas, ranks = new
    ev = evaluate(graph, assignment, replicas, opts, ranks=ranks)
    split = len(replicas) - len(found.replicas)  # stages split in two
    # replicas some stage gave up (where the stages are the same ones)
    moved = 0 if split else sum(max(0, b - a) for a, b in zip(replicas, found.replicas))
    if progress is not None:
        also = f", {moved} replica{'s' * (moved > 1)} to other stages" if moved else \
            f", {split} replicated stage{'s' * (split > 1)} split in two" if split else ""
        progress(f"partition: stage boundaries moved on single nodes{also}: {found.bottleneck_s * 1e3:.4g} -> "
                 f"{ev.bottleneck_s * 1e3:.4g} ms per microbatch")
    out = dataclasses.replace(found, assignment=assignment, replicas=list(replicas), stages=ev.stages,
                              bottleneck_s=ev.bottleneck_s,
                              objective_s=ev.bottleneck_s, bound_s=min(found.bound_s, ev.bottleneck_s),
                              method=found.method + ", boundaries polished" + (", replicas moved" if moved else "")
                              + (", stages split" if split else ""))
    if out.status == "FEASIBLE" and out.gap <= OPTIMAL_GAP:
        out.status = "OPTIMAL"
    return out
