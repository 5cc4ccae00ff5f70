"""The recomputation cost: memory keeps only a stage's inputs per microbatch, time pays one more forward."""
from __future__ import annotations

from passes.costgraph import CostGraph, CostNode
from passes.partition.costmodel import CostOptions, evaluate, recompute_choice, recompute_cost, stage_input_bytes


def _graph() -> CostGraph:
    def node(name: str, out: int, is_input: bool = False) -> CostNode:
        return CostNode(name=name, op="placeholder" if is_input else "call_function", target=name,
                        fwd_s=0.0 if is_input else 1.0, bwd_s=0.0 if is_input else 2.0, out_bytes=out,
                        param_bytes=0 if is_input else 100, is_input=is_input)
    nodes = [node("x", 10, True), node("a", 1000), node("b", 1000), node("c", 10), node("d", 5000)]
    edges = [("x", "a"), ("a", "b"), ("b", "c"), ("c", "d")]
    return CostGraph(nodes={n.name: n for n in nodes}, edges=edges, info={}, param_sizes={})


def test_recompute_keeps_inputs_and_pays_a_forward() -> None:
    g, assign = _graph(), {"x": 0, "a": 0, "b": 0, "c": 0, "d": 1}
    opts = CostOptions(devices=2, schedule="1f1b-flush", microbatches=4)
    ev = evaluate(g, assign, [1, 1], opts)
    assert stage_input_bytes(g, assign, 0) == 10 and stage_input_bytes(g, assign, 1) == 10
    s0 = ev.stages[0]  # 2010 activation bytes, 2 microbatches in flight, 300 weight bytes x (1 + 1 + 1)
    assert s0.memory_bytes == 900 + 2 * 2010
    again = recompute_cost(s0, 10, 0, [1, 1], opts)
    assert again.memory_bytes == 900 + 2 * 10 + 2010
    assert again.compute_s == s0.compute_s + s0.fwd_s
    # a 4000-byte budget: stage 0 (4920) recomputes; stage 1 (one node) is over too, but recomputing
    # cannot lower it (its one microbatch's activations stay alive during the recompute)
    choice = recompute_choice(g, assign, [1, 1], CostOptions(devices=2, schedule="1f1b-flush", microbatches=4,
                                                             memory=4000))
    assert choice == [True, False]
    assert recompute_choice(g, assign, [1, 1], opts) == [False, False]  # no budget: never


def test_recompute_under_zb_h1_keeps_what_w_reads_between_b_and_w() -> None:
    """zb-h1 holds every stage at the input stage's window (2 here); the last stage's own 1F1B window is 1,
    so one microbatch at a time waits between its B and its W with what W reads (its activations, at most)."""
    g, assign = _graph(), {"x": 0, "a": 0, "b": 0, "c": 0, "d": 1}
    opts = CostOptions(devices=2, schedule="zb-h1", microbatches=4)
    first, last = evaluate(g, assign, [1, 1], opts).stages
    assert recompute_cost(first, 10, 0, [1, 1], opts).memory_bytes == 900 + 2 * 10 + 2010  # as 1F1B-flush
    assert last.memory_bytes == 300 + 2 * 5000  # its 5000 activation bytes, two microbatches in flight
    again = recompute_cost(last, 10, 1, [1, 1], opts)
    assert again.memory_bytes == 300 + 2 * 10 + 5000 + 1 * 5000
