"""Shape reads of one unit chained in the order they are needed: a tighter relaxation of folded reads.

The placed DPs fold every node that sends nothing (``segment_plan.QUIET_PLACED``) and charge its
compute to each stage that holds a unit before it and one after it (``Units.bridged``); the reads a
cut separates from their readers are charged nowhere. On a GPU profile, where a shape read costs a
kernel launch, that is most of a block's reads (the benchmark GPT profiled on an H100: nine reads of
4.6-8.3 us behind each block's first layer norm, 52 us a block), and the DPs put their cuts right
behind that layer norm: their relaxed plans ran 5-16 % over their T once the reads ran somewhere, and
no pass could prove the plan in hand.

Here the reads bridged from one unit B whose windows end in one order in every plan become units of
their own, in that order, each after the one before (``B -> r1 -> ... -> rn``, every read still before
its readers), with no compute of their own: read k's compute is bridged between ``r(k-1)`` and ``rk``
(``r0 = B``). A stage holding both is charged it; a cut between them gives it up. So a cut gives up
at most one read of a chain instead of every read it separates, and a plan runs each read in its own
unit's stage, as the DP counted it. A read's window ends where the first of its ends runs: its
readers that are units of their own and, through the reads of B it feeds, theirs (the block's shape
ends where the q/k/v split runs, the scale's head size where its square root's reader runs). A read
that reads the read before it and whose window ends with that one's shares its unit (a link):
fewer units, a smaller lattice. Seven of the GPT block's nine reads chain, in five links; the head
sizes of the k and v views (beside q's, so not in one order with it) read the chained width and
cannot stay in B's unit: each moves into its view's unit, its compute still bridged from B.

Why this is still a bound (a relaxation of every plan): let the reads be fluid, each run anywhere
between B's stage and the stage of its first end. Every read of the chain has its ancestors at B or
before it (or in the chain), so the windows share their first stage; each read's ends descend from
the ends of the read before it, so the windows' last stages do not decrease along the chain. Any
fluid placement can then swap equal amounts between reads until the reads fill the stages in chain
order with the same load on every stage, and read k still ends within its window, since reads 1..k all
fit before its end (a link's reads share a window: one fluid read). Put unit ``rk`` in the stage where
read k ends: the units keep their order and every edge (a read moved into its reader's unit is one of
its producer's ends), and every stage is charged the reads wholly inside it, no more than it runs.
A moved read is charged where B and its new unit share a stage, as before: every plan runs it there.
Reads that break a condition stay bridged as they are.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

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
    chains: List[Tuple[int, List[List[int]], Dict[int, int]]] = []  # (B, links in chain order, entries moved)
    for before, ks in sorted(groups.items()):
        if len(ks) < MIN_CHAIN:
            continue
        ks.sort(key=lambda k: (units.bridged[k][2], order[read_nodes[k]]))
        links, moved = _chain(before, ks, units, anc, unit_of, preds, succs, read_nodes)
        seconds = [sum(units.bridged[k][0] for k in link) for link in links]
        if len(links) >= MIN_CHAIN and sum(seconds) - max(seconds) > min_gain:
            chains.append((before, links, moved))
    if not chains:
        return units, folded
    return _rebuilt(graph, opts, units, folded, read_nodes, chains)


def _ancestors(units: Units) -> List[int]:
    """Per unit, the bitmask of its ancestors (units are in topological order)."""
    preds = units.predecessors()
    anc = [0] * len(units)
    for u in range(len(units)):
        for p in preds[u]:
            anc[u] |= anc[p] | (1 << p)
    return anc


def _chain(before: int, ks: List[int], units: Units, anc: List[int], unit_of: Dict[str, int],
           preds: Dict[str, List[str]], succs: Dict[str, List[str]],
           read_nodes: Sequence[str]) -> Tuple[List[int], Dict[int, int]]:
    """The entries of ``ks`` (sorted by first reader) that form a chain, and the reads left out that
    must move to a reader's unit (entry -> unit). A read's window ends where the first of its ends
    runs: its readers that are units of their own (not folded nodes) and, through the reads of B it
    feeds, theirs (``_ends``). A read joins when its producers are at B, before it or earlier in the
    chain, and each of its ends descends from (or is) an end of the read kept before it, so windows
    end in chain order. A read left out that reads a kept one cannot stay in B's unit (it would run
    before its producer): it moves into the unit of its reader when its readers are units of their own,
    one of which every other descends from (that unit's stage runs it in every plan of the units, and
    its compute stays bridged from B as before); otherwise the kept reads it reads are left out too,
    until nothing changes."""
    within = lambda a, b: a == b or (anc[a] >> b) & 1  # noqa: E731 - unit a descends from (or is) b
    names = {read_nodes[k]: k for k in ks}
    ends = _ends(names, units, unit_of, succs)
    dropped: Set[int] = set()
    while True:
        kept, seen, last = [], set(), None
        for k in ks:
            n = read_nodes[k]
            if k in dropped or ends[n] is None or \
                    not all(p in seen or within(before, unit_of[p]) for p in preds[n]):
                continue
            if last is not None and not all(any(within(r, q) for q in last) for r in ends[n]):
                continue
            kept.append(k)
            seen.add(n)
            last = ends[n]
        moved: Dict[int, int] = {}
        stuck: Set[str] = set()
        for n, k in names.items():
            if k in kept or not any(p in seen for p in preds[n]):
                continue
            home = _reader_unit(n, names, unit_of, units, succs, within)
            if home is None:
                stuck.add(n)
            else:
                moved[k] = home
        if not stuck:
            return _links(kept, ends, preds, read_nodes, within), moved
        dropped |= {k for k in kept if any(c in stuck for c in succs[read_nodes[k]])}


def _links(kept: List[int], ends: Dict[str, Optional[List[int]]], preds: Dict[str, List[str]],
           read_nodes: Sequence[str], within) -> List[List[int]]:
    """The chain's reads in links: a read joins the link before it when it reads that link's last read
    and their windows end together in every plan (each one's ends descend from the other's). One
    unit per link keeps the lattice small (a unit per read, the shape apart from its width and the
    scale's head size apart from its square root, made the lattice of 8 H100-profiled blocks 32 %
    larger and cost more in time than it gave); a link's reads act as one fluid read, so the bound
    holds."""
    same = lambda a, b: all(any(within(x, y) for y in b) for x in a)  # noqa: E731
    links: List[List[int]] = []
    for k in kept:
        n = read_nodes[k]
        if links:
            m = read_nodes[links[-1][-1]]
            if m in preds[n] and same(ends[n], ends[m]) and same(ends[m], ends[n]):
                links[-1].append(k)
                continue
        links.append([k])
    return links


def _ends(names: Dict[str, int], units: Units, unit_of: Dict[str, int],
          succs: Dict[str, List[str]]) -> Dict[str, Optional[List[int]]]:
    """Per read of B, the units that end its window: its readers outside B's reads (each must be the
    first node of its unit) and the ends of the reads of B it feeds; None where a reader is folded
    into another unit or the read has no reader at all."""
    out: Dict[str, Optional[List[int]]] = {}

    def visit(n: str) -> Optional[List[int]]:
        if n not in out:
            found: Set[int] = set()
            ok = bool(succs[n])
            for c in succs[n]:
                if c in names:
                    sub = visit(c)
                    ok = ok and sub is not None
                    found.update(sub or ())
                elif units.members[unit_of[c]][0] == c:
                    found.add(unit_of[c])
                else:
                    ok = False
            out[n] = sorted(found) if ok and found else None
        return out[n]

    for n in names:
        visit(n)
    return out


def _reader_unit(n: str, names: Dict[str, int], unit_of: Dict[str, int], units: Units,
                 succs: Dict[str, List[str]], within) -> Optional[int]:
    """The unit a read left out of the chain can join: its readers are units of their own and every
    one descends from the first of them; None otherwise."""
    if not succs[n] or any(c in names or units.members[unit_of[c]][0] != c for c in succs[n]):
        return None
    readers = sorted({unit_of[c] for c in succs[n]})
    return readers[0] if all(within(r, readers[0]) for r in readers) else None


def _rebuilt(graph: CostGraph, opts: CostOptions, units: Units, folded: List[float], read_nodes: Sequence[str],
             chains: List[Tuple[int, List[List[int]], Dict[int, int]]]) -> Tuple[Units, List[float]]:
    """The units regrouped: each link of a chain in a unit of its own just before its first reader,
    each read moved to a reader's unit just after that unit's first node."""
    moved = {read_nodes[k]: k for _, links, _ in chains for link in links for k in link}
    joins: Dict[int, List[str]] = {}  # unit -> reads moved into it
    home_of: Dict[int, int] = {}  # entry moved -> its new unit (old numbering)
    for _, _, to in chains:
        for k, u in to.items():
            moved[read_nodes[k]] = k
            joins.setdefault(u, []).append(read_nodes[k])
            home_of[k] = u
    ahead: Dict[int, List[List[int]]] = {}  # unit -> links placed just before it, in chain order
    for _, links, _ in chains:
        for link in links:
            ahead.setdefault(min(units.bridged[k][2] for k in link), []).append(link)
    groups: List[List[str]] = []
    old: List[int] = []  # old unit per new one, -1 for a read's
    new_of: Dict[int, int] = {}
    read_unit: Dict[int, int] = {}
    for u, members in enumerate(units.members):
        for link in ahead.get(u, []):
            read_unit.update((k, len(groups)) for k in link)
            groups.append([read_nodes[k] for k in link])
            old.append(-1)
        new_of[u] = len(groups)
        kept = [m for m in members if m not in moved]
        groups.append(kept[:1] + joins.get(u, []) + kept[1:])
        old.append(u)
    out = build_units(graph, opts, groups)
    where = out.unit_of()
    if any(where[u] > where[v] for u, v in graph.edges if u in where and v in where):
        return units, folded  # not in topological order: leave the reads as they were
    out.compute = [units.compute[o] if o >= 0 else 0.0 for o in old]  # folded and dropped compute as before
    out.hidden = [(s, [new_of[u] for u in forcing], new_of[home] if home >= 0 else -1, [new_of[u] for u in after])
                  for s, forcing, home, after in units.hidden]
    out.hidden_sends = [(nbytes, [new_of[u] for u in holders], [new_of[u] for u in needers],
                         [new_of[u] for u in blockers]) for nbytes, holders, needers, blockers in units.hidden_sends]
    chained = {k for _, links, _ in chains for link in links for k in link}
    out.bridged = [(s, new_of[b], new_of[a], new_of[home_of.get(k, h)])
                   for k, (s, b, a, h) in enumerate(units.bridged) if k not in chained]
    edges = set(out.edges)
    for before, links, _ in chains:
        prev = new_of[before]
        for link in links:
            here = read_unit[link[0]]
            out.bridged.extend((units.bridged[k][0], prev, here, here) for k in link)
            edges.add((prev, here))
            prev = here
    out.edges = sorted(edges)
    return out, [folded[o] if o >= 0 else 0.0 for o in old]
