"""The simulator against closed-form pipeline results."""
import math
from types import SimpleNamespace

import pytest

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from fxpipe.schedule import SCHEDULES, ScheduleError, build_schedule
from fxpipe.simulate import ActionCosts, costs_from_plan, link_bytes, simulate, simulate_plan
from passes.costgraph import CostGraph, CostNode
from passes.partition.costmodel import CostOptions, evaluate


def chain(S):
    return [(i, i + 1) for i in range(S - 1)]


@pytest.mark.parametrize("S,M", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7), (5, 16)])
@pytest.mark.parametrize("fwd,bwd", [(1.0, 1.0), (1.0, 2.0)])
def test_flush_bubble_is_the_textbook_formula(S, M, fwd, bwd):
    lay = Layout.of([1] * S)
    res = simulate(build_schedule("1f1b-flush", lay, M, chain(S)), [ActionCosts(fwd, bwd)] * S, lay)
    assert res.bubble_fraction == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)
    assert res.step_s == pytest.approx((M + S - 1) * (fwd + bwd))
    assert res.samples_per_s == pytest.approx(M / res.step_s)


def test_gpipe_has_the_same_bubble_as_flush_on_equal_stages():
    S, M = 4, 8
    lay = Layout.of([1] * S)
    res = simulate(build_schedule("gpipe", lay, M, chain(S)), [ActionCosts(1.0, 2.0)] * S, lay)
    assert res.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))


@pytest.mark.parametrize("S,M", [(2, 4), (3, 8), (4, 4), (4, 8), (5, 16)])
def test_zb_h1_bubble_is_the_papers_formula(S, M):
    """Qi et al.: with F = B = W, ZB-H1's bubble is (S-1)(F+B-W) against 1F1B's (S-1)(F+B+W)."""
    lay = Layout.of([1] * S)
    costs = [ActionCosts(1.0, 2.0, activation_bytes=1)] * S  # B and W take 1.0 each
    zb = simulate(build_schedule("zb-h1", lay, M, chain(S)), costs, lay)
    flush = simulate(build_schedule("1f1b-flush", lay, M, chain(S)), costs, lay)
    assert zb.step_s == pytest.approx(3 * M + (S - 1) * 1.0)
    assert flush.step_s == pytest.approx(3 * M + (S - 1) * 3.0)
    # same peak activation memory as 1F1B: every stage holds what the input stage holds there
    assert max(zb.peak_memory.values()) == max(flush.peak_memory.values()) == min(S, M)


def test_stash_has_no_bubble_in_steady_state():
    S, M = 4, 24
    lay = Layout.of([1] * S)
    res = simulate(build_schedule("1f1b-stash", lay, M, chain(S)), [ActionCosts(1.0, 2.0)] * S, lay)
    # steady state: from the first backward of the input stage to its last forward
    b0 = next(e for e in res.events[0] if e.action == Action(Kind.B, 0) and e.activity == "compute")
    f_last = next(e for e in res.events[0] if e.action == Action(Kind.F, M - 1) and e.activity == "compute")
    assert f_last.start - b0.start > 10 * 3.0
    for rank in range(S):
        assert res.idle_s(rank, b0.start, f_last.start) == pytest.approx(0.0, abs=1e-9)
    assert res.steady_samples_per_s == pytest.approx(1 / 3.0)


def test_stash_replicated_input_stage_keeps_bottleneck_busy():
    # stage 0 twice as slow, replicated twice: the pipeline runs at the rate of one stage-1 device
    lay = Layout.of([2, 1])
    costs = [ActionCosts(2.0, 4.0), ActionCosts(1.0, 2.0)]
    res = simulate(build_schedule("1f1b-stash", lay, 24, [(0, 1)]), costs, lay)
    assert res.steady_samples_per_s == pytest.approx(1 / 3.0, rel=1e-6)


