"""The downset lattice of a graph as a chain of small lattices, one per segment.

A *separator* is a unit ``s`` such that every unit before it in the order is
an ancestor of ``s``, and every unit after it descends from ``s``. Then every downset either lies
inside ``{.., s}`` or contains it, so the downsets of the whole graph are those
of the first segment, then ``{.., s}`` plus those of the next segment, and so
on: the lattice is the concatenation of the segments' lattices. In a
transformer the residual stream after each residual add is a separator, so a
100-block model has ~200 segments of a few dozen downsets each, where the
whole graph has astronomically many antichains, and the exact DP over ALL
convex plans (``chain.py``) stays cheap.

Before that, nodes that cost nothing and send nothing (shape reads, integer
arithmetic: zero compute, no weights, zero output bytes) are folded away: one
with a single producer joins it (it can always sit in its producer's stage:
moving it there keeps the plan convex and changes no cost), one with no
producer among the placed nodes is left out like a model input (the mapping
back puts it with its first consumer). That folding is exact, and it removes
most of the small branches that would multiply the downsets. ``folded_units``
also folds nodes of tiny but nonzero cost and drops dead nodes' compute; what
that could cost is taken off the bound (``fold_margin``).
"""
from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from passes.costgraph import CostGraph
from passes.partition import read_chains
from passes.partition.coarsen import Hidden, Units, build_units, model_nodes
from passes.partition.costmodel import CostOptions
from passes.partition.downsets import downsets_from
from passes.partition.memory_guard import past

MAX_DOWNSETS = 4000  # a segment of more downsets has no lattice here (``build_segments``)


