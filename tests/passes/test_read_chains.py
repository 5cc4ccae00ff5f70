"""Shape reads of one unit chained in the order they are needed (``read_chains.py``): the placed DPs'
bound stays under the exact placed optimum (the downset DP on the unfolded graph) on crafted and
random graphs, rises over the plain bridged relaxation where cuts separate reads from their readers,
and reads whose readers do not lie on one line of descent stay bridged as before."""
from __future__ import annotations

import math
import random
import time

import pytest

from passes.costgraph import CostGraph
from passes.partition import evaluate, is_convex
from passes.partition.placed import TOLERANCE
from passes.partition.read_chains import chain_reads
from passes.partition.segment_plan import CHAIN_ABOVE, chain_plan
from passes.partition.segments import build_segments, folded_units
from tests.passes.test_partition_scale import _node, transformer_graph
from tests.passes.test_placed import _exact, _opts

LINE = ("q", "qt", "att", "soft", "av", "proj")  # each descends from the one before


def _line_reads(share: float, K: int, readers=LINE, extra=()) -> CostGraph:
    """One untied transformer block with a read of the first layer norm's output for each of ``readers``
    (and ``extra``), each costing ``share`` of sum C / K and sending nothing."""
    g = transformer_graph(1, seed=0, tied=False)
    ideal = g.total_compute_s() / K
    nodes, edges = dict(g.nodes), list(g.edges)
    for i, reader in enumerate(tuple(readers) + tuple(extra)):
        name = f"b0_read{i}"
        nodes[name] = _node(name, cost=share * ideal * (1 + 0.1 * i), out=0, path="blocks.0")
        edges += [("b0_ln1", name), (name, "b0_" + reader)]
    return CostGraph(nodes=nodes, edges=edges, param_sizes=dict(g.param_sizes))


def _chained(g: CostGraph, opts):
    return folded_units(g, opts, tiny_silent=math.inf, bridge=True, chain_above=0.0)[0]


def test_reads_on_one_line_become_a_chain_and_others_stay_bridged():
    """The block's shape read (read by q, k and v) and six reads read along q -> qt -> att -> soft ->
    av -> proj get units of their own, each after the one before, every one's compute bridged from
    the previous; a read by k (beside q) stays bridged from the layer norm's unit to k's. Units stay in
    topological order."""
    g = _line_reads(0.05, 16, extra=("k",))
    opts = _opts(16, 4)
    plain = folded_units(g, opts, tiny_silent=math.inf, bridge=True)[0]
    units = _chained(g, opts)
    chain = ["b0_shape"] + [f"b0_read{i}" for i in range(6)]
    assert len(units) == len(plain) + len(chain) and len(units.bridged) == len(plain.bridged)
    unit_of = units.unit_of()
    reads = [unit_of[n] for n in chain]
    assert reads == sorted(reads) and all(units.members[u] == [n] for n, u in zip(chain, reads))
    assert all(units.compute[u] == 0.0 for u in reads)
    edges = set(units.edges)
    ln1 = unit_of["b0_ln1"]
    assert all((a, b) in edges for a, b in zip([ln1] + reads, reads))
    by_after = {after: before for _, before, after, _ in units.bridged}
    assert [by_after[u] for u in reads] == [ln1] + reads[:-1]
    assert unit_of["b0_read6"] == ln1 and any(after == unit_of["b0_k"] and before == ln1
                                             for _, before, after, _ in units.bridged)
    assert all(a < b for a, b in units.edges)
    assert build_segments(units) is not None


def test_parallel_readers_are_not_chained():
    """Reads by q, k and v (three branches: no order holds in every plan) make no chain beyond the
    block's shape read (read by all three) and the first of them."""
    g = _line_reads(0.05, 16, readers=("q", "k", "v"))
    opts = _opts(16, 4)
    plain = folded_units(g, opts, tiny_silent=math.inf, bridge=True)[0]
    units = _chained(g, opts)
    assert len(units) == len(plain) + 2
    assert {n for members in units.members if len(members) == 1 for n in members} >= {"b0_shape", "b0_read0"}
    assert units.unit_of()["b0_read1"] == units.unit_of()["b0_ln1"] == units.unit_of()["b0_read2"]


CASES = [("fxpipe", "any", 16, 4), ("fxpipe", "pow2", 16, 4), ("pipedream", "any", 16, 4),
         ("fxpipe", "pow2", 8, 2), ("pipedream", "pow2", 8, 4), ("fxpipe", "any", 8, 2)]


