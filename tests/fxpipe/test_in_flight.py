"""One in-flight count: the schedule builder, the cost model, CP-SAT's memory constraint and the simulator agree.

``costmodel.in_flight`` is the definition; the others must reach the same number on every layout of up to 4
stages with up to 3 replicas each, for every schedule, with steps long enough to leave the count uncapped and
short enough to cap it.
"""
import itertools
import math

import pytest
from ortools.sat.python import cp_model

from fxpipe.layout import Layout
from fxpipe.schedule import build_schedule
from fxpipe.simulate import ActionCosts, simulate
from passes.costgraph import CostGraph, CostNode
from passes.partition.coarsen import build_units, model_nodes
from passes.partition.costmodel import SCHEDULES, CostOptions, in_flight, memory_bytes, most_in_flight
from passes.partition.model import PartitionModel

LAYOUTS = [reps for S in range(1, 5) for reps in itertools.product(range(1, 4), repeat=S)]


def chain(S):
    return [(i, i + 1) for i in range(S - 1)]


def step_lengths(schedule, replicas):
    """Microbatches per action list: one that caps the count, one that does not (stash: equal per replica)."""
    lcm = math.lcm(*replicas)
    if schedule == "1f1b-stash":
        return [lcm, 36]
    if schedule == "2bw":  # a step must outlast the warm-up (two weight versions): long ones only
        return [24, 36]
    return [max(replicas), 5, 24]


def held(actions):
    """The most microbatches a rank's list has run forward and not yet backward (zb-h1: its ``W``,
    the backward's second half, which still needs the activations)."""
    done = "W" if any(a.kind.value == "W" for a in actions) else "B"
    now = most = 0
    for a in actions:
        now += {"F": 1, done: -1}.get(a.kind.value, 0)
        most = max(most, now)
    return most


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_builder_and_simulator_hold_what_the_cost_model_counts(schedule):
    for replicas in LAYOUTS:
        lay = Layout.of(replicas)
        for M in step_lengths(schedule, replicas):
            built = build_schedule(schedule, lay, M, chain(len(replicas)))
            costs = [ActionCosts(1.0, 2.0, activation_bytes=1)] * len(replicas)  # memory = microbatches held
            sim = simulate(built, costs, lay)
            for j in range(len(replicas)):
                want = in_flight(j, replicas, schedule, M)
                assert want <= most_in_flight(CostOptions(devices=sum(replicas), schedule=schedule, microbatches=M))
                assert max(held(built[r]) for r in lay.ranks(j)) == want, (replicas, M, j)
                assert max(sim.peak_memory[r] for r in lay.ranks(j)) == want, (replicas, M, j)


def test_flush_counts_on_one_two_one():
    # the layout the pipeline starved on with PipeDream's count (tests/fxpipe/test_simulate.py)
    assert [in_flight(j, (1, 2, 1), "1f1b-flush") for j in range(3)] == [5, 2, 1]
    assert [in_flight(j, (1, 2, 1), "1f1b-stash") for j in range(3)] == [4, 2, 1]
    opts = CostOptions(devices=4, schedule="1f1b-flush", microbatches=8, optimizer_state=0)
    assert memory_bytes(0, 100, 0, [1, 2, 1], opts) == 500  # 5 microbatches of 100 bytes at the input stage


def _chain_units(S, opts):
    nodes = [CostNode("x", "placeholder", "x", 0.0, 0.0, 8, 0, is_input=True)]
    nodes += [CostNode(f"n{i}", "call_function", "f", 1.0, 1.0, 8, 8) for i in range(S)]
    g = CostGraph({n.name: n for n in nodes}, [("x", "n0")] + [(f"n{i}", f"n{i + 1}") for i in range(S - 1)])
    return build_units(g, opts, [[n] for n in model_nodes(g, opts)])


def _cpsat_in_flight(replicas, schedule, M):
    """The least microbatches in flight CP-SAT's memory constraint allows per stage, the layout fixed."""
    opts = CostOptions(devices=sum(replicas), schedule=schedule, microbatches=M, memory=10**15)
    model = PartitionModel(_chain_units(len(replicas), opts), opts)
    assert model.S == len(replicas)
    for b, r in enumerate(replicas):
        for choice, y in model.y[b].items():
            model.m.Add(y == int(choice == r))
    model.m.Minimize(sum(model.flight))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    assert solver.Solve(model.m) == cp_model.OPTIMAL
    return [solver.Value(f) for f in model.flight]


@pytest.mark.parametrize("schedule,M", [("1f1b-flush", 24), ("1f1b-flush", 5), ("1f1b-stash", 36), ("gpipe", 5),
                                        ("2bw", 5)])
def test_cpsat_memory_constraint_uses_the_cost_models_count(schedule, M):
    for replicas in LAYOUTS:
        # stash and 2bw runs never drain: their plans are costed uncapped
        cap = None if schedule in ("1f1b-stash", "2bw") else M
        want = [in_flight(j, replicas, schedule, cap) for j in range(len(replicas))]
        assert _cpsat_in_flight(replicas, schedule, M) == want, replicas


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("replicas", [(1, 2, 1), (2, 1), (1, 1, 1, 1), (1, 3, 2)])
def test_simulated_peak_memory_is_the_plans_memory(schedule, replicas):
    from tests.plans import synthetic_plan
    from fxpipe.simulate import simulate_plan

    S = len(replicas)
    nodes = [CostNode("x", "placeholder", "x", 0.0, 0.0, 8, 0, is_input=True)]
    nodes += [CostNode(f"n{i}", "call_function", "f", 1.0, 2.0, 1000 * (i + 1), 100 * (i + 1)) for i in range(S)]
    g = CostGraph({n.name: n for n in nodes}, [("x", "n0")] + [(f"n{i}", f"n{i + 1}") for i in range(S - 1)])
    assign = {"x": 0, **{f"n{i}": i for i in range(S)}}
    plan = synthetic_plan(g, assign, replicas, microbatches=12, schedule=schedule)
    sim, _ = simulate_plan(plan, graph=g)
    for s in plan.stages:
        assert max(sim.peak_memory[r] for r in s.ranks) == s.memory_bytes, (s.index, s.memory_bytes)
