"""capture traces into torch.nn's transformer modules and MultiheadAttention.

fx keeps every torch.nn module a leaf, so these used to be one node each. Every
capture here is checked by ``capture`` itself (forward and every parameter
gradient against the module, dropout included), and again on fresh inputs.
"""
import pytest
import torch
import torch.nn as nn

from passes import meta
from passes.capture import capture
from tests.models import EncoderLM, Seq2Seq

D = 16
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


def _computing(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]


def _same_on_fresh_inputs(model, gm, inputs):
    torch.manual_seed(7)
    fresh = tuple(x if x.dtype == torch.bool else torch.randn_like(x) if x.is_floating_point()
                  else torch.randint_like(x, 1, 32) for x in inputs)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        want = model(*fresh)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        got = gm(*fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Masked(nn.Module):
    """Attention with a boolean key-padding mask, output only."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x, pad):
        return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def _cases():
    x, y = torch.randn(3, 6, D), torch.randn(3, 5, D)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[:, -2:] = True
    layer = dict(dim_feedforward=32, batch_first=True)
    decoder_layer = nn.TransformerDecoderLayer(D, 2, dropout=0.1, **layer)
    kv8, kv12 = torch.randn(4, 6, 8), torch.randn(4, 6, 12)
    return {
        # MultiheadAttention alone, as the root: returns (output, averaged weights)
        "mha": (nn.MultiheadAttention(D, 2, batch_first=True, dropout=0.2), (x, x, x)),
        "mha_cross_kdim": (nn.MultiheadAttention(D, 2, kdim=8, vdim=12), (x, kv8, kv12)),
        "mha_bias_kv": (nn.MultiheadAttention(D, 2, add_bias_kv=True, add_zero_attn=True), (x, x[:2], x[:2])),
        "mha_unbatched": (nn.MultiheadAttention(D, 2), (x[0], x[0], x[0])),
        "mha_padding": (_Masked(), (x, pad)),
        "encoder_layer_dropout": (nn.TransformerEncoderLayer(D, 2, dropout=0.3, **layer), (x,)),
        "encoder_layer_prenorm_gelu": (nn.TransformerEncoderLayer(D, 2, norm_first=True, activation="gelu", **layer),
                                       (x,)),
        "decoder": (nn.TransformerDecoder(decoder_layer, 2, norm=nn.LayerNorm(D)), (x, y)),
        "transformer_seq_first": (nn.Transformer(D, 2, 1, 1, 32, dropout=0.0),
                                  (torch.randn(5, 3, D), torch.randn(6, 3, D))),
        "seq2seq": (Seq2Seq(), (torch.tensor([[3, 4, 5, 0, 0]] * 3), torch.randint(1, 32, (3, 6)))),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_torch_nn_modules_are_traced_into_and_equal(name):
    torch.manual_seed(0)
    model, inputs = _cases()[name]
    gm = capture(model, inputs)  # checks forward and every gradient against the model
    info = meta.get(gm, meta.CaptureInfo)
    assert info.method == "fx", info.fx_error
    nodes = _computing(gm)
    assert len(nodes) > 5
    assert not any(n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), type(model)) for n in nodes)
    if name.startswith("mha"):  # input projection, attention and output projection are separate nodes
        targets = {getattr(n.target, "__name__", n.target) for n in nodes}
        assert "linear" in targets and ({"scaled_dot_product_attention", "softmax"} & targets)
    _same_on_fresh_inputs(model, gm, inputs)


def test_encoder_lm_has_every_layer_and_leaves_stay_leaves():
    torch.manual_seed(0)
    model, idx = EncoderLM(), torch.randint(0, 64, (2, 8))
    gm = capture(model, (idx,))
    assert meta.get(gm, meta.CaptureInfo).method == "fx"
    leaves = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for i in range(4):
        # the layer's Linear, LayerNorm and Dropout modules are still call_module leaves
        assert {f"enc.layers.{i}.{m}" for m in ("linear1", "linear2", "norm1", "norm2", "dropout1")} <= leaves
        paths = {meta.get(n, meta.ModuleInfo).path for n in _computing(gm)}
        assert f"enc.layers.{i}.self_attn" in paths  # attention's own ops, attributed to it
    assert {"tok", "head"} <= leaves and "enc" not in leaves
    # the shape checks torch.nn makes (src.dim() != 3, ...) were answered and left no nodes
    assert not any(n.op == "call_method" and n.target == "dim" for n in gm.graph.nodes)
    _same_on_fresh_inputs(model, gm, (idx,))


def test_declared_leaf_keeps_a_torch_nn_module_whole():
    torch.manual_seed(0)
    model, idx = EncoderLM(), torch.randint(0, 64, (2, 8))
    for leaf in ("enc", nn.TransformerEncoder):
        gm = capture(model, (idx,), leaf_modules=[leaf])
        assert [str(n.target) for n in gm.graph.nodes if n.op == "call_module"] == ["tok", "enc", "head"]


class _Repeat(nn.TransformerEncoderLayer):
    """A subclass whose loop count is a traced value: symbolic tracing cannot run it."""

    def forward(self, src, *args, **kwargs):
        for _ in range(src.dim() - 2):
            src = super().forward(src, *args, **kwargs)
        return src


def test_module_that_fx_cannot_enter_falls_back_to_export_and_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoder(_Repeat(D, 2, 32, dropout=0.0, batch_first=True), 2,
                                                enable_nested_tensor=False), nn.Linear(D, 4))
    gm = capture(model, (torch.randn(2, 5, D),))
    info = meta.get(gm, meta.CaptureInfo)
    assert info.method == "export"
    assert info.fx_error.startswith("in module '0.layers.0' (_Repeat): ")


def test_data_dependent_branch_in_user_code_is_still_refused():
    """Only shape questions inside torch.nn's modules are answered, not a user's ``if x.sum() > 0``."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

        def forward(self, x):
            if x.dim() == 3:
                x = self.attn(x, x, x)[0]
            return x

    gm = capture(Gate(), (torch.randn(2, 5, D),))
    info = meta.get(gm, meta.CaptureInfo)
    assert info.method == "export" and info.fx_error.startswith("TraceError")


def test_a_leaf_failing_on_example_values_does_not_take_the_blame():
    """A declared leaf that raises when the tracer runs it on example values (to answer a shape
    question) is left out of the error: the failure is named where tracing stopped."""
    from passes.capture import CaptureError

    class Bad(nn.Module):
        def forward(self, x):
            raise RuntimeError("fails on real values")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bad = Bad()
            self.enc = nn.TransformerEncoderLayer(D, 2, 2 * D, batch_first=True, dropout=0.0)

        def forward(self, x):
            return self.enc(self.bad(x))

    with pytest.raises(CaptureError, match=r"symbolic tracing failed in module 'enc'"):
        capture(Model(), (torch.randn(2, 5, D),), method="fx", leaf_modules=[Bad])


def test_optional_argument_left_out_is_fixed_to_its_default():
    """``forward(x, mask=None)`` passes ``mask`` into the encoder: a Proxy there could not be
    checked against None, so the argument the example leaves out is fixed to None (as export does)."""

    class Optional_(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True), 2,
                                             enable_nested_tensor=False)

        def forward(self, x, mask=None):
            return self.enc(x, mask=mask)

    torch.manual_seed(0)
    model, x = Optional_(), torch.randn(2, 5, D)
    gm = capture(model, (x,))
    assert meta.get(gm, meta.CaptureInfo).method == "fx"
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    _same_on_fresh_inputs(model, gm, (x,))


def test_containers_are_traced_through_and_their_leaves_kept():
    """Sequential (nested too), ModuleList and ModuleDict hold leaves; the leaves stay whole."""

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Sequential(nn.LayerNorm(D), nn.Dropout(0.0)))
            self.blocks = nn.ModuleList([nn.Linear(D, D), nn.GELU()])
            self.heads = nn.ModuleDict({"a": nn.Linear(D, 3), "b": nn.Linear(D, 2)})

        def forward(self, x):
            x = self.seq(x)
            for block in self.blocks:
                x = block(x)
            return self.heads["a"](x), self.heads["b"](x)

    gm = capture(Holder(), (torch.randn(4, D),))
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_module"] == [
        "seq.0", "seq.1", "seq.2.0", "seq.2.1", "blocks.0", "blocks.1", "heads.a", "heads.b"]
