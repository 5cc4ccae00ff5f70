"""The partitioner against independent references: a chain DP, brute force on small DAGs,
a hand-computed PipeDream number, memory limits and the infeasibility message."""
from __future__ import annotations

import functools
import itertools
import random
import re
import time

import pytest

from passes.costgraph import CostGraph, CostNode
from passes.partition import InfeasibleError, evaluate, is_convex, partition

B, BAR = 1.0e9, 2.0e9
from tests.profiles import PROFILES


def make_graph(n: int, edges, rng: random.Random, output: bool) -> CostGraph:
    nodes = {}
    for i in range(n):
        is_input = i == 0
        is_output = output and i == n - 1
        zero = is_input or is_output
        nodes[f"n{i}"] = CostNode(
            name=f"n{i}", op="output" if is_output else ("placeholder" if is_input else "call_module"),
            target="t", fwd_s=0.0 if zero else rng.uniform(1e-3, 1e-2), bwd_s=0.0 if zero else rng.uniform(1e-3, 2e-2),
            out_bytes=0 if is_output else rng.randint(1, 10) * 10**6,
            param_bytes=0 if zero else rng.choice([0, 10**6, 10**7]), is_input=is_input)
    return CostGraph(nodes=nodes, edges=[(f"n{u}", f"n{v}") for u, v in edges])


def random_dag(n: int, seed: int, output: bool = True) -> CostGraph:
    rng = random.Random(seed)
    edges = set()
    for v in range(1, n):
        edges.add((rng.randrange(0, v), v))
        for u in range(v):
            if rng.random() < 0.2:
                edges.add((u, v))
    if output:
        edges |= {(u, n - 1) for u in range(1, n - 1) if not any(a == u for a, _ in edges)}
    return make_graph(n, sorted(edges), rng, output)


def reference_cost(g: CostGraph, stage, reps, model: str) -> float:
    """The cost models written again from their definitions (not the library's code)."""
    worst = 0.0
    for j, r in enumerate(reps):
        c = sum(nd.fwd_s + nd.bwd_s for n, nd in g.nodes.items() if stage[n] == j)
        p = sum(nd.param_bytes for n, nd in g.nodes.items() if stage[n] == j)
        t = (c + 4 * (r - 1) * p / (B * r)) / r if model == "pipedream" else c / r + 2 * (r - 1) / r * p / BAR
        worst = max(worst, t)
    for b in range(len(reps) - 1):
        crossing = {u for u, v in g.edges if stage[u] <= b < stage[v]}
        if model == "fxpipe":
            crossing = {u for u in crossing if not g.nodes[u].is_input}
        a = sum(g.nodes[u].out_bytes for u in crossing)
        worst = max(worst, 2 * a / (B * min(reps[b], reps[b + 1])))
    return worst


def valid(g: CostGraph, stage, S: int, model: str) -> bool:
    if any(stage[u] > stage[v] for u, v in g.edges):
        return False
    work = {stage[n] for n, nd in g.nodes.items() if not nd.is_input and nd.op != "output"}
    if work != set(range(S)):
        return False
    if any(nd.op == "output" and stage[n] != S - 1 for n, nd in g.nodes.items()):
        return False
    return model == "fxpipe" or all(stage[n] == 0 for n, nd in g.nodes.items() if nd.is_input)


def monotone_assignments(g: CostGraph, S: int):
    """Every map of the nodes to stages ``0 .. S-1`` with no edge going back (``valid``'s first rule),
    made node by node in a topological order, each node at or after its producers' stages: the same
    maps as filtering all ``S ** n`` of them, without walking the others."""
    preds = {n: [] for n in g.nodes}
    for u, v in g.edges:
        preds[v].append(u)
    order, seen = [], set()

    def visit(n):
        if n not in seen:
            seen.add(n)
            for u in preds[n]:
                visit(u)
            order.append(n)

    for n in g.nodes:
        visit(n)
    stage: dict = {}

    def walk(i: int):
        if i == len(order):
            yield dict(stage)
            return
        n = order[i]
        for s in range(max((stage[u] for u in preds[n]), default=0), S):
            stage[n] = s
            yield from walk(i + 1)
        del stage[n]

    yield from walk(0)


