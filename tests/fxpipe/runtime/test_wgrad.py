"""The split backward (input half, then weight half) equals one whole backward, in float64."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from fxpipe.runtime.wgrad import backward_input


class Stage(nn.Module):
    """A received value, a weight used three times (once through a shared transpose), a branch of params only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.other = nn.Linear(6, 6)
        self.bias_only = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        x.add_(0.5)  # in place on the received value: its recorded edge must stay the received one
        h = torch.tanh(self.lin(x))
        h = torch.tanh(self.lin(h)) + self.other(h)
        wt = self.lin.weight.t()
        return h @ wt + h @ wt * 0.5 + self.bias_only.sin() + h @ self.lin.weight


def _run(split: bool):
    torch.manual_seed(0)
    stage = Stage().double()
    received = torch.randn(4, 6, dtype=torch.float64).requires_grad_()
    x = received.view_as(received)  # a non-leaf stand-in for the mailbox's output
    edge = get_gradient_edge(x)
    out = stage(x)
    roots = [(out ** 2).sum(), out.mean()]  # a loss and a second root (a send token)
    ones = [torch.ones_like(r) for r in roots]
    if split:
        (gx,), weight = backward_input(roots, ones, [edge])
        assert all(p.grad is None for p in stage.parameters())  # nothing of the weight half ran yet
        weight.run()
    else:
        torch.autograd.backward(roots, ones, inputs=[x] + list(stage.parameters()))
        gx = x.grad
    return gx, {n: p.grad for n, p in stage.named_parameters()}


class Chain(nn.Module):
    """Each parameter used once: the weight half restarts at each node, the input path does not run again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(6, 6), nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(torch.tanh(self.a(x))))


def test_split_backward_equals_whole_backward_on_a_chain() -> None:
    torch.manual_seed(0)
    stage = Chain().double()
    runs = []
    for split in (True, False):
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        x2 = x.view_as(x)
        stage.zero_grad()
        loss = stage(x2).pow(2).sum()
        if split:
            (gx,), weight = backward_input([loss], [torch.ones_like(loss)], [get_gradient_edge(x2)])
            assert not weight.from_roots
            weight.run()
        else:
            gx, = torch.autograd.grad(loss, x2, retain_graph=True)
            loss.backward()
        runs.append((gx, [p.grad.clone() for p in stage.parameters()]))
    (gx, grads), (want_x, want) = runs
    assert torch.allclose(gx, want_x, rtol=1e-12, atol=1e-14)
    assert all(torch.allclose(g, w, rtol=1e-12, atol=1e-14) for g, w in zip(grads, want))


def test_split_backward_equals_whole_backward() -> None:
    gx, grads = _run(split=True)
    want_x, want = _run(split=False)
    assert torch.allclose(gx, want_x, rtol=1e-12, atol=1e-12)
    for name in want:
        assert grads[name] is not None, name
        assert torch.allclose(grads[name], want[name], rtol=1e-12, atol=1e-12), name


def test_no_received_value_leaves_the_whole_backward_to_w() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    loss = lin(torch.randn(2, 3, dtype=torch.float64)).sum()
    grads, weight = backward_input([loss], [torch.ones_like(loss)], [])
    assert grads == [] and lin.weight.grad is None
    weight.run()
    assert lin.weight.grad is not None and lin.bias.grad is not None
