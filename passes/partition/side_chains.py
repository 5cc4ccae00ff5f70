"""A relaxation of wide segments that frees only the side chains that make them wide.

``wide_segments.relaxed`` makes every weightless node of a segment too wide
for its lattice cost nothing (their compute then only counts in the devices
of the prefixes that must run it, ``branches.forced_compute``). That is sound
but loose where those nodes carry much of the block: HF Phi3's attention
block (one fused query-key-value output sliced three ways, query and key each
rotating their halves side by side) has 12,041 downsets once the rotary reads
are anchored, GPT-NeoX's layer (attention and MLP side by side from one
residual) 17,401, both past ``segments.MAX_DOWNSETS``; freed whole, the
24-layer models' bound on 128 devices stayed 7.8 and 14.2 % under their
plans, while the lattice kept whole proves Phi3's plan within 0.29 % (in
passes ten times too slow for a 10-s limit).

``shrunk`` frees less: the width of a lattice comes from parallel branches,
whose downsets multiply, so it frees whole *chains* (units linked one to one,
weightless, not the segment's last unit), the one that divides the downset
count most per second of compute first, until the segment has at most
``target`` downsets. In a Phi3 block that frees two slices and one rotary
product (0.035 ms in all), then the value projection's chain of six units
(0.115 ms): 12,041 -> 6,623 -> 3,851 -> 2,451 -> 351 downsets, 0.15 ms freed
where freeing every weightless node took about 0.95 ms. Freeing any subset of the
weightless nodes is as sound as freeing all of them (a plan of the graph is a
plan of the relaxed one, no slower), so the bound holds whatever is chosen;
only its strength depends on the choice. Segments of repeated blocks have the
same local graph and choose once.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Set, Tuple

from passes.costgraph import CostGraph
from passes.partition.costmodel import CostOptions
from passes.partition.downsets import downsets_from
from passes.partition.memory_guard import past
from passes.partition.segments import folded_units
from passes.partition.wide_segments import free_nodes, relaxed, weightless, wide_runs

COUNT_CAP = 5  # lattices are counted up to this many times the limit (20,000: GPT-NeoX's 17,401 fit); a wider
# one is freed whole. The 24-layer Llama's first segment (embedding, tables, 27,228 downsets) then costs 0.09 s
# where at 8x its chains were tried, 0.9 s of the time of the bound pass that decides its 96-layer rows
MAX_UNITS = 256  # a longer segment is freed whole uncounted: HF Gemma's graph has no separator at all once
# its rotary reads are anchored (one segment of 1,517 units), and counting it to the cap took 0.5 s for nothing


def shrunk(graph: CostGraph, opts: CostOptions, limit: int, target: int,
           deadline: float = math.inf) -> Optional[Tuple[CostGraph, List[str]]]:
    """(the relaxed graph, the nodes made free) with, in every segment of more than ``limit``
    downsets, the side chains freed that bring it to ``target`` downsets (see the module docstring),
    or all its weightless nodes where none does; None where no segment is that wide, or past
    ``deadline``. Where folding leaves a segment wider than counted, ``relaxed``'s answer."""
    units, _ = folded_units(graph, opts, keep_dead=True)
    runs = wide_runs(units, limit, deadline)
    if not runs:
        return None
    preds = units.predecessors()
    chosen: Dict[tuple, Optional[Set[int]]] = {}
    freed: List[str] = []
    for run in runs:
        local = [[a - run[0] for a in preds[u] if run[0] <= a <= run[-1]] for u in run]
        names = [units.members[u] for u in run]
        key = tuple(map(tuple, local))
        if key not in chosen:
            if past(deadline):
                return None
            chosen[key] = None if len(run) > MAX_UNITS else \
                _choose(local, names, graph, limit * COUNT_CAP, target, deadline)
        picked = range(len(run) - 1) if chosen[key] is None else sorted(chosen[key])
        freed += [n for k in picked for n in names[k] if weightless(graph, n)]
    out = free_nodes(graph, freed)
    if all(keep is None for keep in chosen.values()):  # every wide segment freed whole: ``relaxed``'s answer
        return out, freed
    again, _ = folded_units(out, opts, keep_dead=True)
    still = wide_runs(again, limit, deadline)
    if still is None:
        return None
    return relaxed(graph, opts, limit, deadline) if still else (out, freed)


def _choose(local: List[List[int]], names: List[List[str]], graph: CostGraph, cap: int, target: int,
            deadline: float) -> Optional[Set[int]]:
    """The local units to free in one segment (``local[v]``: v's predecessors inside it): chains, the
    best log-shrink of the downset count per second of compute first, until at most ``target``; None
    (free every weightless unit) where the count passes ``cap`` or no chain brings it down."""
    free = [all(weightless(graph, n) for n in members) for members in names]
    cost = {tuple(chain): sum(graph.nodes[n].compute_s for k in chain for n in names[k])
            for chain in chains(local, free)}
    removed: Set[int] = set()
    size = downset_count(local, removed, cap)
    while size is not None and size > target:
        if past(deadline):
            return None
        best = None
        for chain, seconds in cost.items():
            if removed.isdisjoint(chain):
                after = downset_count(local, removed | set(chain), cap)
                if after is not None and after < size:
                    score = (math.log(size) - math.log(after)) / max(seconds, 1e-12)
                    if best is None or score > best[0]:
                        best = (score, chain, after)
        if best is None:
            return None
        removed |= set(best[1])
        size = best[2]
    return None if size is None else removed


def chains(local: List[List[int]], free: List[bool]) -> List[List[int]]:
    """Maximal chains of ``free`` units among a segment's units but its last (``local[v]``: v's
    predecessors inside the segment): each unit after the first has one predecessor, the one before it,
    which has no other successor; the first has at most one predecessor, of any kind (a unit that joins
    branches folds where its producers are, which a contraction into one of them would not say)."""
    inner = len(local) - 1
    succ: List[List[int]] = [[] for _ in local]
    for v, ps in enumerate(local):
        for a in ps:
            succ[a].append(v)

    def goes_on(u: int) -> bool:
        return len(succ[u]) == 1 and succ[u][0] < inner and len(local[succ[u][0]]) == 1 and free[succ[u][0]]

    out = []
    for u in range(inner):
        if not free[u] or len(local[u]) > 1 or (local[u] and free[local[u][0]] and goes_on(local[u][0])):
            continue  # not free, a join, or inside a chain begun at an earlier unit
        chain = [u]
        while goes_on(chain[-1]):
            chain.append(succ[chain[-1]][0])
        out.append(chain)
    return out


def downset_count(local: List[List[int]], removed: Set[int], cap: int) -> Optional[int]:
    """Downsets of the segment with the ``removed`` units contracted into their nearest kept ancestor
    (as a freed node folds into its producer); None past ``cap``."""
    keep = [v for v in range(len(local)) if v not in removed]
    index = {v: i for i, v in enumerate(keep)}

    def kept_above(a: int) -> Optional[int]:
        while a in removed:
            if not local[a]:
                return None  # fed from before the segment: nothing inside it runs first
            a = local[a][0]
        return a

    masks = []
    for v in keep:
        mask = 0
        for a in local[v]:
            b = kept_above(a)
            if b is not None:
                mask |= 1 << index[b]
        masks.append(mask)
    found = downsets_from(masks, 0, 0, cap)
    return None if found is None else len(found)
