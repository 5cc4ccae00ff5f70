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


def pair_load(before: Sequence[int], after: Sequence[int], gpus_per_node: Optional[int],
              intra: float, inter: float) -> float:
    """Seconds per byte per microbatch on the most loaded rank of a cut (see the module docstring).

    ``before[a]`` is the rank of replica a of the stage before the cut. Over
    one period ``L = lcm(r_before, r_after)`` round robin pairs replica a with
    replica b exactly once when ``a = b (mod gcd)`` and never otherwise (the
    Chinese remainder theorem), so each pair carries ``1/L`` of the microbatches,
    and a rank's load is ``(same/B1 + other/B2) / L`` over its partners.
    Counting each side's replicas per residue class and node gives every
    rank's ``same`` at once, in O(r_before + r_after): the placed DP tabulates
    this for every pair of counts up to K (``offsets.cut_load_table``).
    """
    rb, ra = len(before), len(after)
    g = math.gcd(rb, ra)
    period = rb * ra // g
    G = gpus_per_node or max(max(before), max(after)) + 1  # a flat machine: one node
    node_a, node_b = np.asarray(before) // G, np.asarray(after) // G
    low = int(min(node_a.min(), node_b.min()))
    width = int(max(node_a.max(), node_b.max())) - low + 1
    idx_a, idx_b = np.arange(rb) % g, np.arange(ra) % g
    count_a, count_b = np.zeros((g, width)), np.zeros((g, width))
    np.add.at(count_a, (idx_a, node_a - low), 1.0)
    np.add.at(count_b, (idx_b, node_b - low), 1.0)

    def busiest(idx, nodes, partners, total):
        same = partners[idx, nodes - low]
        return float(((same / intra + (total - same) / inter) / period).max())

    return max(busiest(idx_a, node_a, count_b, ra // g), busiest(idx_b, node_b, count_a, rb // g))
