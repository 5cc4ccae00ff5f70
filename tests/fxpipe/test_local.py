"""run_local against the unsplit model, and saved split folders loaded back.

Every case compares outputs, input gradients and all parameter gradients with
a separate copy of the original model (fp32, relative error <= 1e-5).
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpipe.local import run_local
from fxpipe.split_model import SplitModel
from passes.errors import FxpipeError
from tests.models import example
from tests.splitting import check_equivalent, split_model_of, stage_grads

ROOT = Path(__file__).resolve().parents[2]


def _check(model, sm, inputs):
    check_equivalent(model, lambda *x: run_local(sm, *x), lambda: stage_grads(sm), inputs)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name", ["MLP", "SkipCNN", "TinyGPT", "MultiIO"])
def test_symbolic_trace_split_equals_original(name, stages):
    model, inputs = example(name)
    sm, _ = split_model_of(model, inputs, "fx", stages)
    assert sm.num_stages == stages
    _check(model, sm, inputs)


@pytest.mark.parametrize("name, stages", [("SkipCNN", 4), ("TinyGPT", 3), ("MultiIO", 2)])
def test_export_split_equals_original(name, stages):
    model, inputs = example(name)
    sm, _ = split_model_of(model, inputs, "export", stages)
    _check(model, sm, inputs)


def test_outputs_keep_the_original_structure():
    model, inputs = example("MultiIO")
    sm, _ = split_model_of(model, inputs, "export", 3)
    out = run_local(sm, *inputs)
    assert isinstance(out, tuple) and len(out) == 2
    assert run_local(sm, x=inputs[0], y=inputs[1])[1].shape == out[1].shape


@pytest.mark.parametrize("name, method", [("SkipCNN", "fx"), ("TinyGPT", "export"), ("MultiIO", "fx")])
def test_saved_stages_load_back_and_run_the_same(name, method, tmp_path):
    model, inputs = example(name)
    sm, _ = split_model_of(model, inputs, method, 3)
    sm.save(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["split.json", "stage_0.pt", "stage_0.py", "stage_1.pt", "stage_1.py", "stage_2.pt", "stage_2.py"]
    assert "from passes.comm import" in (tmp_path / "stage_1.py").read_text()
    loaded = SplitModel.load(tmp_path)
    assert loaded.tied == sm.tied and loaded.links == sm.links and loaded.stage_inputs == sm.stage_inputs
    _check(model, loaded, inputs)


def test_saved_float64_stages_stay_float64(tmp_path):
    """Stage constructors build float32 layers; loading must keep the saved dtype."""
    model, inputs = example("MLP")
    model, inputs = model.double(), tuple(x.double() for x in inputs)
    sm, _ = split_model_of(model, inputs, "fx", 2)
    sm.save(tmp_path)
    loaded = SplitModel.load(tmp_path)
    assert {p.dtype for s in loaded.stages for p in s.parameters()} == {torch.float64}
    assert torch.equal(run_local(loaded, *inputs), model(*inputs))


def test_saved_folder_runs_in_a_fresh_process(tmp_path):
    model, inputs = example("TinyGPT")
    sm, _ = split_model_of(model, inputs, "fx", 2)
    sm.save(tmp_path / "split")
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        torch.save(model(*inputs), tmp_path / "ref.pt")
    script = ("import sys, torch, fxpipe\n"
              "sm = fxpipe.SplitModel.load(sys.argv[1])\n"
              "out = fxpipe.run_local(sm, *torch.load(sys.argv[2]))\n"
              "print(float((out - torch.load(sys.argv[3])).abs().max()))\n")
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "split"), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "ref.pt")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout) <= 1e-6


def test_original_state_dict_round_trips_to_the_model():
    model, inputs = example("TinyGPT")
    sm, _ = split_model_of(model, inputs, "fx", 3)
    sd = sm.original_state_dict([st.state_dict() for st in sm.stages])
    assert set(sd) == set(model.state_dict())
    fresh, _ = example("TinyGPT")
    fresh.load_state_dict(sd)


class _WithConstant(torch.nn.Module):
    """A tensor made in forward: the trace keeps it as a buffer ``_tensor_constant0`` the model lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.b(self.a(x) * torch.tensor([1.0, 2.0, 3.0, 4.0]) * self.scale)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_original_state_dict_leaves_out_tensors_the_trace_made(method, tmp_path):
    from passes.capture import capture
    from passes.split import split_stages
    from tests.splitting import assign_even

    model, x = _WithConstant(), torch.randn(3, 4)
    gm = capture(model, (x,), method=method)
    assign_even(gm, 2)
    sm = SplitModel.from_result(split_stages(gm, (x,)), gm)
    stage_keys = {k for st in sm.stages for k in st.state_dict()}
    assert any("constant" in k for k in stage_keys) or method == "export"
    sd = sm.original_state_dict([st.state_dict() for st in sm.stages])
    assert list(sd) == list(model.state_dict())
    model.load_state_dict(sd)  # strict: nothing unexpected, nothing missing
    sm.save(tmp_path / "s")
    loaded = SplitModel.load(tmp_path / "s")
    assert list(loaded.original_state_dict([st.state_dict() for st in loaded.stages])) == list(model.state_dict())
    loaded.state_keys.append("c.weight")
    with pytest.raises(FxpipeError, match=r"no tensor for 1 of the model's state_dict keys \(c.weight\)"):
        loaded.original_state_dict([st.state_dict() for st in loaded.stages])


def _run_with_mailboxes(sm, inputs, loss_fn):
    """The pipeline runtime's data movement, in one process: detached boundaries, gradients shipped by tag."""
    from passes import comm

    dst_of = {e.tag: e.dst_stage for e in sm.comm}
    boxes = [comm.MailboxTransport() for _ in sm.stages]
    tokens = []
    flat = sm.flatten_inputs(inputs)
    for j, stage in enumerate(sm.stages):
        with comm.bind(boxes[j]):
            out, toks = stage(*[flat[i] for i in sm.stage_inputs[j]])
        tokens.append([t for t in toks if t is not None])
        for tag, value in boxes[j].outbox.items():
            boxes[dst_of[tag]].inbox[tag] = value.clone() if isinstance(value, torch.Tensor) else value
    loss_fn(out).backward()
    for j in reversed(range(sm.num_stages - 1)):
        for e in sm.comm:
            if e.src_stage == j and e.tag in boxes[e.dst_stage].grad_out:
                boxes[j].grad_in[e.tag] = boxes[e.dst_stage].grad_out.pop(e.tag)
        if tokens[j]:
            torch.autograd.backward(tokens[j], [torch.ones(())] * len(tokens[j]))
    return out


@pytest.mark.parametrize("name", ["SkipCNN", "TinyGPT", "MultiIO"])
def test_mailbox_transport_gives_the_same_gradients(name):
    """Stages joined only by the mailbox (as across processes) still match the model."""
    model, inputs = example(name)
    sm, _ = split_model_of(model, inputs, "fx", 3)

    def loss(out):
        outs = out if isinstance(out, tuple) else (out,)
        return sum((o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)

    got = _run_with_mailboxes(sm, inputs, loss)
    ref = model(*inputs)
    loss(ref).backward()
    for a, b in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    grads = stage_grads(sm)
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6), n