def test_communication_delays_the_consumer():
    lay = Layout.of([1, 1])
    costs = [ActionCosts(1.0, 1.0, send_bytes={1: 1000}), ActionCosts(1.0, 1.0)]
    s = build_schedule("gpipe", lay, 1, [(0, 1)])
    res = simulate(s, costs, lay, bandwidth=1000.0)  # 1 s per transfer each way
    assert res.step_s == pytest.approx(1 + 1 + 1 + 1 + 1 + 1)
    waits = [e for e in res.events[1] if e.activity == "wait"]
    assert waits and waits[0].end - waits[0].start == pytest.approx(2.0)
    blocking = simulate(s, costs, lay, bandwidth=1000.0, overlap_comm=False)
    assert blocking.step_s == pytest.approx(res.step_s)  # nothing to overlap with here


def test_allreduce_is_a_barrier_with_its_cost():
    lay = Layout.of([2, 1])
    costs = [ActionCosts(1.0, 1.0, allreduce_s=0.5), ActionCosts(1.0, 1.0)]
    res = simulate(build_schedule("1f1b-flush", lay, 3, [(0, 1)]), costs, lay)
    ar = [next(e for e in res.events[r] if e.activity == "allreduce") for r in (0, 1)]
    assert ar[0].start == ar[1].start and ar[0].end - ar[0].start == pytest.approx(0.5)


def test_peak_memory_counts_stashed_versions_and_activations():
    S, M = 4, 12
    lay = Layout.of([1] * S)
    costs = [ActionCosts(1.0, 2.0, param_bytes=100, activation_bytes=1)] * S
    stash = simulate(build_schedule("1f1b-stash", lay, M, chain(S)), costs, lay)
    flush = simulate(build_schedule("1f1b-flush", lay, M, chain(S)), costs, lay)
    gpipe = simulate(build_schedule("gpipe", lay, M, chain(S)), costs, lay)
    # stage j keeps S - j microbatches in flight, each with its own weight version under stash
    assert stash.peak_memory == {j: (S - j) * 100 + (S - j) for j in range(S)}
    assert flush.peak_memory == {j: 100 + (S - j) for j in range(S)}
    assert gpipe.peak_memory == {j: 100 + M for j in range(S)}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("replicas", [(1, 1, 1), (2, 1), (1, 2, 1), (3, 1), (2, 2, 1)])
def test_every_builtin_schedule_runs_to_the_end(schedule, replicas):
    lay = Layout.of(replicas)
    S = len(replicas)
    links = chain(S) + ([(0, S - 1)] if S > 2 else [])
    costs = [ActionCosts(0.1 * (j + 1), 0.2, send_bytes={b: 10 for a, b in links if a == j}, allreduce_s=0.05,
                        param_bytes=8, activation_bytes=2) for j in range(S)]
    M = 6
    tied = (0, S - 1) if schedule != "1f1b-stash" else ()  # stash refuses tied stages with unequal replicas
    res = simulate(build_schedule(schedule, lay, M, links, tied_stages=tied), costs, lay, bandwidth=1e3)
    assert math.isfinite(res.step_s) and res.step_s > 0
    done = {(r, e.action.mb) for r, evs in res.events.items() for e in evs if e.action.kind is Kind.B}
    assert len(done) == M * S
    assert 0.0 <= res.bubble_fraction < 1.0


def test_deadlocked_schedule_is_refused_by_the_simulator():
    lay = Layout.of([1, 1])
    broken = {0: [Action.parse(t) for t in "F0 RECV_B0<r1 B0 SEND_F0>r1 STEP".split()],
              1: [Action.parse(t) for t in "RECV_F0<r0 F0 B0 SEND_B0>r0 STEP".split()]}
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(broken, [ActionCosts(1, 1)] * 2, lay)


def tiny_graph():
    nodes = [CostNode("x", "placeholder", "x", 0, 0, 400, 0, is_input=True),
             CostNode("a", "call_module", "a", 1.0, 2.0, 100, 40, module_path="a"),
             CostNode("b", "call_module", "b", 1.0, 2.0, 50, 40, module_path="b"),
             CostNode("c", "call_function", "add", 0.5, 0.5, 50, 0),
             CostNode("out", "output", "output", 0, 0, 0, 0)]
    edges = [("x", "a"), ("x", "c"), ("a", "b"), ("a", "c"), ("b", "c"), ("c", "out")]
    return CostGraph({n.name: n for n in nodes}, edges)