def brute_force(g: CostGraph, K: int, model: str, allowed) -> float:
    best = float("inf")
    for S in range(1, K + 1):
        rep_vectors = [v for v in itertools.product(allowed, repeat=S) if sum(v) == K]
        if not rep_vectors:
            continue
        for stage in monotone_assignments(g, S):
            if valid(g, stage, S, model):
                best = min(best, min(reference_cost(g, stage, v, model) for v in rep_vectors))
    return best


@pytest.mark.parametrize("method", ["cpsat", "auto"])  # auto: the exact segment DP
@pytest.mark.parametrize("model", ["pipedream", "fxpipe"])
@pytest.mark.parametrize("seed,n,K", [(1, 6, 3), (2, 7, 3), (3, 7, 2), (4, 8, 2), (5, 6, 4)])
def test_brute_force_random_dags(method, model, seed, n, K):
    g = random_dag(n, seed, output=seed % 2 == 1)
    res = partition(g, K, bandwidth=B, allreduce_bandwidth=BAR, cost_model=model, time_limit=20, solver=method)
    # auto: the segment DP, or the downset DP where it cannot spread its plan over exactly K devices
    assert res.method in (("CP-SAT",) if method == "cpsat" else ("segment DP", "downset DP"))
    expected = brute_force(g, K, model, range(1, K + 1))
    assert is_convex(g, res.assignment)
    assert sum(res.replicas) == K
    assert res.bottleneck_s == pytest.approx(reference_cost(g, res.assignment, res.replicas, model), rel=1e-9)
    assert expected <= res.bottleneck_s <= expected * 1.001
    assert res.bound_s <= expected * (1 + 1e-9)


def test_brute_force_straight_pipeline():
    g = random_dag(8, 11)
    res = partition(g, 3, bandwidth=B, allreduce_bandwidth=BAR, replication="none", time_limit=20, solver="cpsat")
    assert res.replicas == [1, 1, 1]
    assert res.bottleneck_s <= brute_force(g, 3, "fxpipe", [1]) * 1.001


def test_monotone_assignments_are_the_filtered_product():
    g = random_dag(7, 3, output=True)
    for S in (1, 2, 3):
        every = [dict(zip(g.nodes, c)) for c in itertools.product(range(S), repeat=len(g.nodes))]
        want = sorted(tuple(sorted(a.items())) for a in every if not any(a[u] > a[v] for u, v in g.edges))
        got = sorted(tuple(sorted(a.items())) for a in monotone_assignments(g, S))
        assert got == want
        assert S == 1 or len(got) < S ** len(g.nodes)


def chain_dp(costs, params, acts, K: int, model: str) -> float:
    """Exact DP over cut points of a chain: state (first node of the stage, devices left, replicas before)."""
    n = len(costs)

    @functools.lru_cache(maxsize=None)
    def best(i: int, left: int, r_prev: int) -> float:
        if i == n:
            return 0.0 if left == 0 else float("inf")
        out = float("inf")
        for j in range(i + 1, n + 1):
            c, p = sum(costs[i:j]), sum(params[i:j])
            for r in range(1, left + 1):
                t = (c + 4 * (r - 1) * p / (B * r)) / r if model == "pipedream" else c / r + 2 * (r - 1) / r * p / BAR
                if i > 0:
                    t = max(t, 2 * acts[i - 1] / (B * min(r, r_prev)))
                out = min(out, max(t, best(j, left - r, r)))
        return out

    return best(0, K, 0)