@pytest.mark.parametrize("share", [0.03, 0.1, 0.3])
@pytest.mark.parametrize("model,replication,K,G", CASES)
def test_chained_bound_under_the_exact_optimum(model, replication, K, G, share):
    """The placed DP on chained reads (interval or charged) bounds the optimum over every placement of
    the unfolded graph, never below the plain bridged bound (less the bisections' tolerance: both stop
    within ``placed.TOLERANCE`` of their own optimum), and its plan scores as ``evaluate`` scores it,
    convex, on all K devices."""
    g = _line_reads(share, K, extra=("k",))
    opts = _opts(K, G, cost_model=model, replication=replication)
    start = time.monotonic()
    chained = chain_plan(g, opts, start, math.inf, quiet=1e9, chain_reads=True)
    plain = chain_plan(g, opts, start, math.inf, quiet=1e9, bound_only=True, plain=True)
    best = _exact(g, opts, upper=chained.bottleneck_s)
    assert chained.bound_s <= best * (1 + 1e-9) and best <= chained.bottleneck_s * (1 + 1e-9)
    assert chained.bound_s >= plain.bound_s * (1 - 2 * TOLERANCE)
    assert chained.bottleneck_s == pytest.approx(
        evaluate(g, chained.assignment, chained.replicas, opts).bottleneck_s, rel=1e-12)
    assert sum(chained.replicas) == K and is_convex(g, chained.assignment)


def test_chain_raises_the_bound_where_cuts_separate_reads():
    """Reads as costly as a node, read all along the attention: the plain relaxation lets a cut just
    after the layer norm drop them all, the chain at most one per cut; its bound is higher and still
    under the optimum."""
    g = _line_reads(0.3, 16)
    opts = _opts(16, 4, replication="pow2")
    start = time.monotonic()
    chained = chain_plan(g, opts, start, math.inf, quiet=1e9, bound_only=True, plain=True, chain_reads=True)
    plain = chain_plan(g, opts, start, math.inf, quiet=1e9, bound_only=True, plain=True)
    best = _exact(g, opts)
    assert plain.bound_s * 1.01 < chained.bound_s <= best * (1 + 1e-9)


