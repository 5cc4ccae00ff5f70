"""CostGraph: lossless JSON round trip, PipeDream graph.txt profiles load."""
import json
import re
from pathlib import Path

import pytest
import torch

from passes.capture import capture
from passes.costgraph import CostGraph, ProfileFormatError, SCHEMA, load_pipedream
from passes.errors import FxpipeError
from passes.profile import profile, to_cost_graph
from tests.models import example
from tests.passes.test_profile import one_thread  # noqa: F401 - autouse fixture: stable timing under load

from tests.profiles import PROFILES


def _count_lines(path: Path):
    """Node and edge lines of a graph.txt, counted independently of the loader."""
    nodes = edges = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            edges += 1
        elif "forward_compute_time=" in line:
            nodes += 1
    return nodes, edges


@pytest.mark.parametrize("method", ["fx", "export"])
def test_profiled_graph_json_round_trip_is_lossless(tmp_path, method):
    model, inputs = example("TinyGPT")
    gm = capture(model, inputs, method=method)
    profile(gm, inputs, repeats=1, warmup=0)
    graph = to_cost_graph(gm)
    path = tmp_path / "profile.json"
    graph.save(path)
    again = CostGraph.load(path)
    assert again == graph
    assert list(again.nodes) == list(graph.nodes)  # order is the topological order
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA
    for key in ("torch_version", "device", "batch_size", "whole_fwd_s", "whole_bwd_s", "capture_method"):
        assert key in data["info"], key
    assert data["info"]["torch_version"] == torch.__version__ and data["info"]["batch_size"] == 4


def test_wrong_schema_is_named(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema": "other/9", "nodes": [], "edges": []}))
    with pytest.raises(ProfileFormatError, match="schema is 'other/9'"):
        CostGraph.load(path)


def test_vgg16_loads_with_the_counts_of_the_file():
    path = PROFILES / "vgg16.txt"
    nodes, edges = _count_lines(path)
    graph = load_pipedream(path)
    assert (len(graph.nodes), len(graph.edges)) == (nodes, edges)
    assert nodes > 30  # a real profile, not an empty parse
    inputs = [n for n in graph.nodes.values() if n.is_input]
    assert len(inputs) == 1 and inputs[0].compute_s == 0
    # milliseconds in the file, seconds in memory
    first = next(line for line in path.read_text().splitlines() if line.startswith("node11 "))
    fwd_ms = float(re.search(r"forward_compute_time=([\d.]+)", first).group(1))
    assert graph.nodes["node11"].fwd_s == pytest.approx(fwd_ms / 1e3)


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.txt")), ids=lambda p: p.stem)
def test_every_pipedream_profile_loads_and_round_trips(tmp_path, path):
    graph = CostGraph.load(path)
    assert (len(graph.nodes), len(graph.edges)) == _count_lines(path)
    out = tmp_path / "g.json"
    graph.save(out)
    assert CostGraph.load(out) == graph


def test_a_profile_saved_as_gz_is_compressed_and_loads_back(tmp_path):
    graph = load_pipedream(PROFILES / "vgg16.txt")
    plain, packed = tmp_path / "g.json", tmp_path / "g.json.gz"
    graph.save(plain)
    graph.save(packed)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"  # gzip, not JSON text
    assert packed.stat().st_size < plain.stat().st_size / 4
    assert CostGraph.load(packed) == graph
    graph.save(tmp_path / "again.json.gz")
    assert (tmp_path / "again.json.gz").read_bytes() == packed.read_bytes()  # no timestamp inside


def test_a_binary_or_damaged_profile_is_one_clear_error(tmp_path):
    binary = tmp_path / "weights.json"
    binary.write_bytes(bytes(range(128, 256)))
    with pytest.raises(FxpipeError, match=r"weights\.json is not a profile fxpipe can read \(binary"):
        CostGraph.load(binary)
    packed = tmp_path / "g.json.gz"
    load_pipedream(PROFILES / "vgg16.txt").save(packed)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(packed.read_bytes()[:200])
    with pytest.raises(FxpipeError, match=r"cut\.json\.gz is a damaged gzip file"):
        CostGraph.load(cut)