@pytest.mark.parametrize("method", ["cpsat", "auto"])
@pytest.mark.parametrize("model", ["pipedream", "fxpipe"])
@pytest.mark.parametrize("seed,n,K", [(0, 8, 4), (1, 12, 6), (2, 20, 8)])
def test_chain_dp(method, model, seed, n, K):
    rng = random.Random(seed)
    g = make_graph(n, [(i, i + 1) for i in range(n - 1)], rng, output=False)
    names = list(g.nodes)[1:]  # the input node has no cost and sits with the first stage
    costs = [g.nodes[x].compute_s for x in names]
    params = [g.nodes[x].param_bytes for x in names]
    acts = [g.nodes[x].out_bytes for x in names]
    expected = chain_dp(tuple(costs), tuple(params), tuple(acts), K, model)
    res = partition(g, K, bandwidth=B, allreduce_bandwidth=BAR, cost_model=model, time_limit=20, solver=method)
    assert expected <= res.bottleneck_s * (1 + 1e-9)
    assert res.bottleneck_s <= expected * 1.001
    assert res.status == "OPTIMAL"


def _pipedream_file(name: str):
    """Parse graph.txt with a separate regex: (name, ms fwd+bwd, activation bytes, param bytes), edges."""
    nodes, edges = {}, []
    for line in (PROFILES / f"{name}.txt").read_text().splitlines():
        m = re.match(r"^(node\d+) -- (\w+).*forward_compute_time=([\d.]+), backward_compute_time=([\d.]+), "
                     r"activation_size=([\d.]+), parameter_size=([\d.]+)", line)
        if m:
            ms = 0.0 if m[2].startswith("Input") else float(m[3]) + float(m[4])
            nodes[m[1]] = (ms, float(m[5]), float(m[6]))
        elif line.startswith("\t"):
            edges.append(tuple(x.strip() for x in line.split("--")))
    return nodes, edges


def test_pipedream_model_hand_computed_vgg16():
    nodes, edges = _pipedream_file("vgg16")
    order = sorted(nodes, key=lambda x: int(x[4:]))
    bounds, reps, bw = [0, 25, 32, len(order)], [13, 2, 1], 1.25e9
    stage = {x: next(j for j in range(3) if bounds[j] <= i < bounds[j + 1]) for i, x in enumerate(order)}
    times = []
    for j, r in enumerate(reps):
        c = sum(nodes[x][0] for x in order if stage[x] == j) / 1e3
        p = sum(nodes[x][2] for x in order if stage[x] == j)
        times.append((c + 4 * (r - 1) * p / (bw * r)) / r)
    for j in range(2):
        a = sum(nodes[u][1] for u in {u for u, v in edges if stage[u] <= j < stage[v]})
        times += [2 * a / (bw * reps[j]), 2 * a / (bw * reps[j + 1])]
    expected = max(times)
    g = CostGraph.load(PROFILES / "vgg16.txt")
    ev = evaluate(g, stage, reps, _opts(16, "pipedream"))
    assert ev.bottleneck_s == pytest.approx(expected, rel=1e-9)


def _opts(K, model, **kw):
    from passes.partition import CostOptions

    return CostOptions(devices=K, bandwidth=1.25e9, cost_model=model, **kw)


def test_vgg16_matches_pipedream_optimum():
    g = CostGraph.load(PROFILES / "vgg16.txt")
    res = partition(g, 16, bandwidth=1.25e9, cost_model="pipedream", time_limit=20, solver="cpsat")
    assert res.bottleneck_s <= 0.0548 * 1.001
    assert res.replicas == [13, 2, 1]


