"""profile: measured per-node costs on fx and export graphs, parameter ownership, CostGraph."""
import runpy
from pathlib import Path

import pytest
import torch

from passes import meta
from passes.capture import capture
from passes.profile import ProfileError, profile, to_cost_graph
from tests.models import ALL, example

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def one_thread():
    """Timing on a shared 2-core machine: one intra-op thread keeps medians stable."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _captured(name, method):
    model, inputs = example(name)
    leaves = ["gate"] if name == "ControlFlow" else ()
    return model, capture(model, inputs, method=method, leaf_modules=leaves), inputs


# Data-dependent control flow (ControlFlow) cannot be exported; fx with a leaf module captures it.
CASES = [(name, method) for name in ALL for method in ("fx", "export") if (name, method) != ("ControlFlow", "export")]


@pytest.mark.parametrize("name, method", CASES)
def test_every_node_gets_costs_and_values(name, method):
    model, gm, inputs = _captured(name, method)
    profile(gm, inputs, repeats=1, warmup=0)
    meta.require(gm, meta.NodeCost, needed_by="test", made_by="profile")
    meta.require(gm, meta.ValueMeta, needed_by="test", made_by="profile")
    graph = to_cost_graph(gm)
    # every parameter counted exactly once, tied ones included
    params = {id(p): p for p in model.parameters()}
    assert graph.total_param_bytes() == sum(p.numel() * p.element_size() for p in params.values())
    assert sum(graph.param_sizes.values()) == graph.total_param_bytes()
    for node in gm.graph.nodes:
        cost = meta.get(node, meta.NodeCost, None)
        if cost is None or node.op not in ("call_module", "call_function", "call_method"):
            continue
        assert cost.fwd_s > 0
        if cost.params:
            assert cost.bwd_s > 0, node.name
        # output bytes = bytes of every tensor the node returned
        assert cost.out_bytes == sum(t.nbytes for t in meta.get(node, meta.ValueMeta).tensors())
    info = meta.get(gm, meta.ProfileInfo)
    assert info.whole_fwd_s > 0 and info.whole_bwd_s > 0 and info.batch_size == inputs[0].shape[0]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tied_embedding_owned_once_listed_by_both_users(method):
    _, gm, inputs = _captured("TinyGPT", method)
    profile(gm, inputs, repeats=1, warmup=0)
    graph = to_cost_graph(gm)
    users = [n for n in graph.nodes.values() if "tok.weight" in n.params]
    assert len(users) == 2  # the embedding lookup and the output projection
    owners = [n for n in users if n.param_bytes >= 64 * 32 * 4]
    assert owners == users[:1]  # first user in graph order owns it
    shared = [meta.get(n, meta.NodeCost).shared_params for n in gm.graph.nodes if n.name in {u.name for u in users}]
    assert all("tok.weight" in s for s in shared)


def test_cost_graph_calibrated_to_the_whole_model_raw_on_request():
    _, gm, inputs = _captured("TinyGPT", "fx")
    profile(gm, inputs, repeats=1, warmup=0)
    info = meta.get(gm, meta.ProfileInfo)
    raw, cal = to_cost_graph(gm, calibrate=False), to_cost_graph(gm)
    measured = {n.name: meta.get(n, meta.NodeCost) for n in gm.graph.nodes if meta.has(n, meta.NodeCost)}
    assert all(raw.nodes[k].fwd_s == c.fwd_s and raw.nodes[k].bwd_s == c.bwd_s for k, c in measured.items())
    assert "calibration" not in raw.info
    assert sum(n.fwd_s for n in cal.nodes.values()) == pytest.approx(info.whole_fwd_s, rel=1e-9)
    assert sum(n.bwd_s for n in cal.nodes.values()) == pytest.approx(info.whole_bwd_s, rel=1e-9)
    kf, kb = cal.info["calibration"]["fwd"], cal.info["calibration"]["bwd"]
    for name, node in raw.nodes.items():  # one factor per direction: relative costs unchanged
        assert cal.nodes[name].fwd_s == pytest.approx(node.fwd_s * kf)
        assert cal.nodes[name].bwd_s == pytest.approx(node.bwd_s * kb)


def test_contract_shapes_of_the_cost_graph():
    _, gm, inputs = _captured("MultiIO", "export")
    profile(gm, inputs, repeats=1, warmup=0)
    graph = to_cost_graph(gm)
    ops = {n.op for n in graph.nodes.values()}
    assert "get_attr" not in ops and "output" in ops
    inputs_ = [n for n in graph.nodes.values() if n.is_input]
    assert [n.name for n in inputs_] == ["x", "y"] and all(n.compute_s == 0 for n in inputs_)
    assert inputs_[0].out_bytes == 6 * 8 * 4
    out = graph.nodes["output"]
    assert out.compute_s == 0 and list(graph.nodes)[-1] == "output"
    assert all(n.module_path is not None for n in graph.nodes.values())
    assert any(n.module_path == "out1" for n in graph.nodes.values())
    graph.check()


def test_value_meta_records_non_tensor_outputs():
    _, gm, inputs = _captured("MultiIO", "fx")
    profile(gm, inputs, repeats=1, warmup=0)
    size = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size")
    assert meta.get(size, meta.ValueMeta).spec == 6
    output = next(n for n in gm.graph.nodes if n.op == "output")
    spec = meta.get(output, meta.ValueMeta).spec
    assert isinstance(spec, tuple) and [t.shape for t in spec] == [(6, 3), (6, 5)]


def test_profile_leaves_buffers_unchanged():
    model, gm, inputs = _captured("SkipCNN", "fx")
    before = model.norm.running_mean.clone()
    profile(gm, inputs, repeats=2, warmup=1)
    assert torch.equal(model.norm.running_mean, before)


class InPlace(torch.nn.Module):
    """In-place writes of every kind a graph carries: module flag, method, function, setitem."""

    def __init__(self, setitem):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
        self.act = torch.nn.ReLU(inplace=True)
        self.setitem = setitem

    def forward(self, x):
        y = self.act(self.a(x)) * 1.5
        if self.setitem:
            y[:, 0] = 0.0  # symbolic tracing cannot; export can
        y.add_(1.0)
        z = torch.nn.functional.relu(self.b(y) * 3, inplace=True)
        return torch.sigmoid_(z * 2)


@pytest.mark.parametrize("setitem", [False, True])
def test_inplace_nodes_profile_without_corrupting_values(setitem):
    model = InPlace(setitem)
    x = torch.randn(4, 8)
    for method in ("auto", "export"):
        gm = capture(model, (x,), method=method)
        profile(gm, (x,), repeats=2, warmup=1)
        torch.testing.assert_close(gm(x), model(x))
        values = [meta.get(n, meta.ValueMeta) for n in gm.graph.nodes if n.op != "get_attr"]
        assert all(v is not None for v in values)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    _, gm, inputs = _captured("MLP", "fx")
    with pytest.raises(ProfileError, match="no CUDA device"):
        profile(gm, inputs, device="cuda")


def test_progress_called_once_per_computing_node():
    _, gm, inputs = _captured("MLP", "fx")
    calls = []
    profile(gm, inputs, repeats=1, warmup=0, progress=lambda n=1, note="": calls.append(note))
    computing = [n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert calls == computing


@pytest.mark.parametrize("method", ["fx", "export"])
def test_sum_of_node_forward_times_close_to_whole_forward(method):
    """The parts add up to the whole (within 2x) on a model big enough to time."""
    ns = runpy.run_path(str(EXAMPLES / "cnn.py"))
    gm = capture(ns["model"], ns["example_inputs"], method=method)
    for attempt in range(3):  # a loaded machine can disturb one run; the claim must hold on one of three
        profile(gm, ns["example_inputs"], repeats=7, warmup=2)
        info = meta.get(gm, meta.ProfileInfo)
        graph = to_cost_graph(gm)
        ratio = sum(n.fwd_s for n in graph.nodes.values()) / info.whole_fwd_s
        bwd_ratio = sum(n.bwd_s for n in graph.nodes.values()) / info.whole_bwd_s
        if 0.5 <= ratio <= 2.0 and 0.5 <= bwd_ratio <= 2.0:
            break
    assert 0.5 <= ratio <= 2.0, f"sum of node forwards / whole forward = {ratio:.2f}"
    assert 0.5 <= bwd_ratio <= 2.0, f"sum of node backwards / whole backward = {bwd_ratio:.2f}"
    with_params = [n for n in graph.nodes.values() if n.params]
    assert with_params and all(n.bwd_s > 0 for n in with_params)


def test_profile_runs_as_a_torch_fx_pass():
    from torch.fx.passes.infra.pass_manager import PassManager

    from passes.infra import ProfilePass

    _, gm, inputs = _captured("MLP", "fx")
    result = PassManager([ProfilePass(inputs, repeats=1, warmup=0)])(gm)
    assert meta.has(result.graph_module, meta.ProfileInfo)


def test_the_passes_write_metadata_only_and_say_so():
    """``modified`` is False from all three, so a ``PassManager`` with ``steps=3`` runs each once."""
    from torch.fx.passes.infra.pass_manager import PassManager

    from passes.infra import PartitionPass, ProfilePass, SplitPass

    _, gm, inputs = _captured("MLP", "fx")
    calls = []
    passes = [ProfilePass(inputs, repeats=1, warmup=0), PartitionPass(2, time_limit=5), SplitPass(inputs)]
    for p in passes:
        p.call = (lambda call, name: lambda g: calls.append(name) or call(g))(p.call, type(p).__name__)
    code = gm.code
    result = PassManager(passes, steps=3)(gm)
    assert calls == ["ProfilePass", "PartitionPass", "SplitPass"]
    assert not result.modified and result.graph_module.code == code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_times_with_events_and_reports_peak_memory():
    _, gm, inputs = _captured("TinyGPT", "fx")
    profile(gm, inputs, device="cuda", repeats=3, warmup=1)
    graph = to_cost_graph(gm)
    assert graph.info["device"].startswith("cuda")
    timed = [n for n in graph.nodes.values() if n.op in ("call_module", "call_function", "call_method")]
    assert all(n.peak_mem_bytes is not None for n in timed)
    assert any(n.peak_mem_bytes > 0 for n in timed)


def test_cpu_profile_reports_no_peak_memory():
    _, gm, inputs = _captured("MLP", "fx")
    profile(gm, inputs, repeats=1, warmup=0)
    assert all(n.peak_mem_bytes is None for n in to_cost_graph(gm).nodes.values())
