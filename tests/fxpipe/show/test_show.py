"""`fxpipe show`: the self-contained page, the terminal view, the CLI."""
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from fxpipe.cli import main
from passes.costgraph import CostGraph, CostNode
from fxpipe.show.data import ShowInput, TraceEvent, load_trace
from fxpipe.show.graph import graph_payload
from fxpipe.show.html import render_html
from fxpipe.show.text import render_text
from fxpipe.show.view import simulate_input

from tests.plans import synthetic_plan
from tests.profiles import PROFILES
ROOT = Path(__file__).resolve().parents[3]


def small_graph():
    """A residual block with module paths, as an fxpipe profile would have."""
    spec = [("x", "placeholder", "", 0.0, 400, 0, True), ("stem_conv", "call_module", "stem.conv", 2e-3, 1024, 4096, False),
            ("stem_relu", "call_module", "stem.relu", 1e-4, 1024, 0, False),
            ("block_conv1", "call_module", "block.conv1", 3e-3, 1024, 8192, False),
            ("block_conv2", "call_module", "block.conv2", 3e-3, 1024, 8192, False),
            ("add", "call_function", "block", 1e-5, 1024, 0, False),
            ("head_fc", "call_module", "head.fc", 1e-3, 40, 2048, False), ("output", "output", "", 0.0, 0, 0, False)]
    nodes = {n: CostNode(n, op, n, f, 2 * f, out, p, module_path=mp, is_input=inp)
             for n, op, mp, f, out, p, inp in spec}
    edges = [("x", "stem_conv"), ("stem_conv", "stem_relu"), ("stem_relu", "block_conv1"),
             ("block_conv1", "block_conv2"), ("block_conv2", "add"), ("stem_relu", "add"), ("add", "head_fc"),
             ("head_fc", "output")]
    return CostGraph(nodes, edges, param_sizes={})


SMALL_ASSIGN = {"x": 0, "stem_conv": 0, "stem_relu": 0, "block_conv1": 1, "block_conv2": 1, "add": 2,
                "head_fc": 2, "output": 2}


def split_by_compute(graph, S):
    total, acc, out = graph.total_compute_s(), 0.0, {}
    for name, node in graph.nodes.items():
        out[name] = min(S - 1, int(acc / total * S))
        acc += node.compute_s
    return out