def folded_units(graph: CostGraph, opts: CostOptions, tiny: float = 0.0, tiny_silent: float = 0.0,
                 tiny_input: float = -1.0, keep_dead: bool = False, bridge: bool = False,
                 chain_above: Optional[float] = None) -> Tuple[Units, List[float]]:
    """Units with free nodes folded away (see the module docstring); also each unit's folded compute.

    A node folds into a producer's group u when it holds no weights, costs at
    most ``tiny`` seconds (``tiny_silent`` if it sends nothing or to no one), every other producer of it is in u or an ancestor of
    u, and either it sends nothing (0 output bytes), or the one byte-carrying
    value it reads comes from u and goes to it alone, and it sends no more
    bytes than that value, or nobody reads it: any plan can then move it into
    u's stage without a worse cut. Moving them can add at most the folded compute of one segment
    to a stage (a stage boundary lies in one segment and only splits that
    segment's groups), so ``fold_margin`` of it, subtracted from a bound on the
    folded graph, bounds the original; that margin is not divided by the
    stage's replicas. So the compute of folded nodes that send nothing is
    dropped instead, as dead nodes' is: a relaxation whose bound loses only
    that compute over each stage's replicas (the benchmark GPTs read shapes for
    ~2 us a block: as a margin, 0.45 % of the bound at 32 blocks on 512
    devices). Plans are scored on the graph, which charges it. A node that
    sends nothing and has no placed producer is left out, as is a cheap one
    computed from the inputs alone (``tiny_input``) and a chain computed from a
    small untied weight alone (``weight_only``). The compute dropped and
    left out still counts where every plan must run it (``dropped_compute``),
    and the values left out where every plan must send them
    (``Units.hidden_sends``). ``keep_dead``: charge dead and dropped nodes'
    compute to the group they join, for a search whose plans are scored as
    they are (their bound is then lowered by it through ``fold_margin``).
    ``bridge``: a dropped node that sends nothing is listed in ``Units.bridged``
    with a unit before it and one after it (``bridged_compute``), so the segment
    DP still charges it to every stage that holds both (``Segment.start``):
    every plan runs it there. Only the compute of such nodes whose two units a
    cut separates is then lost to the bound, and such nodes may fold at any cost.
    ``chain_above`` (seconds, with ``bridge``): the reads bridged from one unit, where they are worth
    more than this to a cut, chained in the order they are needed, so a cut gives up at most one of
    them (``read_chains.py``).
    """
    names = model_nodes(graph, opts)
    index = {n: i for i, n in enumerate(names)}
    preds: Dict[str, List[str]] = {n: [] for n in names}
    consumers: Dict[str, set] = {n: set() for n in names}
    for u, v in graph.edges:
        if u in index and v in index:
            preds[v].append(u)
            consumers[u].add(v)
    dead = set()  # nothing they compute reaches the model's output: free to sit with their producer
    has_output = any(graph.nodes[n].op == "output" for n in names)
    for n in reversed(names):
        node = graph.nodes[n]
        result = node.op == "output" or (not has_output and not consumers[n] and (node.compute_s > 0 or n == names[-1]))
        if not result and not node.params and node.param_bytes == 0 and consumers[n] <= dead:
            dead.add(n)
    derived = weight_only(graph, names)
    head: Dict[str, str] = {}
    groups: Dict[str, List[str]] = {}
    quiet = set()  # light nodes folded that send nothing: their compute dropped like dead nodes' (below)
    anc: Dict[str, int] = {}  # bitmask (by index) of the groups each group descends from
    for n in names:
        node = graph.nodes[n]
        ps = sorted({head[p] for p in preds[n] if p in head}, key=index.__getitem__)
        silent = node.out_bytes == 0 or not consumers[n]
        light = n in dead or (node.compute_s <= (tiny_silent if silent else tiny) and node.param_bytes == 0
                              and not node.params and node.op != "output" and not node.is_input)
        weightless = node.param_bytes == 0 and not node.params and node.op != "output" and not node.is_input
        if not ps and weightless and (light and (node.out_bytes == 0 or consumers[n] <= dead)
                                      or node.compute_s <= tiny_input) or n in derived:
            continue  # like a model input: placed with its first consumer afterwards
        target = _fold_target(graph, n, ps, preds[n], consumers, head, anc, index, dead) if light else None
        if target is not None:
            head[n] = target
            groups[target].append(n)
            if silent and n not in dead:
                quiet.add(n)
            continue
        head[n] = n
        groups[n] = [n]
        mask = 0
        for p in ps:
            mask |= anc[p] | (1 << index[p])
        anc[n] = mask
    units = build_units(graph, opts, list(groups.values()))
    folded = []
    for i, members in enumerate(units.members):
        if not keep_dead:  # dropped: a relaxation
            units.compute[i] -= sum(graph.nodes[m].compute_s for m in members if m in dead or m in quiet)
        folded.append(units.compute[i] - graph.nodes[members[0]].compute_s)
    loose = set(names) - set(head) | (set() if keep_dead else dead | quiet)
    unit_of = units.unit_of()
    units.hidden = dropped_compute(graph, names, consumers, loose, unit_of)
    if bridge and not keep_dead:
        units.bridged, read_nodes = bridged_compute(graph, units, quiet, preds, consumers)
    units.hidden_sends = [(graph.nodes[n].out_bytes, readers, readers, []) for n in names if n not in head
                          for readers in [sorted({unit_of[c] for c in consumers[n] if c in unit_of})]
                          if graph.nodes[n].out_bytes > 0 and readers]
    if bridge and not keep_dead and chain_above is not None:
        units, folded = read_chains.chain_reads(graph, opts, units, folded, read_nodes, index, chain_above)
    return units, folded


WEIGHT_ONLY_BYTES = 1e-3  # of the model's weight bytes: most a weight-only chain may hold (``weight_only``)


