"""Shape reads of one unit chained in the order they are needed: a tighter relaxation of folded reads.

The placed DPs fold every node that sends nothing (``segment_plan.QUIET_PLACED``) and charge its
compute to each stage that holds a unit before it and one after it (``Units.bridged``); the reads a
cut separates from their readers are charged nowhere. On a GPU profile, where a shape read costs a
kernel launch, that is most of a block's reads (the benchmark GPT profiled on an H100: nine reads of
4.6-8.3 us behind each block's first layer norm, 52 us a block), and the DPs put their cuts right
behind that layer norm: their relaxed plans ran 5-16 % over their T once the reads ran somewhere, and
no pass could prove the plan in hand.

Here the reads bridged from one unit B whose readers lie on one line of descent become units of their
own, in the order they are needed, each after the one before (``B -> r1 -> ... -> rn``, every read
still before its readers), with no compute of their own: read k's compute is bridged between
``r(k-1)`` and ``rk`` (``r0 = B``). A stage holding both is charged it; a cut between them gives it up.
So a cut gives up at most one read of a chain instead of every read it separates, and a plan runs each
read in its own unit's stage, as the DP counted it.

Why this is still a bound (a relaxation of every plan): let the reads be fluid, each run anywhere
between B's stage and the stage of its first reader. Every read of the chain has its ancestors at B or
before it (or in the chain), so the windows share their first stage; each read's readers descend from
the readers of the read before it, so the windows' last stages do not decrease along the chain. Any
fluid placement can then swap equal amounts between reads until the reads fill the stages in chain
order with the same load on every stage, and read k still ends within its window, since reads 1..k all
fit before its end. Put unit ``rk`` in the stage where read k ends: the units keep their order and every
edge, and every stage is charged the reads wholly inside it, no more than it runs. Reads that break a
condition stay bridged as they are.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

from passes.costgraph import CostGraph
from passes.partition.coarsen import Units, build_units
from passes.partition.costmodel import CostOptions

MIN_CHAIN = 2  # reads of one unit worth chaining: a single read gains nothing (one read per cut either way)


def chain_reads(graph: CostGraph, opts: CostOptions, units: Units, folded: List[float],
                read_nodes: Sequence[str], order: Dict[str, int], min_gain: float = 0.0) -> Tuple[Units, List[float]]:
    """``units`` with the reads bridged from one unit chained (see the module docstring), and ``folded``
    (``segments.folded_units``' folded compute per unit, 0 for a read's unit). ``read_nodes``: the node
    of each ``units.bridged`` entry; ``order``: every node's position in the graph; ``min_gain``: a
    chain is made only where it can give a cut more to charge than this (its reads' compute less the
    largest read's): each chain's units make the DP's lattice larger, and a CPU profile's reads
    (2-4 us a block) gained nothing but slower passes. The units are returned unchanged where no chain
    qualifies."""
    unit_of = units.unit_of()
    anc = _ancestors(units)
    preds: Dict[str, List[str]] = {n: [] for n in unit_of}
    succs: Dict[str, List[str]] = {n: [] for n in unit_of}
    for u, v in graph.edges:
        if u in unit_of and v in unit_of:
            preds[v].append(u)
            succs[u].append(v)
    groups: Dict[int, List[int]] = {}
    for k, (_, before, _, _) in enumerate(units.bridged):
        groups.setdefault(before, []).append(k)
    chains: List[Tuple[int, List[int]]] = []  # (B, bridged entries in chain order)
    for before, ks in sorted(groups.items()):
        if len(ks) < MIN_CHAIN:
            continue
        ks.sort(key=lambda k: (units.bridged[k][2], order[read_nodes[k]]))
        kept = _chain(before, ks, units, anc, unit_of, preds, succs, read_nodes)
        seconds = [units.bridged[k][0] for k in kept]
        if len(kept) >= MIN_CHAIN and sum(seconds) - max(seconds) > min_gain:
            chains.append((before, kept))
    if not chains:
        return units, folded
    return _rebuilt(graph, opts, units, folded, read_nodes, chains)


def _ancestors(units: Units) -> List[int]:
    """Per unit, the bitmask of its ancestors (units are in topological order)."""
    preds: List[List[int]] = [[] for _ in range(len(units))]
    for a, b in units.edges:
        preds[b].append(a)
    anc = [0] * len(units)
    for u in range(len(units)):
        for p in preds[u]:
            anc[u] |= anc[p] | (1 << p)
    return anc


def _chain(before: int, ks: List[int], units: Units, anc: List[int], unit_of: Dict[str, int],
           preds: Dict[str, List[str]], succs: Dict[str, List[str]], read_nodes: Sequence[str]) -> List[int]:
    """The entries of ``ks`` (sorted by first reader) that form a chain: each read's producers are at B,
    before it or earlier in the chain; it has readers that are units of their own (not folded nodes),
    each descending from (or being) a reader of the read kept before it, so windows end in chain order;
    its other readers are later reads of the chain. A read kept that feeds a read left out is left out
    too (that one stays in its folded unit, before it), until nothing changes."""
    within = lambda a, b: a == b or (anc[a] >> b) & 1  # noqa: E731 - unit a descends from (or is) b
    names = {read_nodes[k]: k for k in ks}
    dropped: Set[int] = set()
    while True:
        kept, seen, last = [], set(), None
        for k in ks:
            n = read_nodes[k]
            if k in dropped or not all(p in seen or within(before, unit_of[p]) for p in preds[n]):
                continue
            outside = [c for c in succs[n] if c not in names]
            readers = [unit_of[c] for c in outside]
            if not readers or any(units.members[unit_of[c]][0] != c for c in outside):
                continue  # no reader of its own, or one folded into another unit
            if last is not None and not all(any(within(r, q) for q in last) for r in readers):
                continue
            kept.append(k)
            seen.add(n)
            last = readers
        left = {names[c] for k in kept for c in succs[read_nodes[k]] if c in names and names[c] not in kept}
        if not left:
            return kept
        dropped |= {k for k in kept if any(c in names and names[c] in left for c in succs[read_nodes[k]])}


def _rebuilt(graph: CostGraph, opts: CostOptions, units: Units, folded: List[float], read_nodes: Sequence[str],
             chains: List[Tuple[int, List[int]]]) -> Tuple[Units, List[float]]:
    """The units regrouped: each chained read in a unit of its own just before its first reader."""
    moved = {read_nodes[k]: k for _, ks in chains for k in ks}
    ahead: Dict[int, List[int]] = {}  # unit -> chained entries placed just before it, in chain order
    for _, ks in chains:
        for k in ks:
            ahead.setdefault(units.bridged[k][2], []).append(k)
    groups: List[List[str]] = []
    old: List[int] = []  # old unit per new one, -1 for a read's
    new_of: Dict[int, int] = {}
    read_unit: Dict[int, int] = {}
    for u, members in enumerate(units.members):
        for k in ahead.get(u, []):
            read_unit[k] = len(groups)
            groups.append([read_nodes[k]])
            old.append(-1)
        new_of[u] = len(groups)
        groups.append([m for m in members if m not in moved])
        old.append(u)
    out = build_units(graph, opts, groups)
    where = out.unit_of()
    if any(where[u] > where[v] for u, v in graph.edges if u in where and v in where):
        return units, folded  # not in topological order: leave the reads as they were
    out.compute = [units.compute[o] if o >= 0 else 0.0 for o in old]  # folded and dropped compute as before
    out.hidden = [(s, [new_of[u] for u in forcing], new_of[home] if home >= 0 else -1)
                  for s, forcing, home in units.hidden]
    out.hidden_sends = [(nbytes, [new_of[u] for u in readers]) for nbytes, readers in units.hidden_sends]
    out.bridged = [(s, new_of[b], new_of[a], new_of[h]) for k, (s, b, a, h) in enumerate(units.bridged)
                   if read_nodes[k] not in moved]
    edges = set(out.edges)
    for before, ks in chains:
        prev = new_of[before]
        for k in ks:
            here = read_unit[k]
            out.bridged.append((units.bridged[k][0], prev, here, here))
            edges.add((prev, here))
            prev = here
    out.edges = sorted(edges)
    return out, [folded[o] if o >= 0 else 0.0 for o in old]
