"""Where stage replicas sit on a two-level machine, and which links they use.

A machine of K ranks is K / G nodes of G ranks (``gpus_per_node``); two ranks
in one node talk at the intra-node bandwidth B1, two in different nodes at the
inter-node bandwidth B2 (every rank has its own link at either level, as the
flat cost model already assumes for replicas).

Placement: stage j gets ranks ``[sum r_<j, sum r_<=j)``, contiguous in
pipeline order. This is the placement fxpipe's runtime uses
(``fxpipe.layout.Layout``), so a plan charged this way is the plan that runs;
and because it packs each stage's replicas into as few nodes as possible, a
replica group of at most G ranks that starts on a node boundary stays inside
one node. The exact DP searches the stage order and sizes, hence the offsets.

Microbatch m runs on replica ``m mod r_j`` of stage j (round robin), so over
``L = lcm(r_j, r_j+1)`` microbatches the pair (replica a of j, replica b of
j+1) carries one microbatch for every m < L with ``m mod r_j = a`` and
``m mod r_j+1 = b``. A link's load per microbatch is the sum over the pairs
a rank takes part in of ``count / (L · bandwidth of that pair)``; the cut's
time is that of its most loaded rank (``pair_load``). With one bandwidth this
is ``1 / (B · min(r_j, r_j+1))``, the flat model's charge.

This module is plain rank arithmetic; the cost model (``costmodel.py``) turns
it into seconds.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np


def offsets(replicas: Sequence[int]) -> List[int]:
    """First rank of every stage under the contiguous placement."""
    out, start = [], 0
    for r in replicas:
        out.append(start)
        start += int(r)
    return out


def stage_ranks(replicas: Sequence[int]) -> List[List[int]]:
    return [list(range(o, o + int(r))) for o, r in zip(offsets(replicas), replicas)]


def node_of(rank: int, gpus_per_node: Optional[int]) -> int:
    """The node a rank is on (0 for everyone on a flat machine)."""
    return 0 if not gpus_per_node else rank // gpus_per_node


def node_counts(ranks: Sequence[int], gpus_per_node: Optional[int]) -> List[int]:
    """How many of ``ranks`` each node they touch holds, in node order."""
    counts: Dict[int, int] = {}
    for rank in ranks:
        node = node_of(rank, gpus_per_node)
        counts[node] = counts.get(node, 0) + 1
    return [counts[n] for n in sorted(counts)]


def span(first: int, r: int) -> range:
    """The ranks of a stage of ``r`` replicas starting at ``first`` (contiguous placement)."""
    return range(first, first + r)


def span_nodes(first, r, gpus_per_node: int):
    """(nodes touched, ranks in the fullest of them) of ``span(first, r)``, elementwise on arrays:
    the first node holds G - first mod G of them (or all r), every middle node G, the last the rest."""
    G = int(gpus_per_node)
    first, r = np.asarray(first, dtype=np.int64), np.asarray(r, dtype=np.int64)
    m = first % G
    n = (m + r + G - 1) // G
    c = np.where(n <= 1, r, np.where(n == 2, np.maximum(G - m, m + r - G), G))
    return n, c


def span_load(first: int, r_before: int, r_after: int, gpus_per_node: int, intra: float, inter: float) -> float:
    """``pair_load`` for stages on ``span(first, r_before)`` and the ranks right after it, in
    O(r_before + r_after) instead of a pair matrix (the placed DP tabulates it for every pair of
    counts up to K, ``offsets.cut_load_table``).

    Replica a of the first stage talks with replica b of the second iff
    ``a = b (mod g)``, ``g = gcd``, each pair carrying ``1/L`` of the
    microbatches; so a rank's load is ``(same/B1 + other/B2) / L`` over its
    partners, and counting the partners of each residue class per node
    gives every rank's ``same`` at once."""
    G = int(gpus_per_node)
    g = math.gcd(r_before, r_after)
    period = r_before * r_after // g
    a, b = np.arange(r_before), np.arange(r_after)
    node_a, node_b = (first + a) // G, (first + r_before + b) // G
    low = int(node_a[0])
    width = int(node_b[-1]) - low + 1
    count_a, count_b = np.zeros((g, width)), np.zeros((g, width))
    np.add.at(count_a, (a % g, node_a - low), 1.0)
    np.add.at(count_b, (b % g, node_b - low), 1.0)

    def busiest(idx, nodes, partners, total):
        same = partners[idx % g, nodes - low]
        return float(((same / intra + (total - same) / inter) / period).max())

    return max(busiest(a, node_a, count_b, r_after // g), busiest(b, node_b, count_a, r_before // g))


def pair_load(before: Sequence[int], after: Sequence[int], gpus_per_node: Optional[int],
              intra: float, inter: float) -> float:
    """Seconds per byte per microbatch on the most loaded rank of a cut (see the module docstring).

    ``before[a]`` is the rank of replica a of the stage before the cut. Over
    one period ``L = lcm(r_before, r_after)`` round robin pairs replica a with
    replica b exactly once when ``a = b (mod gcd)`` and never otherwise (the
    Chinese remainder theorem), so each pair carries ``1/L`` of the microbatches.
    """
    rb, ra = len(before), len(after)
    a = np.arange(rb)[:, None]
    b = np.arange(ra)[None, :]
    talks = (a - b) % math.gcd(rb, ra) == 0
    src = np.asarray([node_of(x, gpus_per_node) for x in before])[:, None]
    dst = np.asarray([node_of(x, gpus_per_node) for x in after])[None, :]
    per = np.where(talks, 1.0 / np.where(src == dst, intra, inter), 0.0) / math.lcm(rb, ra)
    return float(max(per.sum(axis=1).max(), per.sum(axis=0).max()))
