"""capture: both methods on the shared test models, leaf modules, clear errors."""
import pytest
import torch
import torch.nn as nn

from passes import meta
from passes.capture import CaptureError, CaptureMismatchError, capture, check_capture
from passes.errors import FxpipeError
from tests.models import Gate, example


def _same_on_fresh_inputs(model, gm, inputs):
    """The capture equals the model on random inputs it was not captured on."""
    torch.manual_seed(7)
    fresh = tuple(
        torch.randint_like(x, 0, 64) if not x.is_floating_point() else torch.randn_like(x) for x in inputs
    )
    torch.testing.assert_close(gm(*fresh), model(*fresh), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["MLP", "SkipCNN", "TinyGPT", "MultiIO"])
@pytest.mark.parametrize("method", ["fx", "export"])
def test_capture_matches_model(name, method):
    model, inputs = example(name)
    gm = capture(model, inputs, method=method)
    assert isinstance(gm, torch.fx.GraphModule)
    assert meta.get(gm, meta.CaptureInfo).method == method
    _same_on_fresh_inputs(model, gm, inputs)
    computing = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert computing and all(meta.has(n, meta.ModuleInfo) for n in computing)


def test_auto_prefers_fx():
    model, inputs = example("TinyGPT")
    info = meta.get(capture(model, inputs), meta.CaptureInfo)
    assert info.method == "fx" and info.fx_error is None


def test_module_paths_recorded_in_both_graphs():
    model, inputs = example("TinyGPT")
    fx_paths = {meta.get(n, meta.ModuleInfo).path for n in capture(model, inputs, method="fx").graph.nodes if meta.has(n, meta.ModuleInfo)}
    ex = capture(model, inputs, method="export")
    ex_paths = {meta.get(n, meta.ModuleInfo).path for n in ex.graph.nodes if meta.has(n, meta.ModuleInfo)}
    assert {"blocks.0.qkv", "blocks.3.fc2", "blocks.0", "ln_f"} <= fx_paths
    assert {"blocks.0.qkv", "blocks.3.fc2", "blocks.0", "ln_f"} <= ex_paths
    # export names are tied to module paths, like symbolic tracing's
    names = {n.name for n in ex.graph.nodes}
    assert "blocks_0_qkv_linear" in names and "blocks_2_fc1_linear" in names


def test_control_flow_needs_leaf_and_error_names_module_line_and_remedy():
    model, inputs = example("ControlFlow")
    with pytest.raises(CaptureError) as info:
        capture(model, inputs)
    text = str(info.value)
    assert "'gate'" in text and "models.py:" in text and "if x.sum() > 0" in text
    assert "leaf_modules" in text
    for leaf in ("gate", Gate):
        gm = capture(model, inputs, leaf_modules=[leaf])
        assert meta.get(gm, meta.CaptureInfo).method == "fx"
        assert any(n.op == "call_module" and n.target == "gate" for n in gm.graph.nodes)
        _same_on_fresh_inputs(model, gm, inputs)


def test_unknown_leaf_path_is_named():
    model, inputs = example("ControlFlow")
    with pytest.raises(FxpipeError, match="'gat' is not a submodule"):
        capture(model, inputs, leaf_modules=["gat"])


def test_check_catches_a_stale_capture():
    """Symbolic tracing freezes Python values; the check catches a graph that no longer matches."""

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * float(len(self.scale_source))  # Python-level value, constant-folded by fx

        scale_source = [1, 2]

    model = Frozen()
    inputs = (torch.randn(3, 4),)
    gm = capture(model, inputs)
    assert meta.get(gm, meta.CaptureInfo).method == "fx"  # constant is right here: passes
    other = torch.fx.symbolic_trace(model)
    model.scale_source = [1, 2, 3]  # now the fx graph is stale
    with pytest.raises(CaptureMismatchError, match="output 0 differs"):
        check_capture(model, other, inputs)


def test_check_restores_batchnorm_buffers():
    model, inputs = example("SkipCNN")
    before = model.norm.running_mean.clone()
    for method in ("fx", "export"):
        capture(model, inputs, method=method)
    torch.testing.assert_close(model.norm.running_mean, before, rtol=0, atol=0)


def test_dropout_model_checks_with_same_rng():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    for method in ("fx", "export"):
        gm = capture(model, (torch.randn(4, 8),), method=method)
        assert meta.get(gm, meta.CaptureInfo).method == method


def test_bad_method():
    model, inputs = example("MLP")
    with pytest.raises(FxpipeError, match="method must be"):
        capture(model, inputs, method="jit")


def test_concrete_args_are_folded_so_placeholders_are_the_inputs():
    class Flag(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, double=False):
            y = self.lin(x)
            if double:
                y = y * 2
            return y

    model, x = Flag(), torch.randn(2, 4)
    with pytest.raises(CaptureError, match="concrete_args"):
        capture(model, (x,), method="fx")
    gm = capture(model, (x,), method="fx", concrete_args={"double": False})
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    torch.testing.assert_close(gm(x), model(x))


class _CastNorm(nn.Module):
    """Gemma's RMSNorm shape: the weight is cast in the forward, so export checks its dtype beside the cast."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


class _CastNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.fc, self.n2 = _CastNorm(8), nn.Linear(8, 8), _CastNorm(8)

    def forward(self, x):
        return self.n2(x + self.fc(self.n1(x)))


def test_export_metadata_checks_are_dropped_so_cast_weights_have_one_reader():
    from passes.profile import profile, to_cost_graph

    model, x = _CastNormNet(), torch.randn(4, 8)
    gm = capture(model, (x,), method="export")  # checked against the model inside
    checks = [n for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule) for n in sub.graph.nodes
              if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert not checks
    profile(gm, (x,), repeats=1, warmup=0)
    graph = to_cost_graph(gm)
    readers = {}
    for node in graph.nodes.values():
        for p in node.params:
            readers.setdefault(p, []).append(node.name)
    assert {"n1.weight", "n2.weight"} <= set(readers)
    assert all(len(r) == 1 for r in readers.values()), readers  # no weight looks tied
    torch.testing.assert_close(gm(x), model(x))


class _Counting(nn.Module):
    """Counts its calls in a buffer from ``forward`` (a Python-level update fx runs once, while tracing)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def test_a_buffer_updated_in_forward_is_kept_by_falling_back_to_export():
    model = _Counting()
    inputs = (torch.randn(3, 4),)
    with pytest.raises(CaptureMismatchError, match="buffer .calls. after the forward"):
        capture(model, inputs, method="fx")
    assert isinstance(model.calls, torch.Tensor) and model.calls.item() == 0  # tracing left the model as it was
    gm = capture(model, inputs)  # auto: fx leaves the update out, the check sees it, export keeps it
    assert meta.get(gm, meta.CaptureInfo).method == "export"
    gm(*inputs)
    gm(*inputs)
    assert dict(gm.named_buffers())["calls"].item() == 2


class _IndexTable(nn.Module):
    """A bias gathered through an index buffer read by attribute (torchvision's MaxViT): fx must keep the
    buffer as a graph value, not fold ``index.view(-1)`` into a constant the model's state has no key for."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(7))
        self.register_buffer("index", torch.tensor([[0, 3, 6, 2]]))

    def forward(self, x):
        return self.lin(x) + self.table[self.index.view(-1)]


def test_a_buffer_read_by_attribute_is_a_graph_value():
    model = _IndexTable()
    gm = capture(model, (torch.randn(3, 4),))
    assert meta.get(gm, meta.CaptureInfo).method == "fx"
    assert "index" in {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert not any(name.startswith("_tensor_constant") for name, _ in gm.named_buffers())