def fake_plan(graph, assignment, replicas, batch_size=8, **options):
    """A stand-in with the Plan's fields: the cost model's stage records and options (the real one lives in
    fxpipe/plan.py)."""
    opts = CostOptions(**{"devices": sum(replicas), "bandwidth": 1e3, "microbatches": 4, **options})
    stages = evaluate(graph, assignment, list(replicas), opts).stages
    return SimpleNamespace(stages=stages, devices=sum(replicas), batch_size=batch_size, options=opts.as_dict())


def test_link_bytes_sends_one_copy_per_consumer_stage_and_skips_inputs():
    g = tiny_graph()
    where = {"x": 0, "a": 0, "b": 1, "c": 2, "out": 2}
    assert link_bytes(g, where) == {(0, 1): 100, (0, 2): 100, (1, 2): 50}


def test_simulate_plan_uses_profile_links_and_batch_size():
    g = tiny_graph()
    plan = fake_plan(g, {"x": 0, "a": 0, "b": 1, "c": 2, "out": 2}, [1, 1, 1])
    costs, links = costs_from_plan(plan, g)
    assert links == [(0, 1), (0, 2), (1, 2)]
    assert costs[0].send_bytes == {1: 100, 2: 100} and costs[0].activation_bytes == 100
    res, sched = simulate_plan(plan, graph=g)
    assert sched.name == "1f1b-flush" and res.microbatches == 4
    assert res.samples_per_s == pytest.approx(4 * 8 / res.step_s)
    no_graph, _ = simulate_plan(plan, schedule="gpipe", microbatches=2)
    assert no_graph.schedule == "gpipe" and no_graph.microbatches == 2


def test_2bw_predicted_over_a_window_of_steps_counting_every_microbatch():
    """2bw runs without a drain between steps: the prediction simulates steps enough for a window of
    4 x devices microbatches and counts every one of them (it had counted one step's over two steps'
    time: about half the rate a run reaches)."""
    g = tiny_graph()
    plan = fake_plan(g, {"x": 0, "a": 0, "b": 1, "c": 2, "out": 2}, [1, 1, 1])
    two, sched = simulate_plan(plan, schedule="2bw", microbatches=4, graph=g, bandwidth=math.inf)
    flush, _ = simulate_plan(plan, schedule="1f1b-flush", microbatches=4, graph=g, bandwidth=math.inf)
    ran = {a.mb for acts in sched.values() for a in acts if a.kind.value == "F"}
    assert two.microbatches == 4 and two.steps == 3 and len(ran) == 12  # 4 x 3 devices
    assert two.samples_per_s == pytest.approx(12 * 8 / two.step_s)
    assert two.samples_per_s > flush.samples_per_s  # no drain per step
    assert two.samples_per_s == pytest.approx(two.steady_samples_per_s, rel=0.15)  # one fill and drain left


def test_optimizer_step_times_lengthen_the_step_once_per_step_or_per_backward():
    g = tiny_graph()
    plan = fake_plan(g, {"x": 0, "a": 0, "b": 1, "c": 2, "out": 2}, [1, 1, 1])
    base, _ = simulate_plan(plan, schedule="1f1b-flush", microbatches=4, graph=g)
    flush, _ = simulate_plan(plan, schedule="1f1b-flush", microbatches=4, graph=g, step_s=[0.5, 0.5, 0.5])
    assert flush.step_s == pytest.approx(base.step_s + 0.5)  # one step at the end of the flush
    stash0, _ = simulate_plan(plan, schedule="1f1b-stash", microbatches=8, graph=g)
    stash, _ = simulate_plan(plan, schedule="1f1b-stash", microbatches=8, graph=g, step_s=[0.5, 0.5, 0.5])
    assert stash.step_s > stash0.step_s + 4 * 0.5  # a step after every backward
    with pytest.raises(ScheduleError, match="2 entries for a plan of 3 stages"):
        simulate_plan(plan, graph=g, step_s=[0.1, 0.1])


def test_compute_scale_scales_forwards_and_backwards_only():
    """Workers on more threads than the profile's: compute shrinks by the measured speed-up, nothing else."""
    g = tiny_graph()
    plan = fake_plan(g, {"x": 0, "a": 0, "b": 1, "c": 2, "out": 2}, [1, 1, 1])
    free, _ = simulate_plan(plan, graph=g, bandwidth=math.inf)
    half, _ = simulate_plan(plan, graph=g, bandwidth=math.inf, compute_scale=0.5)
    assert half.step_s == pytest.approx(free.step_s / 2)  # no communication: the step is all compute
    with_steps, _ = simulate_plan(plan, graph=g, bandwidth=math.inf, compute_scale=0.5, step_s=[0.5, 0.5, 0.5])
    assert with_steps.step_s == pytest.approx(free.step_s / 2 + 0.5)  # the optimizer step is timed as is


