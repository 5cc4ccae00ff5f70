"""Benchmark: the planner at cluster scale (deep GPTs, K up to 1024) against the hand-made Megatron layout.

Graphs: examples/gpt.py (dim 128, context 64, microbatch 8) is captured and
profiled ONCE with 2 blocks (2 repeats, cached as fxpipe-out/gpt2-profile.json);
deeper models are built by repeating the profiled second block's nodes and
costs (renamed, rewired along the residual stream), because profiling 96
blocks takes minutes here. Tied embedding/head stay tied.

Each row runs in its own subprocess (so RSS is the solve's own: ru_maxrss of
that process, including Python and numpy) with a wall-clock limit, and prints
the plan's throughput against the best uniform layout a user would pick: PP x
DP with the same number of blocks per stage (embedding with the first, head
with the last), each of the PP stages replicated DP times, scored by
``costmodel.evaluate`` under the same cost model.

    python -m tools.bench.partition_scale [--depths 8,32,96] [--devices 8,16,...,1024] [--time-limit 10]
        [--gpus-per-node N]   # passed to the partitioner if CostOptions has that field

Wall times are CPU-bound: other processes on the machine inflate them.
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from passes.costgraph import CostGraph, CostNode
from passes.partition import CostOptions, evaluate, partition

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "fxpipe-out" / "gpt2-profile.json"
_BLOCK = re.compile(r"blocks[._](\d+)[._]")


def profiled_gpt() -> CostGraph:
    """The 2-block GPT profile (made once, then read from ``fxpipe-out/``)."""
    if CACHE.exists():
        return CostGraph.load(CACHE)
    import torch

    sys.path.insert(0, str(ROOT))
    import examples.gpt as gpt
    from passes.capture import capture
    from passes.profile import profile, to_cost_graph

    torch.manual_seed(0)
    model = gpt.GPT(dim=128, layers=2, context=64)
    x = torch.randint(0, gpt.VOCAB, (gpt.BATCH, 64))
    gm = capture(model, (x,))
    profile(gm, (x,), repeats=2, warmup=1)
    graph = to_cost_graph(gm)
    CACHE.parent.mkdir(exist_ok=True)
    graph.save(CACHE)
    return graph


def _block_of(node: CostNode) -> Optional[int]:
    m = re.match(r"blocks\.(\d+)(\.|$)", node.module_path)
    return int(m.group(1)) if m else None


def deep_gpt(depth: int, base: Optional[CostGraph] = None) -> CostGraph:
    """``depth`` >= 2 blocks: the profiled block 0, then copies of the profiled last block.

    Edges inside the template are copied into every copy; edges entering it
    from block 0 enter the first copy, and copy k-1's node that leaves the
    template (the residual stream) feeds copy k the same way; edges leaving
    the template leave the last copy.
    """
    if depth < 2:
        raise ValueError("depth must be >= 2")
    base = base or profiled_gpt()
    block = {n: _block_of(nd) for n, nd in base.nodes.items()}
    last = max(b for b in block.values() if b is not None)
    tmpl = [n for n in base.nodes if block[n] == last]
    copies = [{n: n for n in tmpl}] + [{n: f"{n}__b{i}" for n in tmpl} for i in range(2, depth)]
    tag = f"blocks.{last}"
    nodes: Dict[str, CostNode] = {}
    sizes = {p: s for p, s in base.param_sizes.items() if not p.startswith(tag + ".")}
    for n, nd in base.nodes.items():
        if block[n] != last:
            nodes[n] = nd
        elif n == tmpl[0]:  # all copies here, one block after the other
            for i, names in enumerate(copies, start=1):
                for m in tmpl:
                    md = base.nodes[m]
                    params = tuple(p.replace(tag, f"blocks.{i}", 1) for p in md.params)
                    sizes.update({q: base.param_sizes[p] for p, q in zip(md.params, params)})
                    nodes[names[m]] = CostNode(**{**md.__dict__, "name": names[m], "params": params,
                                                 "module_path": md.module_path.replace(tag, f"blocks.{i}", 1)})
    exits = [u for u, v in base.edges if block[u] == last and block[v] != last]
    edges: List[Tuple[str, str]] = []
    for u, v in base.edges:
        if block[u] == last and block[v] == last:
            edges += [(c[u], c[v]) for c in copies]
        elif block[v] == last:
            edges.append((u, v))
            edges += [(copies[k - 1][exits[0]], copies[k][v]) for k in range(1, len(copies))]
        elif block[u] == last:
            edges.append((copies[-1][u], v))
        else:
            edges.append((u, v))
    graph = CostGraph(nodes=nodes, edges=list(dict.fromkeys(edges)), info={"source": f"gpt, {depth} blocks"}, param_sizes=sizes)
    graph.check()
    return graph