def weight_only(graph: CostGraph, names: List[str]) -> set:
    """Nodes of ``names`` computed from small untied weights alone, left out like inputs (``folded_units``).

    Gemma's RMSNorm scales by ``1 + weight.float()``: the weight's cast and
    the add are a chain with no producer inside the layer, so no residual add
    after it is a separator (4 in Gemma's 1,567 units, 602 in Mistral's) and the
    segment DP's lattice was the product of dozens of layers'. Such a chain may
    sit in any stage up to its readers', so leaving it out is a relaxation as
    for an input's shape reads: its compute still counts in every prefix that
    holds a reader (``Units.hidden``), its value is charged from its first
    reader's stage on (``Units.hidden_sends``), and only its weights are lost to
    the bound, which ``WEIGHT_ONLY_BYTES`` keeps to a norm's (Gemma's: 256 bytes
    a norm). A tied weight stays in its unit: its sync is what ties cost. Plans
    put the chain with its first reader (``coarsen.to_nodes``), then in the
    stage up to it where it slows the plan least (``segment_plan.silent_moves``).
    A node that reads a model input is not one, placed or not (fxpipe's model
    leaves inputs out of ``names``: PipeDream's vgg16 read its first convolutions
    as weight-only before this looked at every producer).
    """
    preds = graph.predecessors()
    held: Dict[str, int] = {}
    for n in names:
        for p in graph.nodes[n].params:
            held[p] = held.get(p, 0) + 1
    limit = WEIGHT_ONLY_BYTES * sum(graph.nodes[n].param_bytes for n in names)
    out: set = set()
    for n in names:
        node = graph.nodes[n]
        if node.is_input or node.op == "output" or any(p not in out for p in preds[n]):
            continue
        holds = node.param_bytes > 0 or bool(node.params)
        if (holds and node.param_bytes <= limit and all(held[p] == 1 for p in node.params)) \
                or (not holds and preds[n]):  # a weightless node with no producer is left to ``tiny_input``
            out.add(n)
    return out


def bridged_compute(graph: CostGraph, units: Units, quiet: set, preds: Dict[str, List[str]],
                    consumers: Dict[str, set]) -> Tuple[List[Tuple[float, int, int, int]], List[str]]:
    """``Units.bridged`` for the folded nodes that send nothing (``quiet``), and the node of each entry
    (for ``read_chains``). An entry is (seconds, the latest unit whose first node is an ancestor of the node, the earliest whose first node descends from it, the
    unit it joined). A unit's stage is its first node's (the bound maps a plan of the graph to one of
    the units that way, ``folded_units``), and a convex plan puts a node no earlier than any ancestor
    and no later than any descendant: so a stage holding both units holds the node in every plan. A
    node with no such pair, or whose earlier unit is an input's, is left out (its compute dropped)."""
    unit_of = units.unit_of()
    head = {members[0] for members in units.members}

    def nearest(n: str, step, pick):
        seen, todo, found = set(), list(step(n)), []
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if m in head:
                found.append(unit_of[m])
            else:
                todo += step(m)
        return pick(found) if found else None

    out, nodes = [], []
    for n in sorted(quiet, key=lambda m: unit_of[m]):
        before = nearest(n, lambda m: preds.get(m, ()), max)
        after = nearest(n, lambda m: consumers.get(m, ()), min)
        seconds = graph.nodes[n].compute_s
        # an input's unit sits in every downset: a node it feeds would straddle the first stage's start
        if before is not None and after is not None and seconds > 0 and not units.is_input[before]:
            out.append((seconds, before, after, unit_of[n]))
            nodes.append(n)
    return out, nodes


def dropped_compute(graph: CostGraph, names: List[str], consumers: Dict[str, set], loose: set,
                    unit_of: Dict[str, int]) -> List[Hidden]:
    """``Units.hidden`` for the compute folding drops (nodes left out like inputs, dead and quiet
    nodes): a node may sit in any stage up to its readers', but a prefix of stages that holds one
    of the placed nodes it feeds holds it too, so its compute still counts in the devices that
    prefix needs (``chain.ChainSolver._least_devices``). Without this a bound forgot it: HF
    GPT-2's position and mask nodes, left out like inputs, are 22 % of sum C / K at 16 devices.
    Nodes whose results reach no placed node (dead ones) force nothing. One entry per set of
    forcing units and home: the unit a folded node joined (``to_nodes`` runs it there), -1 for
    one left out."""
    below: Dict[str, frozenset] = {}
    by_forcing: Dict[Tuple[frozenset, int], float] = {}
    for n in reversed(names):
        if n not in loose:
            continue
        forced = frozenset()
        for c in consumers[n]:
            forced |= below.get(c, frozenset()) if c in loose else frozenset([unit_of[c]])
        below[n] = forced
        if forced and graph.nodes[n].compute_s > 0:  # a folded node runs with its group (``to_nodes``)
            key = (forced, unit_of.get(n, -1))
            by_forcing[key] = by_forcing.get(key, 0.0) + graph.nodes[n].compute_s
    return [(seconds, sorted(forcing), home, []) for (forcing, home), seconds in by_forcing.items()]