def test_a_recomputing_stage_runs_its_forward_again_in_b():
    """``recompute``: one more forward per backward on the stages that recompute (in B, zb-h1's W as before)."""
    g = tiny_graph()
    plan = fake_plan(g, {"x": 0, "a": 0, "b": 0, "c": 0, "out": 0}, [1])
    fwd = costs_from_plan(plan, g)[0][0].fwd_s
    for schedule in ("1f1b-flush", "zb-h1", "gpipe"):
        base, _ = simulate_plan(plan, schedule=schedule, microbatches=4, graph=g, bandwidth=math.inf)
        again, _ = simulate_plan(plan, schedule=schedule, microbatches=4, graph=g, bandwidth=math.inf,
                                 recompute=[True])
        assert again.step_s == pytest.approx(base.step_s + 4 * fwd), schedule  # one stage: all compute
        same, _ = simulate_plan(plan, schedule=schedule, microbatches=4, graph=g, bandwidth=math.inf,
                                recompute=[False])
        assert same.step_s == pytest.approx(base.step_s)
    with pytest.raises(ScheduleError, match="2 entries for a plan of 1 stages"):
        simulate_plan(plan, graph=g, recompute=[True, True])


def test_a_recomputing_stage_that_does_not_defer_runs_its_whole_backward_in_b():
    """zb-h1 + recompute: ``W`` keeps its share only on a stage that receives a value and defers (``defers``);
    the first stage (receives nothing) and a stage that does not qualify run the whole backward in ``B``."""
    g = tiny_graph()
    plan = fake_plan(g, {"x": 0, "a": 0, "b": 1, "c": 1, "out": 1}, [1, 1])
    costs = costs_from_plan(plan, g)[0]

    def spent(result, kind: str) -> dict:
        return {r: sum(e.end - e.start for e in ev if e.activity == "compute" and e.action.kind.name == kind)
                for r, ev in result.events.items()}

    kw = dict(schedule="zb-h1", microbatches=4, graph=g, bandwidth=math.inf)
    base, _ = simulate_plan(plan, **kw)
    for defers, w1 in ((None, costs[1].w_s), ([True, True], costs[1].w_s), ([True, False], 0.0)):
        again, _ = simulate_plan(plan, recompute=[True, True], defers=defers, **kw)
        w, b = spent(again, "W"), spent(again, "B")
        assert w[0] == pytest.approx(0.0) and w[1] == pytest.approx(4 * w1), defers
        for r in (0, 1):  # the backward and one forward per microbatch, between B and W
            assert w[r] + b[r] == pytest.approx(4 * (costs[r].bwd_s + costs[r].fwd_s)), (defers, r)
    assert costs[0].w_s > 0 and spent(base, "W")[0] == pytest.approx(4 * costs[0].w_s)  # without recompute: W
    with pytest.raises(ScheduleError, match="defers has 1 entries for a plan of 2 stages"):
        simulate_plan(plan, recompute=[True, True], defers=[True], **kw)


def test_stage_step_cost_is_timed_on_copies():
    import torch

    from fxpipe.runtime.loop import TrainConfig
    from fxpipe.runtime.stepcost import stage_step_s

    stage = torch.nn.Linear(64, 64)
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    for kind in ("1f1b-flush", "1f1b-stash"):
        for opt in ("sgd", "adamw"):
            assert stage_step_s(stage, TrainConfig(schedule=kind, optimizer=opt), repeats=2) > 0
    assert all(torch.equal(before[k], v) for k, v in stage.state_dict().items())
    assert all(p.grad is None for p in stage.parameters())