def embedded_data(page):
    m = re.search(r'<script type="application/json" id="fxpipe-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def check_page(page, graph, plan):
    assert "http://" not in page and "https://" not in page
    assert not re.search(r'(src|href)\s*=\s*["\'](?!#)', page), "the page must not load anything"
    data = embedded_data(page)
    assert {n["name"] for n in data["graph"]["nodes"]} == set(graph.nodes)
    for name in graph.nodes:
        assert json.dumps(name) in page
    body = page.split("<tbody>")[1].split("</tbody>")[0]
    assert body.count("<tr") == len(plan.stages)
    assert body.count('class="bottleneck"') >= 1
    for j in range(len(plan.stages)):
        assert f"stage {j}" in page or f">{j}</td>" in page
    assert {n["stage"] for n in data["graph"]["nodes"]} == set(range(len(plan.stages)))
    world = sum(s.replicas for s in plan.stages)
    assert sorted(map(int, data["sim"]["ranks"])) == list(range(world))
    return data


def test_small_graph_page_is_self_contained_and_complete():
    g = small_graph()
    plan = synthetic_plan(g, SMALL_ASSIGN, [1, 1, 1], batch_size=4)
    d = ShowInput(plan, g, "small")
    sim, layout = simulate_input(d)
    data = check_page(render_html(d, sim, layout), g, plan)
    assert data["graph"]["collapsed"] is False
    assert "stem.conv (1)" in {grp["label"] for grp in data["graph"]["groups"]}  # deepest paths that fit
    coarse = graph_payload(g, SMALL_ASSIGN, max_groups=4)
    labels = sorted((grp["stage"], grp["label"]) for grp in coarse["groups"])
    # module subtrees, split where a stage boundary cuts them (block: stage 1 and stage 2)
    assert labels == [(0, "stem (2)"), (0, "x"), (1, "block (2)"), (2, "block (1)"), (2, "head (1)"), (2, "output")]


def test_large_pipedream_graph_collapses_by_groups_and_stays_fast():
    g = CostGraph.load(PROFILES / "nasnetamobile.txt")
    assert len(g.nodes) > 500
    plan = synthetic_plan(g, split_by_compute(g, 3), [2, 1, 1], batch_size=32, microbatches=8)
    d = ShowInput(plan, g, "nasnetamobile")
    start = time.perf_counter()
    sim, layout = simulate_input(d)
    page = render_html(d, sim, layout)
    assert time.perf_counter() - start < 5.0
    data = check_page(page, g, plan)
    graph = data["graph"]
    assert graph["collapsed"] and 10 <= len(graph["groups"]) <= 100
    for grp in graph["groups"]:
        assert len({graph["nodes"][i]["stage"] for i in grp["members"]}) == 1
    assert sorted(i for grp in graph["groups"] for i in grp["members"]) == list(range(len(g.nodes)))


def test_groups_without_module_paths_keep_the_collapsed_graph_acyclic():
    g = CostGraph.load(PROFILES / "nasnetalarge.txt")
    p = graph_payload(g, split_by_compute(g, 4))
    group = [n["group"] for n in p["nodes"]]
    for u, v in p["edges"]:
        assert group[u] <= group[v]


@pytest.mark.skipif(shutil.which("node") is None, reason="node.js not installed")
def test_drawing_script_parses(tmp_path):
    from fxpipe.show.assets import JS
    (tmp_path / "v.js").write_text(JS)
    subprocess.run(["node", "--check", str(tmp_path / "v.js")], check=True)


def write_outdir(folder, graph, assignment, replicas):
    folder.mkdir(parents=True, exist_ok=True)
    plan = synthetic_plan(graph, assignment, replicas, batch_size=4, microbatches=4)
    (folder / "plan.json").write_text(json.dumps(plan.to_json()))
    graph.save(folder / "profile.json")
    return plan


def test_cli_writes_page_with_measured_trace(tmp_path, capsys):
    write_outdir(tmp_path / "out", small_graph(), SMALL_ASSIGN, [1, 1, 1])
    trace = [{"ph": "X", "pid": r, "tid": 0, "name": n, "ts": 1000 + 10 * i, "dur": 8}
             for r in range(3) for i, n in enumerate(["F0", "F1", "B0", "B1", "STEP"])]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": trace}))
    assert main(["show", str(tmp_path / "out"), "--trace", str(tmp_path / "trace.json")]) == 0
    page = (tmp_path / "out" / "view.html").read_text()
    data = embedded_data(page)
    assert sorted(data["measured"]["ranks"]) == ["0", "1", "2"]
    assert data["measured"]["ranks"]["0"][0] == [0.0, 8e-6, "F0", "F"]
    assert "http://" not in page and "https://" not in page
    assert "wrote" in capsys.readouterr().out


def test_cli_text_view(tmp_path, capsys):
    write_outdir(tmp_path, small_graph(), SMALL_ASSIGN, [2, 1, 1])
    assert main(["show", str(tmp_path), "--text", "--schedule", "gpipe", "--microbatches", "4", "--width", "60"]) == 0
    out = capsys.readouterr().out
    assert "stage time" in out and "* bottleneck stage" in out
    lanes = [line for line in out.splitlines() if re.match(r"r\d+\s+s\d", line)]
    assert len(lanes) == 4 and all(len(line.split("|")[1]) == 60 for line in lanes)
    assert "gpipe: 4 microbatches" in out and "F0" in out and "B" in out


def test_plain_plan_without_profile_says_so(tmp_path, capsys):
    g = small_graph()
    plan = synthetic_plan(g, SMALL_ASSIGN, [1, 1, 1])
    (tmp_path / "p.json").write_text(json.dumps(plan.to_json()))
    assert main(["show", str(tmp_path / "p.json")]) == 0
    page = (tmp_path / "p.html").read_text()
    assert embedded_data(page)["graph"] is None
    assert "graph view unavailable" in capsys.readouterr().err
    assert "graph view unavailable" in page


def test_cli_dot_and_errors(tmp_path, capsys):
    write_outdir(tmp_path, small_graph(), SMALL_ASSIGN, [1, 1, 1])
    assert main(["show", str(tmp_path), "--format", "dot", "-o", str(tmp_path / "g.dot")]) == 0
    dot = (tmp_path / "g.dot").read_text()
    assert dot.startswith("digraph") and "stem_conv" in dot and "dashed" in dot
    assert main(["show", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["show", str(tmp_path / "empty")]) == 2
    assert "no plan.json" in capsys.readouterr().err


def test_trace_loader(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps([{"ph": "X", "pid": 1, "name": "SEND_F0>r2", "ts": 5, "dur": 2},
                                                 {"ph": "B", "pid": 0, "name": "x", "ts": 1}]))
    assert load_trace(str(tmp_path / "t.json")) == {1: [TraceEvent(0.0, 2e-6, "SEND_F0>r2", "comm")]}
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(Exception, match="no complete"):
        load_trace(str(tmp_path / "bad.json"))


def test_text_view_of_replicated_plan():
    g = CostGraph.load(PROFILES / "vgg16.txt")
    plan = synthetic_plan(g, split_by_compute(g, 2), [3, 1], batch_size=32, microbatches=6)
    d = ShowInput(plan, g, "vgg16")
    sim, layout = simulate_input(d, kind="1f1b-stash", microbatches=6)
    text = render_text(plan, sim, layout, d.notes)
    assert "1f1b-stash: 6 minibatches" in text
    assert text.count("\nr") == 4


def test_real_partitioner_plan_end_to_end(tmp_path, capsys):
    from fxpipe.plan import plan_from_result
    from passes.partition import partition

    g = CostGraph.load(PROFILES / "resnet50.txt")
    result = partition(g, 4, time_limit=10, schedule="1f1b-flush", microbatches=8)
    plan_from_result(result, g, batch_size=128).save(tmp_path / "plan.json")
    g.save(tmp_path / "profile.json")
    assert main(["show", str(tmp_path), "--text"]) == 0
    out = capsys.readouterr().out
    assert "1f1b-flush: 8 microbatches" in out and out.count("\nr") == 4
    assert main(["show", str(tmp_path)]) == 0
    page = (tmp_path / "view.html").read_text()
    data = embedded_data(page)
    assert len(data["graph"]["nodes"]) == len(g.nodes) and "http" not in page


@pytest.mark.skipif(shutil.which("node") is None, reason="node.js not installed")
def test_page_script_expands_and_collapses_groups(tmp_path):
    """Run the page's script under node with a tiny DOM stand-in and press its buttons."""
    g = CostGraph.load(PROFILES / "nasnetamobile.txt")
    plan = synthetic_plan(g, split_by_compute(g, 3), [2, 1, 1], batch_size=32, microbatches=8)
    d = ShowInput(plan, g, "nasnetamobile")
    sim, layout = simulate_input(d)
    measured = {r: [[e.start, e.end, str(e.action), "F"] for e in evs if e.kind == "compute"]
                for r, evs in sim.events.items()}
    (tmp_path / "v.html").write_text(render_html(d, sim, layout, measured))
    subprocess.run(["node", str(Path(__file__).with_name("show_harness.js")), str(tmp_path / "v.html"),
                    str(tmp_path / "r.json")], check=True, timeout=60)
    r = json.loads((tmp_path / "r.json").read_text())
    groups = len(graph_payload(g, split_by_compute(g, 3))["groups"])
    assert r["boxesInitial"] == groups
    assert r["afterExpandOne"] > groups
    assert r["expandedAll"] == len(g.nodes)
    assert all(f">{name} " in r["expandedHtml"] or f">{name}<" in r["expandedHtml"] for name in g.nodes)
    assert r["afterCollapseOne"] < len(g.nodes) and r["collapsedAll"] == groups
    assert r["timeline"] > 1000 and r["measured"] > 1000


def test_split_manifest_gives_tied_stages_and_links(tmp_path):
    from fxpipe.show.data import load_input
    from fxpipe.actions import Kind

    write_outdir(tmp_path, small_graph(), SMALL_ASSIGN, [1, 1, 1])
    manifest = {"tied": {"emb.weight": [0, 2]}, "comm": [{"src": 0, "dst": 1}, {"src": 1, "dst": 2}, {"src": 0, "dst": 2}]}
    (tmp_path / "split.json").write_text(json.dumps(manifest))
    d = load_input(str(tmp_path))
    assert d.tied_stages == (0, 2) and d.links == [(0, 1), (0, 2), (1, 2)]
    sim, _ = simulate_input(d, "1f1b-flush", 2)
    reduces = {r for r, evs in sim.events.items() for e in evs if e.action.kind is Kind.ALLREDUCE}
    assert reduces == {0, 2}  # the tied stages all-reduce although neither is replicated


def test_svg_format_needs_graphviz(tmp_path, capsys):
    write_outdir(tmp_path, small_graph(), SMALL_ASSIGN, [1, 1, 1])
    code = main(["show", str(tmp_path), "--format", "svg"])
    if shutil.which("dot") is None:
        assert code == 2 and "Graphviz" in capsys.readouterr().err
    else:
        assert code == 0 and (tmp_path / "view.svg").read_text().lstrip().startswith("<")


def test_measured_trace_is_cropped_to_one_middle_step():
    from fxpipe.show.data import one_step

    E = TraceEvent
    trace = {0: [E(0.0, 1.0, "F0", "F"), E(1.0, 2.0, "STEP", "step"), E(2.0, 3.0, "F0", "F"),
                 E(3.0, 4.0, "STEP", "step"), E(4.0, 5.5, "F0", "F"), E(5.5, 6.0, "STEP", "step")],
             1: [E(2.5, 3.5, "F0", "F"), E(4.5, 5.0, "B0", "B")]}
    cropped, note = one_step(trace)
    assert note == "step 2 of 3"
    assert cropped == {0: [E(0.0, 1.0, "F0", "F"), E(1.0, 2.0, "STEP", "step")], 1: [E(0.5, 1.5, "F0", "F")]}
    assert one_step({0: [E(0.0, 1.0, "F0", "F")]}) is None


def bundled_example_graph():
    """examples/gpt.py captured with fx; costs are made up (the structure is what the page shows)."""
    import runpy

    from passes.capture import capture, module_path_of

    ns = runpy.run_path(str(ROOT / "examples" / "gpt.py"))
    gm = capture(ns["model"], ns["example_inputs"], method="fx", check=False)
    keep = [n for n in gm.graph.nodes if n.op != "get_attr"]
    nodes = {n.name: CostNode(n.name, n.op, str(n.target), 1e-4, 2e-4, 4096, 0, module_path=module_path_of(n) or "",
                              is_input=n.op == "placeholder") for n in keep}
    edges = [(a.name, n.name) for n in keep for a in n.all_input_nodes if a.name in nodes]
    return CostGraph(nodes, edges)


def test_bundled_example_page():
    g = bundled_example_graph()
    plan = synthetic_plan(g, split_by_compute(g, 3), [1, 1, 1], batch_size=8)
    d = ShowInput(plan, g, "examples/gpt.py")
    sim, layout = simulate_input(d, "1f1b-flush", 4)
    data = check_page(render_html(d, sim, layout), g, plan)
    labels = {grp["label"].split(" ")[0] for grp in data["graph"]["groups"]}
    assert {"tok", "pos", "blocks.0", "blocks.3"} <= labels  # module subtrees of the example


def test_times_round_before_choosing_the_unit():
    from fxpipe.show.html import fmt_s

    assert fmt_s(0.0009996) == "1 ms" and fmt_s(0.0009994) == "999 µs" and fmt_s(0.99996) == "1 s"
    assert fmt_s(0.0123) == "12.3 ms" and fmt_s(0) == "0" and fmt_s(None) == "–"


def test_two_level_plan_is_simulated_with_its_node_links(tmp_path):
    g = small_graph()
    plan = synthetic_plan(g, SMALL_ASSIGN, [1, 1, 2], bandwidth=1e3, gpus_per_node=2, intra_bandwidth=1e12)
    data = ShowInput(plan=plan, graph=g, source="test")
    sim, layout = simulate_input(data)
    sends = {(r, e.action.peer): e.end - e.start for r, evs in sim.events.items() for e in evs
             if e.action.kind.value == "SEND_F" and e.action.mb == 0}
    assert sends[(0, 1)] == pytest.approx(1024 / 1e12)  # ranks 0 and 1 share node 0
    assert sends[(1, 2)] == pytest.approx(1024 / 1e3)  # rank 2 is on node 1
    page = render_html(data, sim, layout)
    assert "2 devices per node" in page