def _fold_target(graph: CostGraph, n: str, ps: List[str], raw_preds: List[str], consumers, head, anc,
                 index, dead) -> Optional[str]:
    """The group ``n`` may join (see ``folded_units``), or None."""
    carrying = [p for p in raw_preds if p in head and graph.nodes[p].out_bytes > 0]
    if graph.nodes[n].out_bytes == 0 or not consumers[n] or consumers[n] <= dead:  # sends nothing that is used
        candidates = ps
    elif len(carrying) == 1 and consumers[carrying[0]] == {n} \
            and graph.nodes[carrying[0]].out_bytes >= graph.nodes[n].out_bytes:
        candidates = [head[carrying[0]]]
    else:
        return None
    for u in candidates:
        if all(p == u or (anc[u] >> index[p]) & 1 for p in ps):
            return u
    return None


def fold_margin(units: Units, folded: List[float]) -> float:
    """Most folded compute any stage can gain (see ``folded_units``): the largest per segment.

    The segments here are those between consecutive separators, before
    ``build_segments`` joins them: a joined segment's lattice is the
    concatenation of theirs, so a stage boundary still lies in one of them.
    """
    bounds = [sum(units.is_input)] + separators(units) + [len(units)]
    return max((sum(folded[lo:hi]) for lo, hi in zip(bounds, bounds[1:])), default=0.0)


@dataclass
class Segment:
    """The downsets of one segment, as points of the whole lattice."""

    units: List[int]  # unit indices of the segment
    member: np.ndarray  # (points, len(units)) bool: which segment units each point holds
    compute: np.ndarray  # (points,) compute of the whole downset (prefix included); a stage (j, i) runs at
    # least ``compute[i] - start[j]`` (and ``plain[i] - plain[j]``, ``chain.stage_compute``)
    params: np.ndarray  # (points,) own (unshared) weight bytes of the whole downset
    cut: np.ndarray  # (points,) bytes crossing out of the downset
    shared: np.ndarray  # (points, n_shared + n_pairs): users of each shared weight inside the downset, then
    # for every (shared weight, user) pair (``user_pairs``) 1 where that user is inside
    hidden: np.ndarray  # (points,) compute of ``Units.hidden`` that the downset forces in (prefix included)
    sub_j: np.ndarray  # pairs (j, i) of points of this segment with j a strict subset of i
    sub_i: np.ndarray
    # (points,) as ``compute``, with the ``Units.bridged`` compute of every node whose earlier unit the
    # downset holds (``compute`` counts those whose later unit it holds): what a stage from here leaves
    # behind at most. ``compute`` itself where nothing is bridged
    start: np.ndarray = None  # type: ignore[assignment]
    # ``start`` - ``compute`` at the segment's own empty point (the bridged nodes that straddle it):
    # ``start`` within the segment alone is ``member @ own start + base_span`` (``ChainSolver._own_sums``)
    base_span: float = 0.0
    # (points,) the units' own compute alone, the bridged nodes' left out: a stage runs at least the
    # difference of these too, where a bridged node straddles it (``compute[i] - start[j]`` then falls
    # below it). None where nothing is bridged
    plain: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        if self.start is None:
            self.start = self.compute