def _random_line(rng: random.Random, most: int):
    """Node names of a random DAG of 10 to ``most`` nodes, each joining the one before it or the one
    before that, its edges (the last into ``out``) and the index of a node to read from."""
    n = rng.randint(10, most)
    names = [f"n{i}" for i in range(n)]
    edges = [(names[i - 1] if rng.random() < 0.7 or i < 2 else names[i - 2], names[i]) for i in range(1, n)]
    edges.append((names[-1], "out"))
    return names, edges, rng.randint(1, n // 2)


def _random_reads(seed: int) -> CostGraph:
    """A random DAG of 10-14 nodes (each joining the one before it or the one before that) with 3-6
    reads of one node, each read by a random later node (some on one line, some not) and costing
    30-100 % of a node; weights on some nodes, so that replicas pay to sync and sum C / K is not
    the answer."""
    rng = random.Random(seed)
    names, edges, src = _random_line(rng, 14)
    reads = {}
    for r in range(rng.randint(3, 6)):
        reads[f"read{r}"] = names[rng.randint(src + 1, len(names) - 1)]
        edges += [(names[src], f"read{r}"), (f"read{r}", reads[f"read{r}"])]
    nodes = {}
    for name in names:  # each read just before its reader: a topological order
        for r in (r for r, reader in reads.items() if reader == name):
            nodes[r] = _node(r, cost=rng.uniform(0.3, 1.0) * 1e-3, out=0)
        nodes[name] = _node(name, cost=rng.uniform(0.5, 1.5) * 1e-3, out=rng.choice([10**5, 10**6, 4 * 10**6]),
                            pbytes=rng.choice([0, 10**6, 10**7]))
    nodes["out"] = _node("out", op="output", cost=0.0, out=0)
    return CostGraph(nodes=nodes, edges=edges, param_sizes={})


def _random_bound_under_exact(g: CostGraph, rng: random.Random) -> None:
    """On a random machine and cost model: the chained bound never passes the exact optimum, the plan
    is convex, and every edge of the graph runs forward in the units the DP planned on."""
    K, G = rng.choice([(2, 1), (4, 2), (4, 1), (8, 4), (8, 2)])
    model, replication = rng.choice([("fxpipe", "any"), ("fxpipe", "pow2"), ("pipedream", "any")])
    g.check()
    opts = _opts(K, G, cost_model=model, replication=replication)
    res = chain_plan(g, opts, time.monotonic(), math.inf, quiet=1e9, chain_reads=True)
    best = _exact(g, opts, upper=res.bottleneck_s)
    assert res.bound_s <= best * (1 + 1e-9) and best <= res.bottleneck_s * (1 + 1e-9)
    assert is_convex(g, res.assignment)
    where = _chained(g, opts).unit_of()
    assert all(where[u] <= where[v] for u, v in g.edges if u in where and v in where)


@pytest.mark.parametrize("seed", range(24))
def test_random_reads_bound_under_the_exact_optimum(seed):
    """Random graphs, reads and machines: the chained bound never passes the exact optimum."""
    rng = random.Random(1000 + seed)
    _random_bound_under_exact(_random_reads(seed), rng)


def test_reads_worth_too_little_are_not_chained():
    """Reads whose chain could give a cut less than ``CHAIN_ABOVE`` of sum C / K (a CPU profile's
    shape reads) stay bridged: a larger lattice for nothing. Worth more, they chain."""
    opts = _opts(16, 4)
    cheap, dear = _line_reads(2e-4, 16), _line_reads(0.05, 16)
    for g, chained in ((cheap, False), (dear, True)):
        ideal = g.total_compute_s() / 16
        plain = folded_units(g, opts, tiny_silent=math.inf, bridge=True)[0]
        units = folded_units(g, opts, tiny_silent=math.inf, bridge=True, chain_above=CHAIN_ABOVE * ideal)[0]
        assert (len(units) > len(plain)) == chained


def test_chain_reads_leaves_units_without_chains_alone():
    """No unit with two reads bridged from it: the same units come back."""
    g = transformer_graph(2, seed=1, tied=False)
    opts = _opts(8, 4)
    units, folded = folded_units(g, opts, tiny_silent=math.inf, bridge=True)
    reads = [n for n in g.nodes if n.endswith("_shape")]
    assert len(units.bridged) == len(reads) == 2
    same, folded2 = chain_reads(g, opts, units, folded, reads, {n: i for i, n in enumerate(g.nodes)})
    assert same is units and folded2 is folded


def _gpt_reads(share: float, K: int) -> CostGraph:
    """One untied transformer block with the benchmark GPT's reads: the shape (read by q, k, v), its
    width ``dim`` (read by q, k, v and the four head sizes), a head size per branch (``hq``, ``hk``,
    ``hv``, each read by its branch) and one for the scale (``hs``, read only by the read ``scale``,
    which ``att`` reads). Each costs ``share`` of sum C / K and sends nothing."""
    g = transformer_graph(1, seed=0, tied=False)
    ideal = g.total_compute_s() / K
    nodes, edges = dict(g.nodes), list(g.edges)
    reads = {"b0_dim": (["b0_shape"], ["b0_q", "b0_k", "b0_v"]), "b0_hq": (["b0_dim"], ["b0_q"]),
             "b0_hk": (["b0_dim"], ["b0_k"]), "b0_hv": (["b0_dim"], ["b0_v"]), "b0_hs": (["b0_dim"], []),
             "b0_scale": (["b0_hs"], ["b0_att"])}
    order = list(nodes)
    for i, (name, (producers, readers)) in enumerate(reads.items()):
        nodes[name] = _node(name, cost=share * ideal * (1 + 0.1 * i), out=0, path="blocks.0")
        edges += [(p, name) for p in producers] + [(name, r) for r in readers]
    nodes["b0_shape"] = _node("b0_shape", cost=share * ideal, out=0, path="blocks.0")
    at = order.index("b0_shape") + 1  # the reads right after the shape: a topological order
    order[at:at] = list(reads)
    return CostGraph(nodes={n: nodes[n] for n in order}, edges=edges, param_sizes=dict(g.param_sizes))


def test_reads_of_reads_chain_and_branch_reads_move_to_their_reader():
    """Reads read by reads take the first end of their readers' windows: the shape with its width (one
    link: the width reads the shape and their windows end together), q's head size, then the scale's
    head size with the scale (one link) chain in that order. The k and v head sizes (beside q's) read
    the chained width, so they cannot stay in the layer norm's unit: each moves into its reader's
    unit, after its first node, its compute still bridged from the layer norm's unit."""
    g = _gpt_reads(0.05, 16)
    opts = _opts(16, 4)
    plain = folded_units(g, opts, tiny_silent=math.inf, bridge=True)[0]
    units = _chained(g, opts)
    links = [["b0_shape", "b0_dim"], ["b0_hq"], ["b0_hs", "b0_scale"]]
    unit_of = units.unit_of()
    reads = [unit_of[link[0]] for link in links]
    assert len(units) == len(plain) + len(links) and reads == sorted(reads)
    assert all(units.members[u] == link and units.compute[u] == 0.0 for link, u in zip(links, reads))
    ln1 = unit_of["b0_ln1"]
    assert all((a, b) in set(units.edges) for a, b in zip([ln1] + reads, reads))
    charged = {(b, a) for _, b, a, _ in units.bridged}
    assert all((a, b) in charged for a, b in zip([ln1] + reads, reads))
    for read, reader in (("b0_hk", "b0_k"), ("b0_hv", "b0_v")):
        home = unit_of[reader]
        assert unit_of[read] == home and units.members[home][:2] == [reader, read]
        assert any(b == ln1 and a == home == h for _, b, a, h in units.bridged)
    assert all(a < b for a, b in units.edges)
    where = units.unit_of()
    assert all(where[u] <= where[v] for u, v in g.edges if u in where and v in where)


@pytest.mark.parametrize("share", [0.05, 0.3])
@pytest.mark.parametrize("model,replication,K,G", CASES[:4])
def test_reads_of_reads_bound_under_the_exact_optimum(model, replication, K, G, share):
    """Chains through reads of reads, with reads moved into their readers' units: the bound stays under
    the exact optimum and not under the plain bridged one; the plan scores as ``evaluate`` scores it."""
    g = _gpt_reads(share, K)
    opts = _opts(K, G, cost_model=model, replication=replication)
    start = time.monotonic()
    chained = chain_plan(g, opts, start, math.inf, quiet=1e9, chain_reads=True)
    plain = chain_plan(g, opts, start, math.inf, quiet=1e9, bound_only=True, plain=True)
    best = _exact(g, opts, upper=chained.bottleneck_s)
    assert plain.bound_s * (1 - 2 * TOLERANCE) <= chained.bound_s <= best * (1 + 1e-9)
    assert best <= chained.bottleneck_s * (1 + 1e-9)
    assert chained.bottleneck_s == pytest.approx(
        evaluate(g, chained.assignment, chained.replicas, opts).bottleneck_s, rel=1e-12)
    assert sum(chained.replicas) == K and is_convex(g, chained.assignment)


def _random_read_tree(seed: int) -> CostGraph:
    """``_random_reads`` with reads of reads: each read reads the source node or an earlier read, and
    is read by a random later node, by reads only, or both."""
    rng = random.Random(seed)
    names, edges, src = _random_line(rng, 13)
    reads, fed = [], set()
    for r in range(rng.randint(4, 7)):
        name = f"read{r}"
        producer = names[src] if not reads or rng.random() < 0.4 else rng.choice(reads)
        edges.append((producer, name))
        fed.add(producer)
        reads.append(name)
    for r in reads:
        if r not in fed or rng.random() < 0.6:
            edges.append((r, names[rng.randint(src + 1, len(names) - 1)]))
    nodes = {}
    for name in names:
        nodes[name] = _node(name, cost=rng.uniform(0.5, 1.5) * 1e-3, out=rng.choice([10**5, 10**6, 4 * 10**6]),
                            pbytes=rng.choice([0, 10**6, 10**7]))
        if name == names[src]:
            nodes.update({r: _node(r, cost=rng.uniform(0.3, 1.0) * 1e-3, out=0) for r in reads})
    nodes["out"] = _node("out", op="output", cost=0.0, out=0)
    return CostGraph(nodes=nodes, edges=edges, param_sizes={})


@pytest.mark.parametrize("seed", range(24))
def test_random_read_trees_bound_under_the_exact_optimum(seed):
    """Random graphs whose reads read reads: the chained bound never passes the exact optimum."""
    _random_bound_under_exact(_random_read_tree(seed), random.Random(2000 + seed))