@pytest.mark.parametrize("schedule", ["1f1b-stash", "gpipe"])
def test_memory_limit_respected_and_infeasible_message(schedule):
    g = random_dag(9, 7)
    free = partition(g, 4, bandwidth=B, schedule=schedule, microbatches=4, time_limit=20)
    peak = max(s.memory_bytes for s in free.stages)
    with pytest.raises(InfeasibleError, match="a plan fits in") as info:
        partition(g, 4, bandwidth=B, schedule=schedule, microbatches=4, memory=1000, time_limit=20)
    stated = int(re.search(r"a plan fits in [^(]*\((\d+) bytes\)", str(info.value))[1])
    assert stated <= peak
    fit = partition(g, 4, bandwidth=B, schedule=schedule, microbatches=4, memory=int(stated * 1.001) + 1, time_limit=20)
    assert is_convex(g, fit.assignment)
    assert max(s.memory_bytes for s in fit.stages) <= int(stated * 1.001) + 1
    tight = int(peak * 0.9)
    if tight >= stated * 1.001:
        res = partition(g, 4, bandwidth=B, schedule=schedule, microbatches=4, memory=tight, time_limit=20)
        assert max(s.memory_bytes for s in res.stages) <= tight


def test_downset_dp_on_resnet50_matches_pipedream_and_cpsat():
    g = CostGraph.load(PROFILES / "resnet50.txt")
    exact = partition(g, 8, bandwidth=1.25e9, cost_model="pipedream")
    assert exact.method == "segment DP" and exact.status == "OPTIMAL"  # PipeDream: 4-3-1; 4-2-2 ties it
    assert exact.bottleneck_s <= 0.0822 * 1.001
    cp = partition(g, 8, bandwidth=1.25e9, cost_model="pipedream", solver="cpsat", time_limit=30)
    assert cp.bottleneck_s == pytest.approx(exact.bottleneck_s, rel=1e-3)


def test_too_many_devices_without_replication():
    g = random_dag(5, 3)
    with pytest.raises(InfeasibleError, match="--devices 3"):
        partition(g, 6, replication="none")


def test_pow2_replication():
    g = random_dag(6, 5)
    res = partition(g, 4, bandwidth=B, allreduce_bandwidth=BAR, replication="pow2", time_limit=20, solver="cpsat")
    assert all(r & (r - 1) == 0 for r in res.replicas) and sum(res.replicas) == 4
    assert res.bottleneck_s <= brute_force(g, 4, "fxpipe", [1, 2, 4]) * 1.001


def test_apply_assignment_writes_stage_records():
    import torch.fx

    from passes import meta
    from passes.partition import apply_assignment
    from tests.models import MLP

    gm = torch.fx.symbolic_trace(MLP())
    names = [n.name for n in gm.graph.nodes]
    apply_assignment(gm, {name: i % 2 for i, name in enumerate(names)})
    assert [meta.get(n, meta.StageAssign).stage for n in gm.graph.nodes] == [i % 2 for i in range(len(names))]


def test_tied_weight_counts_in_every_stage_that_uses_it():
    """A parameter used by two nodes (tied embeddings) is held, and all-reduced, by each stage using it."""
    from dataclasses import replace

    from passes.partition import CostOptions

    g = random_dag(7, 21, output=False)
    g.param_sizes = {"emb": 4 * 10**8, "w2": 10**6}
    g.nodes["n1"] = replace(g.nodes["n1"], params=("emb",), param_bytes=4 * 10**8)
    g.nodes["n6"] = replace(g.nodes["n6"], params=("emb",), param_bytes=0)
    g.nodes["n2"] = replace(g.nodes["n2"], params=("w2",), param_bytes=10**6)
    for n in ("n3", "n4", "n5"):
        g.nodes[n] = replace(g.nodes[n], param_bytes=0)
    opts = CostOptions(devices=3, bandwidth=B, allreduce_bandwidth=BAR)
    res = partition(g, 3, bandwidth=B, allreduce_bandwidth=BAR, time_limit=20)
    assert res.method in ("segment DP", "CP-SAT")  # the segment DP counts a shared weight once per stage
    cp = partition(g, 3, bandwidth=B, allreduce_bandwidth=BAR, time_limit=20, solver="cpsat")
    assert cp.bottleneck_s == pytest.approx(res.bottleneck_s, rel=1e-3)
    best = float("inf")
    for S in (1, 2, 3):
        for stage in monotone_assignments(g, S):
            if valid(g, stage, S, "fxpipe"):
                for reps in (v for v in itertools.product(range(1, 4), repeat=S) if sum(v) == 3):
                    best = min(best, evaluate(g, stage, reps, opts).bottleneck_s)
    assert best <= res.bottleneck_s <= best * 1.001
    assert max(res.bound_s, cp.bound_s) <= best * (1 + 1e-9)  # the solvers' floor for the tie keeps bounds valid