def separators(units: Units) -> List[int]:
    """Positions p (units[:p] is the prefix) where the lattice splits; inputs sit in every downset.

    p splits it when the prefix is ``s = p - 1`` and its ancestors, and every
    later unit descends from s: each later unit has a producer at s or later
    (so a value used far ahead, like an attention mask, does not prevent it).
    """
    n = len(units)
    inputs = [u for u in range(n) if units.is_input[u]]
    body = [u for u in range(n) if not units.is_input[u]]
    if not all(a < b for a, b in zip(inputs, inputs[1:] + body[:1])):
        return []  # inputs not first: no split
    preds: List[List[int]] = [[] for _ in range(n)]
    for a, b in units.edges:
        if not units.is_input[a]:
            preds[b].append(a)
    start = len(inputs)
    latest = [max(ps, default=-1) for ps in preds]  # the latest producer of each unit
    suffix_min = [n] * (n + 1)
    for v in range(n - 1, -1, -1):
        suffix_min[v] = min(suffix_min[v + 1], latest[v])
    anc = [0] * n
    cuts = []
    for s in range(start, n - 1):
        for a in preds[s]:
            anc[s] |= anc[a] | (1 << a)
        full = ((1 << s) - 1) & ~((1 << start) - 1)
        if anc[s] == full and suffix_min[s + 1] >= s:
            cuts.append(s + 1)
    return cuts


_BUILT: List[tuple] = []  # (key, segments) of the last two ``build_segments``, see there


def build_segments(units: Units, limit: int = MAX_DOWNSETS, deadline: float = math.inf) -> Optional[List[Segment]]:
    """The segments' points (see ``Segment``); None if a segment has more than ``limit`` downsets
    or the deadline passes.

    The last two answers are kept and given again for equal units: a two-level plan runs the segment DP
    on up to four cost models of the same graph and K (the relaxed, faster, slower and charged
    ones), whose units are equal, and building the segments of 32 blocks with many sub-block points
    took 3 s each time; the placed ones fold more than the flat ones (``segment_plan.QUIET_PLACED``), so
    such a plan alternates between two lattices.
    Segments are not modified by their users.

    The units are compared by their pickled bytes: equal bytes are equal units (a pickle reads back
    one value), and equal units that pickle apart (a dict built in another order) only build again.
    Walking them into nested tuples instead took 0.07 s a call on the 96-layer Llama, six calls a
    plan: time its one deciding bound pass (``segment_plan.finer_bound``) needs."""
    key = (pickle.dumps([getattr(units, f.name) for f in dataclasses.fields(units)], pickle.HIGHEST_PROTOCOL),
           limit)
    for known, segments in _BUILT:
        if known == key:
            return segments
    built = _build_segments(units, limit, deadline)
    if built is not None:
        _BUILT[:] = [(key, built)] + _BUILT[:1]
    return built


def _build_segments(units: Units, limit: int, deadline: float) -> Optional[List[Segment]]:
    n = len(units)
    start = sum(units.is_input)
    lattices = _Lattices(units, limit)
    bounds = _grouped([start] + separators(units) + [n], units, lattices)
    if bounds is None:
        return None
    shared = list(units.shared.values())
    seg_of = np.zeros(n, dtype=np.int64)
    for a in range(len(bounds) - 1):
        seg_of[bounds[a]:bounds[a + 1]] = a
    live: List[List[tuple]] = [[] for _ in range(len(bounds) - 1)]
    for unit, nbytes, consumers in units.producers:
        first = 0 if units.is_input[unit] else int(seg_of[unit])
        for a in range(first, int(seg_of[max(consumers)]) + 1):
            live[a].append((unit, nbytes, consumers, None))
    for nbytes, holders, needers, blockers in units.hidden_sends:  # no unit: inside wherever a holder is
        for a in range(int(seg_of[holders[0]]), int(seg_of[needers[-1]]) + 1):
            live[a].append((None, nbytes, needers, (holders, blockers)))
    segments, base_c, base_p, pairs_of, base_plain = [], 0.0, 0.0, {}, 0.0
    base_s = np.zeros(len(shared))
    ends, starts = bridged_units(units)
    own = np.asarray(units.compute, dtype=float)
    for a in range(len(bounds) - 1):
        if past(deadline):
            return None
        lo, hi = bounds[a], bounds[a + 1]
        seg = _segment(units, list(range(lo, hi)), a == 0, hi == n, lattices, live[a], shared, base_c, base_p,
                       base_s, pairs_of, ends)
        if seg is None:
            return None
        if units.bridged:
            seg.base_span = straddling(units, lo)
            seg.start = seg.compute - (seg.member @ ends[lo:hi]) + (seg.member @ starts[lo:hi]) + seg.base_span
            seg.plain = base_plain + seg.member @ own[lo:hi]
            base_plain = seg.plain[-1]
        segments.append(seg)
        base_c, base_p, base_s = seg.compute[-1], seg.params[-1], seg.shared[-1]
    return segments