def test_every_timed_step_updates_every_parameter(monkeypatch):
    """A copy-free SGD step consumes the gradients it reads (it writes the weights over them): each
    timed step must find them set again, or every step after the first times an empty update."""
    import torch

    from fxpipe.runtime import stepcost
    from fxpipe.runtime.loop import TrainConfig
    from fxpipe.runtime.optim import run_step

    stage = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with_grads = []

    def counting(opt):
        with_grads.append(sum(p.grad is not None for group in opt.param_groups for p in group["params"]))
        run_step(opt)

    monkeypatch.setattr(stepcost, "run_step", counting)
    for kind in ("1f1b-stash", "1f1b-flush"):
        with_grads.clear()
        stepcost.stage_step_s(stage, TrainConfig(schedule=kind, optimizer="sgd"), repeats=3, warmup=1)
        assert with_grads == [4] * 4, kind


@pytest.mark.parametrize("replicas", [(1, 2, 1), (3, 2, 1), (2, 3, 1), (1, 1, 2), (4, 2, 1)])
def test_flush_keeps_replicated_pipelines_at_full_rate(replicas):
    # stage j is r_j times slower, so every stage serves one microbatch per 3 s
    lay = Layout.of(replicas)
    costs = [ActionCosts(1.0 * r, 2.0 * r) for r in replicas]
    res = simulate(build_schedule("1f1b-flush", lay, 12 * 6, chain(len(replicas))), costs, lay)
    assert res.steady_samples_per_s == pytest.approx(1 / 3.0, rel=1e-6)


def test_pipedream_count_starves_a_replicated_middle_stage():
    # why 1f1b-flush holds one more microbatch at the input stage of 1-2-1 (see costmodel.in_flight)
    from fxpipe.schedule import in_flight
    lay = Layout.of([1, 2, 1])
    assert [in_flight(lay, j, "1f1b-stash") for j in range(3)] == [4, 2, 1]
    assert [in_flight(lay, j, "1f1b-flush") for j in range(3)] == [5, 2, 1]
    costs = [ActionCosts(1.0, 2.0), ActionCosts(2.0, 4.0), ActionCosts(1.0, 2.0)]
    stash = simulate(build_schedule("1f1b-stash", lay, 24, chain(3)), costs, lay)
    assert stash.steady_samples_per_s == pytest.approx(2 / 9.0, rel=1e-6)  # 2/3 of the full rate


def test_per_action_overhead_adds_to_every_forward_and_backward():
    S, M = 2, 4
    lay = Layout.of([1] * S)
    s = build_schedule("1f1b-flush", lay, M, chain(S))
    base = simulate(s, [ActionCosts(1.0, 1.0)] * S, lay)
    slow = simulate(s, [ActionCosts(1.0, 1.0)] * S, lay, overhead_s=0.5)
    assert slow.step_s == pytest.approx(base.step_s * 1.5)


def tied_graph():
    nodes = [CostNode("x", "placeholder", "x", 0, 0, 8, 0, is_input=True),
             CostNode("emb", "call_module", "emb", 1.0, 1.0, 100, 400, params=("w",)),
             CostNode("mid", "call_module", "mid", 1.0, 1.0, 100, 40, params=("m",)),
             CostNode("head", "call_function", "linear", 1.0, 1.0, 10, 0, params=("w",))]
    return CostGraph({n.name: n for n in nodes}, [("x", "emb"), ("emb", "mid"), ("mid", "head")],
                     param_sizes={"w": 400, "m": 40})


def test_tied_weight_costs_the_same_in_the_plan_and_the_simulation():
    # stages 0 and 2 hold w: a ring of their 2 ranks, 2 (n-1)/n x 400 B at 1e3 B/s; stage 1 has nothing to sync
    g = tied_graph()
    plan = fake_plan(g, {"x": 0, "emb": 0, "mid": 1, "head": 2}, [1, 1, 1])
    assert [s.allreduce_s for s in plan.stages] == [pytest.approx(0.4), 0.0, pytest.approx(0.4)]
    costs, _ = costs_from_plan(plan, g)
    assert [c.allreduce_s for c in costs] == [s.allreduce_s for s in plan.stages]
    assert [s.tied_bytes for s in plan.stages] == [400, 0, 400]
    for graph in (g, None):  # the tied stages come from the plan, so a profile is not needed
        res, sched = simulate_plan(plan, graph=graph)
        assert sched.tied_stages == (0, 2)
        for rank in (0, 2):
            syncs = [e.end - e.start for e in res.events[rank] if e.activity == "allreduce"]
            assert syncs == [pytest.approx(0.4)]


