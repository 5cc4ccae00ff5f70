"""Out-of-place optimizers: torch.optim's arithmetic exactly, and the old tensors left whole.

``fxpipe.runtime.optim`` must give bit-identical parameters and state to
torch's own optimizer with the same options (per-tensor ``foreach=False``,
and ``fused=True`` as ``make_optimizer`` builds it) in float64 over several
steps, for every option it claims, or a stash built on it would silently
train a different model. And it must never write a tensor it replaces: a
stash holds those as the weights of forwards still in flight.
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.nn as nn

from fxpipe.runtime import optim
from fxpipe.runtime.optim import (CopyFreeAdamW, CopyFreeSGD, allow_in_place, copy_free_optimizer, is_out_of_place,
                                  run_step)
from fxpipe.runtime.stash import WeightStash

CASES = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.02, "maximize": True}),
    ("adamw", {"lr": 0.01}),
    ("adamw", {"lr": 0.01, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6}),
    ("adamw", {"lr": 0.02, "weight_decay": 0.1, "maximize": True}),
    ("adamw", {"lr": 0.01, "amsgrad": True}),
]
CASES += [(name, {**options, "fused": True}) for name, options in CASES if not options.get("maximize")]


@pytest.fixture(params=["into-grad", "new-tensors"])
def sgd_writes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """SGD's two ways to write the new weights: over the gradient (every tensor of the small test
    model qualifies once the size floor is 0), or into new tensors (a floor above every tensor)."""
    monkeypatch.setattr(optim, "INTO_GRAD_NUMEL", 0 if request.param == "into-grad" else 1 << 62)
    return request.param


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(50 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("name,options", CASES)
def test_matches_torch_bit_for_bit(name: str, options: Dict[str, Any], sgd_writes: str) -> None:
    ref_model, got_model = _model(), _model()
    torch_cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    ref = torch_cls(ref_model.parameters(), **({} if options.get("fused") else {"foreach": False}), **options)
    got = copy_free_optimizer(name, list(got_model.parameters()), options)
    assert is_out_of_place(got) and isinstance(got, torch_cls)
    for step in range(5):
        _grads(ref_model, step)
        _grads(got_model, step)
        if step == 2:  # a parameter without gradient is skipped, as torch skips it
            ref_model[0].bias.grad = got_model[0].bias.grad = None
        ref.step()
        got.step()
    for (n, a), b in zip(ref_model.named_parameters(), got_model.parameters()):
        assert torch.equal(a, b), f"{name} {options}: {n} differs by {(a - b).abs().max().item():.3g}"
    for a, b in zip(ref_model.parameters(), got_model.parameters()):
        for key, value in ref.state[a].items():
            assert torch.equal(value, got.state[b][key]), f"{name} {options}: state {key} differs"


@pytest.mark.parametrize("cls,options", [(CopyFreeSGD, {}), (CopyFreeSGD, {"momentum": 0.9}), (CopyFreeAdamW, {})])
def test_a_stashed_version_survives_updates_and_backpropagates(cls: type, options: Dict[str, Any],
                                                               sgd_writes: str) -> None:
    """A forward on a copy-free version, two updates, then its backward: the gradient of the old weights."""
    model = _model()
    params = list(model.parameters())
    opt = cls(params, lr=0.1, **options)
    stash = WeightStash(model, stash=True, copy_free=True)
    before = [p.detach().clone() for p in params]
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = stash.forward(0, (x,))  # a version of its own: updates come before its backward
    for step in range(2):
        _grads(model, step)
        stash.before_update()
        opt.step()
        stash.stepped()
    assert list(model.parameters()) == params  # the optimizer, checkpoints and reducers keep their handles
    assert all(not torch.equal(p, b) for p, b in zip(params, before))  # the master moved on
    for p in params:
        p.grad = None
    out.pow(2).sum().backward()  # autograd would refuse if a saved weight had been written in place
    stash.backward_done(0)
    ref = _model()
    ref(x).pow(2).sum().backward()
    for p, q in zip(params, ref.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("name,options", [("sgd", {"lr": 0.1}), ("sgd", {"lr": 0.1, "momentum": 0.9}),
                                          ("adamw", {"lr": 0.01, "fused": True})])
def test_in_place_steps_where_allowed_keep_torchs_arithmetic(name: str, options: Dict[str, Any],
                                                              sgd_writes: str) -> None:
    """Steps allowed in place (no version holds the weights) write the same tensors, the others new
    ones, and any mix of the two stays bit-identical to torch's optimizer."""
    ref_model, got_model = _model(), _model()
    torch_cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    ref = torch_cls(ref_model.parameters(), **({} if options.get("fused") else {"foreach": False}), **options)
    got = copy_free_optimizer(name, list(got_model.parameters()), options)
    for step in range(4):
        _grads(ref_model, step)
        _grads(got_model, step)
        allow_in_place(got, step % 2 == 0)
        ptrs = [p.data_ptr() for p in got_model.parameters()]
        ref.step()
        got.step()
        same = [p.data_ptr() == q for p, q in zip(got_model.parameters(), ptrs)]
        assert all(same) if step % 2 == 0 else not any(same)
    for a, b in zip(ref_model.parameters(), got_model.parameters()):
        assert torch.equal(a, b)