def bridged_units(units: Units) -> Tuple[np.ndarray, np.ndarray]:
    """Per unit, its compute with the ``Units.bridged`` compute at the later unit of each node (a downset
    holds the node for sure when it holds that one), and with it at the earlier (the node may lie in a
    downset that holds that one)."""
    ends = np.asarray(units.compute, dtype=float)
    starts = ends.copy()
    for seconds, before, after, _ in units.bridged:
        ends[after] += seconds
        starts[before] += seconds
    return ends, starts


def straddling(units: Units, lo: int) -> float:
    """The ``Units.bridged`` compute of nodes whose earlier unit lies before ``lo`` and later one not,
    rounded once (``math.fsum``): equal blocks give equal sums whatever order their nodes come in, so
    their segments compare equal and share the DP's rows (``ChainSolver._segment_ids``)."""
    return math.fsum(seconds for seconds, before, after, _ in units.bridged if before < lo <= after)


def _grouped(bounds: List[int], units: Units, lattices: "_Lattices", target: int = 64) -> Optional[List[int]]:
    """Fewer, larger segments: consecutive ones join while their points add up to ``target``.

    Joined segments' lattices concatenate (their points add), so nothing is
    lost; fewer segments means fewer numpy calls per DP pass, larger ones more
    stage pairs inside a segment. None if one segment alone exceeds the lattices' limit.
    """
    n = len(units)
    sizes = []
    for a in range(len(bounds) - 1):
        masks = lattices.downsets(list(range(bounds[a], bounds[a + 1])), bounds[a + 1] == n)
        if masks is None:
            return None
        sizes.append(len(masks) - 1)
    kept, run = [bounds[0]], 0
    for a, size in enumerate(sizes):
        if run and size and run + size > target:  # a segment adding no point (output only) joins its predecessor
            kept.append(bounds[a])
            run = 0
        run += size
    return kept + [n]


def _segment(units: Units, local: List[int], first: bool, last: bool, lattices: "_Lattices", live, shared,
             base_c: float, base_p: float, base_s: np.ndarray, pairs_of: Dict[tuple, tuple],
             compute_of: np.ndarray) -> Optional[Segment]:
    """One segment's points; ``pairs_of``: (sub_j, sub_i) by membership matrix, shared by the segments of
    repeated blocks (equal points give equal pairs: one copy, worked out once)."""
    masks = lattices.downsets(local, last)
    if masks is None:
        return None
    if not first and masks and masks[0] == 0:
        masks = masks[1:]  # the empty local set is the previous segment's full set (a last segment
        # without compute has no empty set: ``_Lattices.downsets`` keeps only points that leave compute)
    L = len(local)
    member = lattices.member(masks, L)
    pos = {u: k for k, u in enumerate(local)}
    compute = base_c + member @ compute_of[local[0]:local[-1] + 1]
    params = base_p + member @ np.asarray([units.param_bytes[u] for u in local], dtype=float)
    cut = np.zeros(len(masks))
    for unit, nbytes, consumers, held in live:
        if unit is None:  # a value left out like an input (``Units.hidden_sends``): with its first holder,
            # and only where every blocker is inside too
            holders, blockers = held
            if any(b > local[-1] for b in blockers):
                continue
            inside = any(c < local[0] for c in holders) | member[:, [pos[c] for c in holders if c in pos]].any(axis=1)
            inside = inside & member[:, [pos[b] for b in blockers if b in pos]].all(axis=1)
        else:
            inside = member[:, pos[unit]] if unit in pos else np.ones(len(masks), dtype=bool)
        if max(consumers) > local[-1]:  # read after this segment
            escapes = np.ones(len(masks), dtype=bool)
        else:  # consumers before the segment are inside every point
            escapes = ~member[:, [pos[c] for c in consumers if c in pos]].all(axis=1)
        cut += float(nbytes) * (inside & escapes)
    if first:
        cut[0] = 0.0  # nothing precedes the first stage
    counts = np.zeros((len(masks), len(shared)))
    for s, (_, users) in enumerate(shared):
        mine = [pos[u] for u in users if u in pos]
        counts[:, s] = base_s[s] + member[:, mine].sum(axis=1)
    pairs = user_pairs(shared)
    inside = np.zeros((len(masks), len(pairs)))  # a user before the segment is in every point, after it in none
    for k, (_, u) in enumerate(pairs):
        inside[:, k] = member[:, pos[u]] if u in pos else float(u < local[0])
    counts = np.hstack([counts, inside])
    hidden = np.zeros(len(masks))
    for seconds, forcing, _, _ in units.hidden:  # forcing: sorted
        if not forcing:  # forces nothing
            continue
        if forcing[0] < local[0]:  # forced into every point
            hidden += seconds
        elif forcing[0] <= local[-1]:
            hidden += seconds * member[:, [pos[u] for u in forcing if u in pos]].any(axis=1)
    key = (member.shape, member.tobytes())
    if key not in pairs_of:
        packed = np.packbits(member, axis=1) if L else np.zeros((len(masks), 0), dtype=np.uint8)
        sub_j, sub_i = [], []
        for i in range(len(masks)):
            js = np.nonzero(~(packed[:i] & ~packed[i]).any(axis=1))[0]
            sub_j.append(js)
            sub_i.append(np.full(js.size, i))
        cat = (lambda xs: np.concatenate(xs).astype(np.int64)) if masks else (lambda xs: np.zeros(0, dtype=np.int64))
        pairs_of[key] = (cat(sub_j), cat(sub_i))
    return Segment(local, member, compute, params, cut, counts, hidden, *pairs_of[key])