def test_tied_weight_on_a_replicated_stage_syncs_over_every_rank_holding_it():
    g = tied_graph()
    plan = fake_plan(g, {"x": 0, "emb": 0, "mid": 1, "head": 2}, [2, 1, 1])
    # stage 0's two replicas and stage 2 hold w: a ring of 3 ranks, 2 x 2/3 x 400 B / 1e3 B/s
    assert plan.stages[0].allreduce_s == pytest.approx(2 * 2 / 3 * 0.4)
    assert plan.stages[2].allreduce_s == pytest.approx(2 * 2 / 3 * 0.4)


def test_partitioner_and_simulator_charge_a_tied_weight_alike():
    from passes.partition import partition

    from fxpipe.plan import plan_from_result

    g = tied_graph()
    plan = plan_from_result(partition(g, 2, bandwidth=1e3, microbatches=4, replication="none", time_limit=10), g)
    tied = [s.index for s in plan.stages if any(g.nodes[n].params == ("w",) for n in s.nodes)]
    assert tied == [0, 1]  # a chain emb -> mid -> head in two stages: emb and head always apart
    res, _ = simulate_plan(plan, graph=g)
    for s in plan.stages:
        syncs = [e.end - e.start for e in res.events[s.ranks[0]] if e.activity == "allreduce"]
        assert syncs == [pytest.approx(s.allreduce_s)] and s.allreduce_s == pytest.approx(0.4)


def test_simulate_split_uses_the_splits_links_and_tied_stages():
    from fxpipe.simulate import simulate_split

    g = tiny_graph()
    plan = fake_plan(g, {"x": 0, "a": 0, "b": 1, "c": 2, "out": 2}, [1, 1, 1])
    split = SimpleNamespace(plan=plan, profile=g, links=[(0, 1), (1, 2)], tied={"w": [0, 2]})
    res = simulate_split(split, "1f1b-flush", 3)
    peers = {a.peer for e in res.events[0] for a in [e.action] if a.is_send}
    assert peers == {1}  # the split's links, not the profile's (0, 2)
    assert any(e.action.kind is Kind.ALLREDUCE for e in res.events[2])
    with pytest.raises(ScheduleError, match="no plan"):
        simulate_split(SimpleNamespace(plan=None, links=[]))


def test_a_big_stage_is_timed_on_a_sample_and_scaled(monkeypatch):
    import torch

    from fxpipe.runtime import stepcost
    from fxpipe.runtime.loop import TrainConfig

    stage = torch.nn.Linear(64, 64)  # 4160 elements
    seen = []
    monkeypatch.setattr(stepcost, "_time_step", lambda params, *a: seen.append(sum(p.numel() for p in params)) or 1.0)
    monkeypatch.setattr(stepcost, "SAMPLE_NUMEL", 1040)
    assert stepcost.stage_step_s(stage, TrainConfig()) == 4.0 and seen == [1040]
    monkeypatch.setattr(stepcost, "SAMPLE_NUMEL", 10**6)
    assert stepcost.stage_step_s(stage, TrainConfig()) == 1.0 and seen[-1] == 4160


def test_two_level_plan_sends_inside_a_node_fast_and_between_nodes_slow():
    # 4 stages on 2 nodes of 2: links 0->1 and 2->3 stay inside a node (1e9 B/s), 1->2 crosses (1e3 B/s)
    nodes = [CostNode("x", "placeholder", "x", 0, 0, 8, 0, is_input=True)]
    nodes += [CostNode(f"n{i}", "call_function", "f", 1.0, 1.0, 500, 0) for i in range(4)]
    g = CostGraph({n.name: n for n in nodes}, [("x", "n0")] + [(f"n{i}", f"n{i + 1}") for i in range(3)])
    where = {"x": 0, **{f"n{i}": i for i in range(4)}}
    plan = fake_plan(g, where, [1, 1, 1, 1], gpus_per_node=2, intra_bandwidth=1e9)
    assert [s.comm_s for s in plan.stages] == [pytest.approx(1e-6), pytest.approx(1.0), pytest.approx(1.0),
                                               pytest.approx(1e-6)]  # the cost model: 2 x 500 B each way
    res, _ = simulate_plan(plan, graph=g, microbatches=1)
    wire = {e.action.peer: e.end - e.start for r in (0, 1, 2) for e in res.events[r] if e.action.kind is Kind.SEND_F}
    assert wire == {1: pytest.approx(500 / 1e9), 2: pytest.approx(500 / 1e3), 3: pytest.approx(500 / 1e9)}


