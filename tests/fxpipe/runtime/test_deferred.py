"""Linear weight gradients deferred from B to W: the same gradients as one whole backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.runtime.deferred import DeferredGradError, Replayed, defer_weight_grads, qualifies, replaying
from fxpipe.runtime.recompute import recomputed
from passes import comm
from tests.fxpipe.runtime import fakes


class Stage(nn.Module):
    """A received 3-d value; Linear layers with and without bias, one called twice; a norm; a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 6, bias=False)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x))) + self.emb(idx)
        h = self.b(torch.tanh(self.a(self.norm(h))))  # both layers a second time
        return F.linear(h, self.emb.weight)  # the embedding's weight as a head: its gradient stays in B


def _run(defer: bool, dtype: torch.dtype = torch.float64, autocast: bool = False, recompute: bool = False):
    torch.manual_seed(0)
    stage = Stage().to(dtype)
    grads = defer_weight_grads(stage) if defer else None
    if defer:
        assert grads is not None and set(grads.layers) == {"a", "b"}
        grads.enabled = True
    x = torch.randn(3, 4, 6, dtype=dtype, requires_grad=True)
    idx = torch.randint(0, 10, (3, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        # recomputed: the executor's wrapping (the forward again in backward, inside B's collect)
        out = recomputed(stage, (x, idx), comm.MailboxTransport()) if recompute else stage(x, idx)
    root = out.float().pow(2).sum()
    if grads is not None:
        grads.collect()
        root.backward()
        weights = grads.done()
        # B gave the received value's gradient and the cheap weights'; the Linear layers' wait for W
        assert x.grad is not None and stage.emb.weight.grad is not None and stage.norm.weight.grad is not None
        assert all(p.grad is None for p in (stage.a.weight, stage.a.bias, stage.b.weight))
        weights.run()
        weights.run()  # a second run adds nothing
        grads.remove()
        assert type(stage.a) is nn.Linear and type(stage.b) is nn.Linear
    else:
        root.backward()
    return x.grad, {n: p.grad for n, p in stage.named_parameters()}


def test_deferred_weight_gradients_equal_one_whole_backward() -> None:
    gx, got = _run(defer=True)
    want_x, want = _run(defer=False)
    assert torch.allclose(gx, want_x, rtol=1e-12, atol=1e-12)
    for name, grad in want.items():
        assert got[name] is not None, name
        assert torch.allclose(got[name], grad, rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize("defer", [True, False])
def test_recomputed_stages_weight_gradients_equal_one_whole_backward(defer: bool) -> None:
    """Recomputing in B (the checkpointed forward run again) changes no gradient, deferred or not."""
    gx, got = _run(defer=defer, recompute=True)
    want_x, want = _run(defer=False)
    assert torch.allclose(gx, want_x, rtol=1e-12, atol=1e-12)
    for name, grad in want.items():
        assert got[name] is not None, name
        assert torch.allclose(got[name], grad, rtol=1e-12, atol=1e-12), name


def test_a_recomputed_forward_keeps_no_layer_input_until_the_recompute() -> None:
    """The first run leaves a slot per deferred call and holds no input; the recompute fills the slots in
    call order with the inputs it computes again, which W then reads."""
    torch.manual_seed(0)
    stage = Stage().double()
    grads = defer_weight_grads(stage)
    grads.enabled = True
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 10, (3, 4))
    calls = Replayed()
    with replaying(calls, False):
        stage(x, idx)
    assert calls.slots == [[], [], [], []]  # a, b, a, b: nothing of the forward kept
    with torch.no_grad():
        h = stage.b(torch.tanh(stage.a(x))) + stage.emb(idx)
    with replaying(calls, True):
        stage(x, idx)
    assert [tuple(s[0].shape) for s in calls.slots] == [(3, 4, 6), (3, 4, 8), (3, 4, 6), (3, 4, 8)]
    assert torch.equal(calls.slots[0][0], x.detach()) and torch.equal(calls.slots[2][0], stage.norm(h))
    with replaying(calls, True):  # a second recompute (another backward) fills them again, from the first
        stage(x, idx)
    assert calls.next == 4
    grads.remove()


def test_deferred_under_bf16_autocast_match_autocast_backward() -> None:
    """The deferred product reads the input cast as autocast cast it; gradients land in fp32."""
    gx, got = _run(defer=True, dtype=torch.float32, autocast=True)
    want_x, want = _run(defer=False, dtype=torch.float32, autocast=True)
    assert torch.allclose(gx, want_x, rtol=1e-2, atol=1e-2)
    for name, grad in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.allclose(got[name], grad, rtol=2e-2, atol=2e-2), (name, (got[name] - grad).abs().max())


def test_a_backward_outside_collect_gets_its_weight_gradients_at_once() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    grads = defer_weight_grads(lin)
    grads.enabled = True
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    lin(x).sum().backward()
    assert torch.allclose(lin.weight.grad, torch.ones(4, 1, dtype=torch.float64) * x.detach().sum(0))
    assert torch.allclose(lin.bias.grad, torch.full((4,), 2.0, dtype=torch.float64))


def test_an_input_written_in_place_after_the_layer_read_it_is_an_error() -> None:
    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            out = self.lin(h)
            h.mul_(3)  # autograd does not need h (the weight is detached), so only W would read it wrong
            return out + h

    stage = Writes()
    grads = defer_weight_grads(stage)
    grads.enabled = True
    grads.collect()
    stage(torch.randn(2, 4, requires_grad=True)).sum().backward()
    with pytest.raises(DeferredGradError, match=r"layer 'lin' \(Linear\) was written in place"):
        grads.done().run()


class Convs(nn.Module):
    """Strided, dilated, grouped and 1-d / 3-d convolutions, one without bias, a batch norm, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(6, 6, 3, padding=(2, 1), dilation=(2, 1), groups=3, bias=False)
        self.norm = nn.BatchNorm2d(6)
        self.c3 = nn.Conv1d(6, 4, 2)
        self.c4 = nn.Conv3d(1, 2, (1, 2, 2))
        self.head = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.c2(torch.tanh(self.c1(x))))  # (2, 6, 4, 4)
        v = self.c3(h.flatten(2))  # (2, 4, 15)
        w = self.c4(v[:, None, :, :3, None].expand(2, 1, 4, 3, 3).contiguous())  # (2, 2, 4, 2, 2)
        u = self.c3(h[0].flatten(1))  # an unbatched call of c3: (4, 15)
        return self.head(w.flatten(1)[:, :3]).sum() + u.pow(2).sum() + v.sum()


def _run_convs(defer: bool):
    torch.manual_seed(0)
    stage = Convs().double()
    grads = defer_weight_grads(stage) if defer else None
    if grads is not None:
        assert set(grads.layers) == {"c1", "c2", "c3", "c4", "head"}
        grads.enabled = True
        grads.collect()
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    stage(x).backward()
    if grads is not None:
        assert stage.c1.weight.grad is None and stage.norm.weight.grad is not None
        grads.done().run()
    return x.grad, {n: p.grad for n, p in stage.named_parameters()}


def test_deferred_convolution_weight_gradients_equal_one_whole_backward() -> None:
    gx, got = _run_convs(defer=True)
    want_x, want = _run_convs(defer=False)
    assert torch.allclose(gx, want_x, rtol=1e-12, atol=1e-12)
    for name, grad in want.items():
        assert torch.allclose(got[name], grad, rtol=1e-10, atol=1e-12), name


def test_only_stages_whose_other_weights_are_cheap_qualify() -> None:
    class WithAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.att, self.head = nn.MultiheadAttention(4, 2), nn.Linear(4, 4)

    class WithParameter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.scale = nn.Linear(4, 4), nn.Parameter(torch.ones(4))

    class Sub(nn.Linear):
        pass

    assert defer_weight_grads(WithAttention()) is None  # its projections' weight half would land in B
    assert defer_weight_grads(nn.Sequential(nn.Conv2d(2, 2, 3, padding="same"))) is None
    assert defer_weight_grads(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"))) is None
    assert defer_weight_grads(WithParameter()) is None
    assert defer_weight_grads(nn.Sequential(Sub(4, 4))) is None  # a subclass may have its own forward
    assert defer_weight_grads(nn.Sequential(nn.LayerNorm(4))) is None  # nothing to defer
    assert not qualifies(WithParameter()) and not qualifies(WithAttention())
    frozen = WithParameter()
    frozen.scale.requires_grad_(False)
    assert qualifies(frozen) and type(frozen.lin) is nn.Linear  # asking changes nothing
    assert set(defer_weight_grads(frozen).layers) == {"lin"}


def test_the_runtime_tests_chain_stages_defer() -> None:
    """The zb-h1 equivalence tests (``test_equivalence``) run the deferred path on the chain's stages."""
    _, split = fakes.chain((2,))
    assert all(defer_weight_grads(s) is not None for s in split.stages)


def test_disabled_layers_run_their_own_forward() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    grads = defer_weight_grads(lin)
    x = torch.randn(2, 4, requires_grad=True)
    grads.collect()
    lin(x).sum().backward()
    assert lin.weight.grad is not None and grads.done().entries == []


def _cnn_data(g: int):
    gen = torch.Generator().manual_seed(300 + g)
    return (torch.randn(2, 3, 6, 6, generator=gen, dtype=torch.float64),), torch.randn(2, 10, generator=gen,
                                                                                       dtype=torch.float64)


def _cnn_split(folder: str):
    """``SkipCNN`` (convolutions, a skip link over the cut, a batch norm, a Linear head) cut after its
    third convolution, saved as stage files."""
    from fxpipe.split_model import SplitModel
    from passes.capture import capture
    from passes.partition import apply_assignment
    from passes.split import split_stages
    from tools.bench.models import SkipCNN

    torch.manual_seed(0)
    model = SkipCNN().double()
    inputs = _cnn_data(0)[0]
    gm = capture(model, inputs)
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    cut = compute.index("convs_2")
    apply_assignment(gm, {n: int(i >= cut) for i, n in enumerate(compute)})
    split = SplitModel.from_result(split_stages(gm, inputs), gm)
    split.save(folder)
    return split


def _cnn_rank(rank: int, folder: str):
    from fxpipe.layout import Layout
    from fxpipe.runtime.loop import TrainConfig, train
    from fxpipe.split_model import SplitModel

    cfg = TrainConfig(log=False, schedule="zb-h1", microbatches=4, steps=3, optimizer="sgd", lr=0.1)
    res = train(rank=rank, layout=Layout.of((1, 1)), split=SplitModel.load(folder), cfg=cfg, data=_cnn_data,
                loss_fn=F.mse_loss)
    return {"stage": res.stage, "state": res.state}


def test_zb_h1_with_deferred_convolutions_equals_gradient_accumulation(tmp_path) -> None:
    """Through fx's split and stage files: the second stage (convolutions, batch norm, head) defers."""
    from tests.fxpipe.runtime import cases
    from tests.fxpipe.runtime.harness import spawn
    from tools.bench.models import SkipCNN

    split = _cnn_split(str(tmp_path))
    deferral = defer_weight_grads(split.stages[1])
    assert deferral is not None and {"convs.3", "convs.4", "head"} <= {n.replace("_", ".") for n in deferral.layers}
    got = cases.merge_states(split.param_names, spawn(_cnn_rank, 2, (str(tmp_path),), deadline=120.0).ok())
    torch.manual_seed(0)
    model = SkipCNN().double()
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    cases.accumulate_model(model, _cnn_data, F.mse_loss, 3, 4, "sgd", 0.1)
    for k, p in model.named_parameters():
        moved = (p.detach() - start[k]).norm().item()
        assert moved > 1e-6, k
        assert (got[k] - p.detach()).norm().item() <= 1e-9 * moved, k