def user_pairs(shared: List[Tuple[int, List[int]]]) -> List[Tuple[int, int]]:
    """(shared weight index, user unit) for every user of every shared weight (``Units.shared``'s values),
    weight by weight: the columns after the counts in ``Segment.shared``."""
    return [(s, u) for s, (_, users) in enumerate(shared) for u in users]


class _Lattices:
    """The downsets of segments (``downsets``) and their membership matrices (``member``), each worked
    out once per shape: the segments of repeated blocks have the same local graph (96 blocks of a
    GPT profiled on an H100: 1,600 downsets a block, 2 s to enumerate them all block by block)."""

    def __init__(self, units: Units, limit: int) -> None:
        self.units, self.limit = units, limit
        self.preds = units.predecessors()
        self._downsets: Dict[tuple, Optional[List[int]]] = {}
        self._member: Dict[tuple, np.ndarray] = {}

    def downsets(self, local: List[int], last: bool) -> Optional[List[int]]:
        """Downsets of the segment (bitmasks over ``local``) by size, empty first, full last; None past
        the limit."""
        units, lo = self.units, local[0]
        inside = lambda a: lo <= a <= local[-1]  # noqa: E731 - a segment's units are consecutive
        pred = tuple(sum(1 << (a - lo) for a in self.preds[u] if inside(a)) for u in local)
        outputs = sum(1 << k for k, u in enumerate(local) if units.is_output[u]) if last else 0
        work = sum(1 << k for k, u in enumerate(local) if units.has_compute[u])
        key = (pred, outputs, work, last)
        if key not in self._downsets:
            full = (1 << len(local)) - 1
            ordered = downsets_from(list(pred), 0, outputs, self.limit)
            self._downsets[key] = None if ordered is None else \
                [t for t in ordered if t == full or not last or work & ~t]  # a stage needs compute
        return self._downsets[key]

    def member(self, masks: List[int], L: int) -> np.ndarray:
        """(points, L) bool: bit k of each mask."""
        key = (L, tuple(masks))
        if key not in self._member:
            bits = np.array([[(m >> k) & 1 for k in range(L)] for m in masks], dtype=bool)
            self._member[key] = bits.reshape(len(masks), L)
            self._member[key].flags.writeable = False
        return self._member[key]