def test_ranks_sharing_cores_run_no_faster_than_the_cores_allow():
    S, M = 4, 16
    lay = Layout.of([1] * S)
    sched = build_schedule("1f1b-flush", lay, M, chain(S))
    costs = [ActionCosts(1.0, 2.0)] * S
    alone = simulate(sched, costs, lay)
    assert simulate(sched, costs, lay, cores=4).step_s == pytest.approx(alone.step_s)  # a core per rank: no change
    two = simulate(sched, costs, lay, cores=2)
    work = S * M * 3.0
    # two cores do the work of four ranks: at least half of it in sequence, and a rank alone in the bubble
    # (warm-up, cool-down) runs at full speed, so less than twice the one-core-per-rank time
    assert work / 2 <= two.step_s < 2 * alone.step_s
    assert two.step_s == pytest.approx(work / 2, rel=0.1)
    one = simulate(sched, costs, lay, cores=1)
    assert one.step_s == pytest.approx(work, rel=0.02)


def test_posting_a_message_costs_the_rank_time():
    lay = Layout.of([1, 1])
    sched = build_schedule("1f1b-flush", lay, 4, chain(2))
    base = simulate(sched, [ActionCosts(1.0, 2.0)] * 2, lay).step_s
    posted = simulate(sched, [ActionCosts(1.0, 2.0)] * 2, lay, post_s=0.01).step_s
    assert base < posted <= base + 0.01 * sum(a.is_send or a.is_recv for acts in sched.values() for a in acts)


def test_each_message_side_is_charged_its_bytes_cpu():
    """A send and its receive each cost post_s + post_per_byte_s * bytes, gradients the activation's bytes."""
    lay = Layout.of([1, 1])
    sched = build_schedule("1f1b-flush", lay, 4, chain(2))
    costs = [ActionCosts(1.0, 2.0, send_bytes={1: 1000}), ActionCosts(1.0, 2.0)]
    per_byte = 1e-6  # 1 ms per message side

    def charged(result, activity):
        return {r: sum(e.end - e.start for e in evs if e.activity == activity) for r, evs in result.events.items()}

    sim = simulate(sched, costs, lay, post_per_byte_s=per_byte)
    M = 4
    # stage 0 posts M forward sends and M gradient receives, stage 1 the mirror image: 2M sides of 1,000 bytes
    assert charged(sim, "post") == pytest.approx({0: M * 1e-3, 1: M * 1e-3})
    assert charged(sim, "recv") == pytest.approx({0: M * 1e-3, 1: M * 1e-3})
    base = simulate(sched, costs, lay).step_s
    assert base < sim.step_s <= base + 2 * M * 2 * 1e-3
    fixed = simulate(sched, costs, lay, post_s=1e-3)
    assert charged(fixed, "post") == pytest.approx(charged(sim, "post"))


def test_w_is_the_parameter_nodes_half_of_the_backward_and_a_first_stage_whole() -> None:
    g = tiny_graph()  # a, b hold parameters (backward 2.0 each), c does not (0.5)
    plan = fake_plan(g, {"x": 0, "a": 0, "b": 1, "c": 1, "out": 1}, [1, 1])
    costs, _ = costs_from_plan(plan, g)
    assert costs[0].w_s == pytest.approx(2.0)  # receives nothing: its whole backward waits for W
    assert costs[1].w_s == pytest.approx(1.0)  # half of b's backward, nothing of c's
    no_graph, _ = costs_from_plan(plan)
    assert no_graph[1].w_s == pytest.approx(2.5 / 2)
    res, _ = simulate_plan(plan, schedule="zb-h1", microbatches=4, graph=g)
    w = [e.end - e.start for e in res.events[1] if e.action.kind.name == "W"]
    assert w and all(t == pytest.approx(1.0) for t in w)
