"""The graph part of the view: nodes, edges and the module groups they collapse into.

Large graphs (PipeDream's NASNet has 1,251 nodes) are unreadable node by
node, so nodes are grouped and a group draws as one box until expanded.
Groups never straddle a stage, so the collapsed picture still shows the cut:

- with module paths (fxpipe profiles): the module path cut at the deepest
  depth that still gives at most ``max_groups`` groups;
- without (PipeDream profiles): consecutive runs of the stage's nodes in the
  graph's topological order. Edges only go forward in that order, so the
  collapsed graph stays acyclic and the layered layout stays meaningful.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Dict, List, Mapping, Optional, Tuple

from passes.costgraph import CostGraph

COLLAPSE_ABOVE = 150  # nodes; smaller graphs open fully expanded


def graph_payload(graph: CostGraph, stage_of: Mapping[str, int], max_groups: Optional[int] = None) -> dict:
    """JSON-ready graph for the HTML view (indices, not names, to keep it small)."""
    names = list(graph.nodes)
    if max_groups is None:  # enough boxes to see the structure, few enough to read: ~2·sqrt(n), 8..80
        max_groups = max(8, min(80, int(2 * math.sqrt(len(names)))))
    index = {n: i for i, n in enumerate(names)}
    stages = [int(stage_of.get(n, -1)) for n in names]
    keys = _group_keys(graph, stages, max_groups)
    groups: Dict[Tuple, List[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    group_of = [0] * len(names)
    group_list = []
    for gid, (key, members) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
        for i in members:
            group_of[i] = gid
        label, span = _group_label(graph, names, key, members)
        group_list.append({"label": label, "span": span, "stage": stages[members[0]], "members": members})
    nodes = []
    for i, n in enumerate(names):
        c = graph.nodes[n]
        nodes.append({"name": n, "op": c.op, "target": c.target[:80], "module": c.module_path,
                      "stage": stages[i], "fwd": c.fwd_s, "bwd": c.bwd_s, "out": c.out_bytes,
                      "params": c.param_bytes, "input": c.is_input, "group": group_of[i]})
    edges = [[index[u], index[v]] for u, v in graph.edges if u in index and v in index]
    return {"nodes": nodes, "edges": edges, "groups": group_list,
            "collapsed": len(names) > COLLAPSE_ABOVE and len(group_list) < len(names)}


def _group_keys(graph: CostGraph, stages: List[int], max_groups: int) -> List[Tuple]:
    paths = [c.module_path for c in graph.nodes.values()]
    if sum(1 for p in paths if p) >= 0.5 * len(paths):
        depth_max = max((p.count(".") + 1 for p in paths if p), default=1)
        best = None
        for depth in range(1, depth_max + 1):
            keys = [(s, "m", ".".join(p.split(".")[:depth]) if p else "") for s, p in zip(stages, paths)]
            if best is None or len(set(keys)) <= max_groups:
                best = keys
            if len(set(keys)) > max_groups:
                break
        return best or []
    per_stage = Counter(stages)
    size = {s: max(1, math.ceil(n / max(1, round(max_groups * n / len(stages))))) for s, n in per_stage.items()}
    seen: Counter = Counter()
    keys = []
    for s in stages:
        keys.append((s, "run", seen[s] // size[s]))
        seen[s] += 1
    return keys


def _group_label(graph: CostGraph, names: List[str], key: Tuple, members: List[int]) -> Tuple[str, str]:
    """A short label (what the group is) and the span of node names it covers."""
    first, last = names[members[0]], names[members[-1]]
    span = first if len(members) == 1 else f"{first} … {last}"
    if key[1] == "m" and key[2]:
        return f"{key[2]} ({len(members)})", span
    if len(members) == 1:
        return first, span
    kinds = Counter(graph.nodes[names[i]].target.split("(")[0] for i in members)
    top = " ".join(f"{k}×{v}" for k, v in kinds.most_common(2))
    where = "top level " if key[1] == "m" else ""
    return f"{where}{len(members)}: {top}", span