def test_sgd_writes_over_a_gradient_of_its_own_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The new weights take the gradient's storage where the gradient is a tensor of its own, and a
    new tensor where it is a view of a buffer shared with other gradients (a replica all-reduce's) or
    below the size floor; the old weights are never written either way."""
    monkeypatch.setattr(optim, "INTO_GRAD_NUMEL", 10)  # the 5x7 weight qualifies, the 7 bias not
    model = _model()
    w, b = model[0].weight, model[0].bias
    flat = torch.randn(21 + 3, dtype=torch.float64)
    opt = CopyFreeSGD([w, b, model[2].weight], lr=0.1)
    _grads(model, 0)
    model[2].weight.grad = flat[:21].view(3, 7)  # a view: its buffer holds another gradient too
    old = [p.detach().clone() for p in (w, b, model[2].weight)]
    ptrs = [p.data_ptr() for p in (w, b, model[2].weight)]
    grad_ptrs = [p.grad.data_ptr() for p in (w, b, model[2].weight)]
    views_before = flat.clone()
    opt.step()
    assert w.data_ptr() == grad_ptrs[0]  # over its own gradient
    assert b.data_ptr() not in (ptrs[1], grad_ptrs[1])  # too small: a new tensor
    assert model[2].weight.data_ptr() not in (ptrs[2], grad_ptrs[2])  # a view: a new tensor
    assert torch.equal(flat, views_before)  # the shared buffer is untouched
    assert all(p.grad is None for p in (w, b, model[2].weight))
    for p, o in zip((w, b, model[2].weight), old):
        assert not torch.equal(p, o)


@pytest.mark.parametrize("name,options", [("sgd", {"lr": 0.1}), ("sgd", {"lr": 0.1, "momentum": 0.9}),
                                          ("adamw", {"lr": 0.01})])
@pytest.mark.parametrize("in_place", [False, True])
def test_run_step_is_step(name: str, options: Dict[str, Any], in_place: bool, sgd_writes: str) -> None:
    """The executor's ``run_step`` (torch's wrapper skipped) updates exactly as ``step``, for the
    out-of-place optimizers either way and for torch's own."""
    models = [_model() for _ in range(3)]
    via_step = copy_free_optimizer(name, list(models[0].parameters()), options)
    via_run = copy_free_optimizer(name, list(models[1].parameters()), options)
    torch_cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    plain = torch_cls(models[2].parameters(), foreach=False, **options)
    allow_in_place(via_step, in_place)
    allow_in_place(via_run, in_place)
    for step in range(3):
        for m in models:
            _grads(m, step)
        via_step.step()
        run_step(via_run)
        run_step(plain)
    for a, b, c in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_state_dict_round_trips_with_torch() -> None:
    a, b = _model(), _model()
    got = CopyFreeAdamW(a.parameters(), lr=0.01)
    _grads(a, 0)
    got.step()
    ref = torch.optim.AdamW(b.parameters(), lr=0.01, foreach=False)
    ref.load_state_dict(got.state_dict())  # a checkpoint written by one is read by the other
    assert torch.equal(ref.state_dict()["state"][0]["exp_avg"], got.state_dict()["state"][0]["exp_avg"])


def test_unsupported_options_fall_back() -> None:
    params = list(_model().parameters())
    assert copy_free_optimizer("adamw", params, {"lr": 0.1, "differentiable": True}) is None
    assert copy_free_optimizer("mypkg:Opt", params, {"lr": 0.1}) is None
