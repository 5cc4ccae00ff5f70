"""Weight-only chains (``segments.weight_only``): Gemma's norms scale by ``1 + weight.float()``.

The cast and the add read nothing but a weight, so without this rule no
residual add after them was a separator and the segment DP saw one lattice
for many layers. Checked here: which nodes the rule takes, that the
separators come back, and that the segment DP's bound stays under the exact
optimum (the whole lattice, ``downset_dp``) however much the chains cost.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from passes.costgraph import CostGraph, load_pipedream
from passes.partition import CostOptions, evaluate, is_convex
from passes.partition import segments
from passes.partition.coarsen import model_nodes
from passes.partition.segment_plan import chain_plan, silent_moves
from passes.partition.segments import folded_units, separators, weight_only
from tests.passes.test_partition_scale import _node, transformer_graph
from tests.passes.test_placed import _exact

NORMS = ("ln1", "ln2")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "pipedream"


def gemma_norms(blocks: int, share: float = 0.0, K: int = 1, norm_bytes: int = 256,
                tied_norm: bool = False) -> CostGraph:
    """``transformer_graph`` with each block's two norms reading ``1 + w.float()``: a cast holding the
    norm's weight and an add, each costing ``share`` of sum C / K. ``tied_norm``: block 0's first norm
    weight is also read by its second norm's cast (one weight, two readers)."""
    g = transformer_graph(blocks, seed=0, tied=False)
    ideal = g.total_compute_s() / K
    nodes, edges, sizes = dict(g.nodes), list(g.edges), dict(g.param_sizes)
    for b in range(blocks):
        for ln in NORMS:
            p = f"b{b}_{ln}"
            weight = "b0_ln1.w" if tied_norm and b == 0 else p + ".w"
            sizes[weight] = norm_bytes
            nodes[p + "_cast"] = _node(p + "_cast", cost=share * ideal, out=norm_bytes, params=(weight,),
                                       pbytes=0 if weight != p + ".w" else norm_bytes, path=f"blocks.{b}")
            nodes[p + "_one"] = _node(p + "_one", cost=share * ideal, out=norm_bytes, path=f"blocks.{b}")
            edges += [(p + "_cast", p + "_one"), (p + "_one", p)]
    names = list(nodes)  # each chain just before its norm, so the order stays topological
    order = []
    for n in names:
        if n.endswith(("_cast", "_one")):
            continue
        if n.endswith(NORMS):
            order += [n + "_cast", n + "_one"]
        order.append(n)
    return CostGraph(nodes={n: nodes[n] for n in order}, edges=edges, param_sizes=sizes)


def _chains(g: CostGraph) -> set:
    return {n for n in g.nodes if n.endswith(("_cast", "_one"))}


def test_takes_the_chains_of_small_untied_weights() -> None:
    g = gemma_norms(3)
    opts = CostOptions(devices=4)
    names = model_nodes(g, opts)
    assert weight_only(g, names) == _chains(g)
    big = gemma_norms(3, norm_bytes=10**6)  # over WEIGHT_ONLY_BYTES of the model's weights: kept
    assert weight_only(big, names) == set()
    tied = gemma_norms(3, tied_norm=True)  # one weight read by two casts: its sync is a cost, kept
    assert weight_only(tied, names) == _chains(g) - {f"b0_{ln}_{k}" for ln in NORMS for k in ("cast", "one")}


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
def test_a_layer_reading_the_input_is_not_weight_only(model: str) -> None:
    """fxpipe's model leaves the inputs out of the placed nodes: vgg16's first convolution (7 KB of 553
    MB of weights) then had no placed producer, and with the ReLUs and the next layers after it was
    taken for a weight-only chain. Every producer counts."""
    g = load_pipedream(EXAMPLES / "vgg16.txt")
    opts = CostOptions(devices=8, cost_model=model)
    assert weight_only(g, model_nodes(g, opts)) == set()


def test_the_residual_adds_separate_again(monkeypatch) -> None:
    """Each block's residual adds split the lattice as they do without the chains; with the rule
    off (no weight small enough) nothing splits it before the last chain."""
    opts = CostOptions(devices=8)
    plain = len(separators(folded_units(transformer_graph(4, seed=0, tied=False), opts)[0]))
    assert len(separators(folded_units(gemma_norms(4), opts)[0])) == plain
    monkeypatch.setattr(segments, "WEIGHT_ONLY_BYTES", -1.0)
    units, _ = folded_units(gemma_norms(4), opts)
    last = units.unit_of()["b3_ln2_cast"]
    assert all(p > last for p in separators(units)) and len(separators(units)) < plain


@pytest.mark.parametrize("model", ["fxpipe", "pipedream"])
@pytest.mark.parametrize("share,K", [(0.02, 4), (0.1, 4), (0.3, 4), (0.1, 8), (0.3, 2)])
def test_bound_under_the_exact_optimum_however_much_the_chains_cost(model: str, share: float, K: int) -> None:
    """Left out, a chain may sit in any stage up to its reader's: the bound keeps its compute only
    where every prefix holding the reader runs it, so a chain worth ``share`` of sum C / K never lifts
    the bound past the optimum; the plan puts it with its reader and scores as ``evaluate`` does."""
    g = gemma_norms(1, share, K)
    opts = CostOptions(devices=K, bandwidth=1e9, allreduce_bandwidth=2e9, cost_model=model)
    res = chain_plan(g, opts, time.monotonic(), math.inf)
    assert res is not None and _chains(g) <= set(res.assignment)
    best = _exact(g, opts, upper=res.bottleneck_s)  # the whole lattice of single nodes, exactly
    assert res.bound_s <= best * (1 + 1e-9) and best <= res.bottleneck_s * (1 + 1e-9)
    assert res.bottleneck_s == pytest.approx(evaluate(g, res.assignment, res.replicas, opts).bottleneck_s,
                                             rel=1e-12)
    assert sum(res.replicas) == K and is_convex(g, res.assignment)


def test_a_plan_runs_a_chain_where_there_is_room() -> None:
    """The plan maps a chain to its reader's stage (``coarsen.to_nodes``); where an earlier stage has
    room, ``silent_moves`` runs it there, never after its reader, and the plan is faster."""
    g = gemma_norms(1, share=0.05, K=2)
    opts = CostOptions(devices=2, bandwidth=1e9, allreduce_bandwidth=2e9)
    names = list(g.nodes)
    second = names.index("b0_ln2_cast")  # the MLP half (with its norm's chain) against the rest
    plan = {n: int(i >= second) for i, n in enumerate(names)}
    ev = evaluate(g, plan, [1, 1], opts)
    assert ev.stages[1].time_s > ev.stages[0].time_s  # the chain's stage is the bottleneck
    better, moved = silent_moves(g, plan, [1, 1], ev, opts)
    assert moved["b0_ln2_cast"] == 0 and moved["b0_ln2"] == 1 and is_convex(g, moved)
    assert better.bottleneck_s < ev.bottleneck_s
    assert better.bottleneck_s == pytest.approx(evaluate(g, moved, [1, 1], opts).bottleneck_s, rel=1e-12)