def tied_reference_cost(g: CostGraph, stage, reps, model: str, tied: str) -> float:
    """``reference_cost`` with weight ``tied`` shared by several nodes: every stage holding it all-reduces
    it over all ranks of all stages holding it (a ring of n ranks), written from that definition."""
    users = [n for n, nd in g.nodes.items() if tied in nd.params]
    holders = {stage[n] for n in users}
    size = g.param_sizes[tied]
    group = sum(reps[j] for j in holders)
    worst = reference_cost(g, stage, reps, model)  # the cuts (compute terms are recomputed below)
    for j, r in enumerate(reps):
        c = sum(nd.fwd_s + nd.bwd_s for n, nd in g.nodes.items() if stage[n] == j)
        own = sum(nd.param_bytes for n, nd in g.nodes.items() if stage[n] == j and n not in users)
        own += size if holders == {j} else 0
        sync = 0.0
        if j in holders and len(holders) > 1:
            sync = 4 * (group - 1) * size / (B * group * r) if model == "pipedream" else 2 * (group - 1) / group * size / BAR
        t = (c + 4 * (r - 1) * own / (B * r)) / r if model == "pipedream" else c / r + 2 * (r - 1) / r * own / BAR
        worst = max(worst, t + sync)
    return worst


@pytest.mark.parametrize("method", ["cpsat", "auto"])
@pytest.mark.parametrize("model", ["pipedream", "fxpipe"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tied_weight_with_replicas_is_charged_its_group_under_a_valid_bound(method, model, seed):
    from dataclasses import replace

    g = random_dag(6, seed, output=False)
    first, last = "n1", "n5"
    g.param_sizes = {"emb": 10**6}  # small enough that some best plans split it over replicated stages
    g.nodes[first] = replace(g.nodes[first], params=("emb",), param_bytes=10**6)
    g.nodes[last] = replace(g.nodes[last], params=("emb",), param_bytes=0)
    K = 4
    res = partition(g, K, bandwidth=B, allreduce_bandwidth=BAR, cost_model=model, time_limit=20, solver=method)
    assert res.bottleneck_s == pytest.approx(tied_reference_cost(g, res.assignment, res.replicas, model, "emb"),
                                             rel=1e-9)
    best = float("inf")
    for S in range(1, K + 1):
        vectors = [v for v in itertools.product(range(1, K + 1), repeat=S) if sum(v) == K]
        for stage in monotone_assignments(g, S):
            if valid(g, stage, S, model):
                best = min(best, min(tied_reference_cost(g, stage, v, model, "emb") for v in vectors))
    assert res.bound_s <= best * (1 + 1e-9) and res.bottleneck_s >= best * (1 - 1e-9)
    assert (res.status == "OPTIMAL") == (res.gap <= 1e-3)


@pytest.mark.parametrize("seed", range(6))
def test_downset_enumeration_equals_brute_force(seed):
    """``downsets_from`` (each downset carries the nodes that can join it) against every subset of a
    random DAG: the same downsets, smallest first, the start first and the full set last, a set
    holding an output node only as the full one; None past the limit."""
    from passes.partition.downsets import downsets_from
    rng = random.Random(seed)
    n = 11
    pred = [0] * n
    for v in range(1, n):
        for u in range(v):
            if rng.random() < 0.25:
                pred[v] |= 1 << u
    start, outputs, full = 1, 1 << (n - 1), (1 << n) - 1
    pred[0] = 0
    want = [m for m in range(1 << n) if m & start and all(not (m >> v) & 1 or not pred[v] & ~m for v in range(n))
            and (not m & outputs or m == full)]
    got = downsets_from(pred, start, outputs, 10 ** 6)
    assert got is not None and sorted(got) == sorted(want) and len(got) == len(set(got))
    assert got[0] == start and got[-1] == full
    assert [bin(m).count("1") for m in got] == sorted(bin(m).count("1") for m in got)
    assert downsets_from(pred, start, outputs, len(want) - 1) is None


def test_a_plan_no_search_proved_is_still_bounded_by_sum_compute_over_k(monkeypatch):
    """Where CP-SAT has no time to start, the order DP's plan answers (HEURISTIC); its bound is
    sum C / K, which every plan meets, not 0 (inception_v3 on 32 devices read a 100 % gap)."""
    from passes.partition import driver
    from passes.partition.coarsen import ideal_s
    monkeypatch.setattr(driver, "_time_for_cpsat", lambda units, opts, deadline: False)
    g = CostGraph.load(PROFILES / "resnet50.txt")
    res = partition(g, 8, solver="cpsat", time_limit=5)
    assert res.status == "HEURISTIC" and res.method == "CP-SAT"
    assert res.bound_s == pytest.approx(ideal_s(g, res.options), rel=1e-12) and 0 < res.bound_s <= res.bottleneck_s


def test_time_the_coarsened_search_leaves_goes_to_every_node():
    """inception_v3 (325 units, coarsened for CP-SAT above 300) on 8 devices at 1.25 GB/s: the
    coarsened run proves its restricted optimum in seconds, a plan 10 % above the graph's optimum,
    bounded by sum C / K only (20.7 % open); CP-SAT on every node, started from that plan, proves
    the optimum in the time left, and its bound is the graph's."""
    g = CostGraph.load(PROFILES / "inception_v3.txt")
    # 4-10 s alone here; under the full suite's load on 2 cores the proof once took past 20 s (2026-12-03)
    # and once was not done at 40 s (fresh-clone CI, 2026-12-05; 6 s in eleven runs alone that hour, also
    # beside a busy core), so the limit leaves room: the search returns as soon as it is proven
    # the memory guard once stopped both searches here within 3 s (fresh-clone CI, 2026-12-06): CP-SAT's
    # presolve spiked the process by up to 690 MB (model.py, ``keep_all_feasible_solutions_in_presolve``)
    stops = []
    start = time.monotonic()
    res = partition(g, 8, bandwidth=1.25e9, time_limit=90,
                    progress=lambda line: stops.append(line) if "MB of memory" in line else None)
    assert not stops, stops
    # OPTIMAL needs the bound on every node (the coarsened run's holds for its groups only); the plan
    # may be either run's, as they tie when the coarsened run finds the optimum
    assert res.status == "OPTIMAL" and res.method in ("CP-SAT", "CP-SAT on every node"), \
        (res.status, res.gap, res.method, time.monotonic() - start)
    assert res.bound_s <= res.bottleneck_s == pytest.approx(evaluate(g, res.assignment, res.replicas, res.options).bottleneck_s,
                                                            rel=1e-12)


def test_wall_time_is_the_whole_calls():
    """Each search stamps its wall time when it answers; the answer's is the whole call's, the polish
    and the branchy searches' finish included (inception_v3 on 256 devices said 1.1 s of a 9-s call)."""
    g = CostGraph.load(PROFILES / "inception_v3.txt")
    start = time.monotonic()
    res = partition(g, 64, time_limit=3)
    took = time.monotonic() - start
    assert res.status != "OPTIMAL" and took - 0.05 <= res.wall_s <= took
