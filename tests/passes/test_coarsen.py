"""Coarsening: groups stay convex, module subtrees merge whole, and plans on groups stay valid."""
from __future__ import annotations

import networkx as nx

from passes.costgraph import CostGraph, CostNode
from passes.partition import is_convex, partition
from passes.partition.coarsen import coarsen
from passes.partition.costmodel import CostOptions


def _node(name: str, path: str = "", op: str = "call_function", cost: float = 1e-3, out: int = 1000,
          is_input: bool = False) -> CostNode:
    zero = is_input or op == "output"
    return CostNode(name, "placeholder" if is_input else op, "t", 0.0 if zero else cost, 0.0 if zero else cost,
                    0 if op == "output" else out, 0, module_path=path, is_input=is_input)


def diamond_blocks(blocks: int) -> CostGraph:
    """``blocks`` modules in a row, each a diamond a -> (b, c) -> d: no chain merge can join them."""
    nodes = [_node("x", is_input=True)]
    edges, prev = [], "x"
    for i in range(blocks):
        p = f"blocks.{i}"
        names = [f"b{i}_{k}" for k in "abcd"]
        nodes += [_node(n, f"{p}.{k}") for n, k in zip(names, ("norm", "q", "k", "proj"))]
        a, b, c, d = names
        edges += [(prev, a), (a, b), (a, c), (b, d), (c, d)]
        prev = d
    nodes.append(_node("out", op="output"))
    edges.append((prev, "out"))
    return CostGraph({n.name: n for n in nodes}, edges)


def _acyclic(graph: CostGraph, units) -> bool:
    unit = units.unit_of()
    g = nx.DiGraph((unit[u], unit[v]) for u, v in graph.edges if u in unit and v in unit and unit[u] != unit[v])
    return nx.is_directed_acyclic_graph(g)


def test_module_subtrees_merge_whole_and_stay_acyclic():
    graph = diamond_blocks(16)
    units = coarsen(graph, CostOptions(devices=2), target=17)
    assert len(units) == 16 + 1  # one group per block, plus the output (the input is not placed)
    for i in range(16):
        owners = {u for u, names in enumerate(units.members) for n in names if n.startswith(f"b{i}_")}
        assert len(owners) == 1, f"block {i} split over units {owners}"
    assert _acyclic(graph, units)


def test_a_module_that_is_not_convex_is_not_merged():
    # m.p feeds an outside node e, and e feeds m.q: merging m's two nodes would make a cycle with e
    nodes = [_node("x", is_input=True), _node("p", "m.p"), _node("e", "other"), _node("q", "m.q"),
             _node("out", op="output")]
    edges = [("x", "p"), ("p", "e"), ("p", "q"), ("e", "q"), ("q", "out")]
    graph = CostGraph({n.name: n for n in nodes}, edges)
    units = coarsen(graph, CostOptions(devices=1), target=1)
    unit = units.unit_of()
    assert unit["p"] != unit["q"]
    assert _acyclic(graph, units)


def test_partition_on_module_groups_is_convex_and_keeps_blocks_whole():
    graph = diamond_blocks(40)
    result = partition(graph, 4, coarsen_above=30, time_limit=20, solver="cpsat")
    assert is_convex(graph, result.assignment)
    for i in range(40):
        assert len({result.assignment[f"b{i}_{k}"] for k in "abcd"}) == 1
