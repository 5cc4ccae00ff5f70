"""The values a relaxation made silent that every plan still sends: charged again where a cut must carry them.

The bound's relaxations (``anchors.relaxed``, ``branches.relaxed``,
``wide_segments.relaxed``, ``side_chains.shrunk``) make nodes free *and
silent*: they cost nothing and send nothing. A freed node with no placed
producer (the rotary tables' slices, an attention mask: computed from the
inputs alone) then belongs to no unit, and the relaxed DP charged its value at
no cut. Every plan of the real graph sends it over each cut between the
readers it feeds: on the 24-layer HF Mistral, cos, sin and the mask (24 KB) at
every cut between layers, about 39 us of a 0.51-ms stage on 128 devices at
10 Gbit/s, and the bound's best plans cut where that is the difference.

``freed_sends`` gives each such node n back its bytes as a
``Units.hidden_sends`` entry, sent on wherever a prefix holds one of its
*holders* and misses one of its *needers*. Its readers are the nodes that read
n, and those that read an anchored exit (``anchors.py``) reading n; the needers
are the units holding a reader, the holders the units whose first node is a
reader or the first such node below one. That keeps the bound sound. Take
any plan P of the real graph; the relaxed DP sees it with every unit in its
first node's stage, and a node folded into a unit descends from that first
node (``segments._fold_target`` joins a producer's group). Where a cut c has a
holder before it and a needer after it in that view:

* the holder's first node lies before c in P and descends from n, so n lies
  before c too;
* the needer's first node lies after c, so its reader r does. If r reads n,
  n's value crosses c. If r reads an exit e of n and e lies before c, e's value
  crosses, which is at least n's: ``anchors.exits`` keeps only exits whose
  placed producers send no more than they do. If e lies after c, n's value
  crosses.

That value is n's own or a silent exit's (the relaxation charges it nowhere
else), and an exit's bytes cover all the producers it reads, so the entries
together never charge a cut more than P sends over it.

``chain_sends`` does the same for the chains freed inside a block (GPT-NeoX's
query, key and value slices, freed by ``side_chains.shrunk`` to keep its
lattice small): they fold into their producer's unit and send nothing, so a
cut between that producer and the chains' readers looked free. Every plan sends
the producer's value or one on each chain there; the entries claim at most
that (see its docstring). On GPT-NeoX at 128 and 256 devices the bound went
from 7.0 % under the plan to 4.3 and 3.4 %.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from passes.costgraph import CostGraph
from passes.partition.branches import placed_below
from passes.partition.coarsen import Units, model_nodes
from passes.partition.costmodel import CostOptions


class Lookups(NamedTuple):
    """What both functions read of ``units`` and ``relaxed``, built once for the pair (``lookups``): on
    the 96-layer Llama each map takes some milliseconds."""

    unit_of: Dict[str, int]  # node -> its unit
    heads: Dict[str, int]  # a unit's first node -> the unit
    succ: Dict[str, List[str]]
    pred: Dict[str, List[str]]


def lookups(relaxed: CostGraph, units: Units) -> Lookups:
    """``Lookups`` of ``units`` on ``relaxed``, for ``freed_sends`` and ``chain_sends`` to share."""
    return Lookups(units.unit_of(), {members[0]: u for u, members in enumerate(units.members)},
                   relaxed.successors(), relaxed.predecessors())


def freed_sends(graph: CostGraph, relaxed: CostGraph, units: Units, exits: Sequence[str],
                opts: CostOptions, seen: Optional[Lookups] = None) -> List[Tuple[int, List[int], List[int], List[int]]]:
    """``Units.hidden_sends`` entries for ``units`` of ``relaxed``: the nodes of ``graph`` a relaxation
    made silent that sit in no unit, each with its bytes in ``graph``, its holders and its needers (see
    the module docstring); only those with a holder and a needer that differ (else no cut sends it).
    ``seen``: ``lookups(relaxed, units)``, where the caller has it."""
    unit_of, heads, succ, _ = seen or lookups(relaxed, units)
    is_exit = set(exits)
    out: List[Tuple[int, List[int], List[int], List[int]]] = []
    for n in model_nodes(relaxed, opts):
        node = relaxed.nodes[n]
        nbytes = graph.nodes[n].out_bytes if n in graph.nodes else 0
        if n in unit_of or node.is_input or node.out_bytes > 0 or nbytes <= 0:
            continue
        readers = [r for r in succ[n] if r not in is_exit]
        readers += [r for e in succ[n] if e in is_exit for r in succ[e]]
        needers = sorted({unit_of[r] for r in readers if r in unit_of})
        holders = sorted({u for r in readers for u in placed_below(r, heads, succ)})
        if needers and holders and (len(needers) > 1 or holders != needers):
            out.append((nbytes, holders, needers, []))
    return out


def chain_sends(graph: CostGraph, relaxed: CostGraph, units: Units, freed: Sequence[str], exits: Sequence[str],
                seen: Optional[Lookups] = None) -> List[Tuple[int, List[int], List[int], List[int]]]:
    """``Units.hidden_sends`` entries for ``units`` of ``relaxed`` for the chains a relaxation of ``graph``
    freed inside a segment (``side_chains.shrunk``, ``wide_segments.relaxed``: weightless nodes made free
    and silent, folded into their producer's unit).

    A freed node whose producers are one node p, or one freed node that is, is on a *branch* of p: the
    freed nodes below p's successor ``top``, each of one producer, form a tree. An anchored exit read
    beside it does not count as a producer (Phi3's rotary products read one): the path from p is there
    whatever the exit does, and the exit's value is not the branch's. Every plan sends, over a cut with
    p before it and a reader of the branch (a node not freed) after it, p's value or a value in the
    branch of at least the branch's least bytes on the paths to its readers, m. One entry per
    branch, of min(m, B * m / M) bytes (B: p's bytes, M: the sum of p's branches' m), so that the
    entries of p's branches together never claim more than p's value or the branches' own values, one
    each; holders the units whose first node is p or the first such node below it; needers the units
    holding the branch's readers; blockers the units reading p's own value, which p's own entry
    (``Units.producers``) charges: the entries count only where it is not, so p's value is claimed
    once. A branch's values are silent (no other entry claims them). Branches through an anchored
    exit, or off a node an exit reads, are left out (``freed_sends`` claims the exits' values and
    the values they read). ``seen``: as ``freed_sends``'s."""
    unit_of, heads, succ, pred = seen or lookups(relaxed, units)
    free, is_exit = set(freed), set(exits)

    def feeds(n: str) -> List[str]:  # a node's producers but anchored exits (a branch node may read one)
        return [q for q in pred[n] if q not in is_exit]

    branches: Dict[str, Dict[str, list]] = {}  # p -> top -> [least bytes, needer units]
    for f in freed:
        readers = [v for v in succ[f] if v not in free and v in unit_of and v not in is_exit]
        if not readers or f in is_exit:
            continue
        top, nbytes, above = f, graph.nodes[f].out_bytes, feeds(f)
        while len(above) == 1 and above[0] in free:
            top, above = above[0], feeds(above[0])
            nbytes = min(nbytes, graph.nodes[top].out_bytes)
        if len(above) != 1:
            continue
        p = above[0]
        if p not in unit_of or relaxed.nodes[p].is_input or any(w in is_exit for w in succ[p]):
            # (a model input's value may cost nothing to send, fxpipe's model: ``costmodel.counts_comm``)
            continue
        entry = branches.setdefault(p, {}).setdefault(top, [nbytes, set()])
        entry[0] = min(entry[0], nbytes)
        entry[1].update(unit_of[v] for v in readers)
    out: List[Tuple[int, List[int], List[int], List[int]]] = []
    for p, tops in branches.items():
        whole, total = graph.nodes[p].out_bytes, sum(m for m, _ in tops.values())
        holders = sorted(placed_below(p, heads, succ))
        blockers = sorted({unit_of[w] for w in succ[p] if w in unit_of} - {unit_of[p]})
        for m, needed in tops.values():
            nbytes = min(m, whole * m // total) if total > 0 else 0
            needers = sorted(needed)
            if nbytes > 0 and holders and (len(needers) > 1 or holders != needers):
                out.append((nbytes, holders, needers, blockers))
    return out
