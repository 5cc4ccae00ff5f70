"""Recomputing activations changes no weight: float64, every schedule (zb-h1's split backward too), stashing and
tied weights included."""
from __future__ import annotations

import pytest
import torch

from fxpipe.runtime.loop import TrainConfig
from fxpipe.runtime.recompute import recomputes
from passes.errors import FxpipeError
from tests.fxpipe.runtime import cases
from tests.fxpipe.runtime.harness import spawn

# zb-h1: chain4's stages defer their Linear weight gradients to W with the recompute's inputs; tied's last
# stage (a weight used directly) runs its whole backward in B when it recomputes (fxpipe.runtime.recompute).
# 2bw: the second step's backwards run after the first update, on the version before it (recomputing on the
# master's weights fails both 2bw rows)
CASES = [("1f1b-stash", "chain4", (1, 1, 1, 1)), ("1f1b-stash", "tied", (1, 1)), ("1f1b-flush", "skip", (1, 1, 1)),
         ("gpipe", "chain2", (2, 1)), ("1f1b-flush", "tied", (1, 1)), ("zb-h1", "chain4", (1, 1, 1, 1)),
         ("zb-h1", "tied", (1, 1)), ("2bw", "chain4", (1, 1, 1, 1)), ("2bw", "tied", (1, 1))]


def _train(schedule: str, name: str, replicas: tuple, recompute: str) -> dict:
    cfg = TrainConfig(log=False, schedule=schedule, microbatches=4, steps=2, optimizer="sgd", lr=0.1,
                      recompute=recompute).to_json()
    return cases.merged_state(name, spawn(cases.train_case, sum(replicas), (name, replicas, cfg)).ok())


@pytest.mark.parametrize("schedule,name,replicas", CASES)
def test_recompute_gives_the_same_weights(schedule: str, name: str, replicas: tuple) -> None:
    plain, again = _train(schedule, name, replicas, "none"), _train(schedule, name, replicas, "all")
    start = {k: v.detach() for k, v in cases.fakes.MODELS[name]()[0].state_dict().items()}
    assert max((plain[k] - start[k]).abs().max().item() for k in plain) > 1e-3  # training moved the weights
    for k in plain:
        assert torch.allclose(again[k], plain[k], rtol=0, atol=1e-12), k


def test_recompute_choice() -> None:
    assert recomputes("all", None, 3) and not recomputes("none", [0], 0)
    assert recomputes("auto", [1], 1) and not recomputes("auto", [1], 0)
    with pytest.raises(FxpipeError, match="--recompute"):
        recomputes("some", None, 0)


class _Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x)).pow(2).sum()


def test_recompute_runs_forward_again_on_the_stashed_version() -> None:
    """Backward after an update: the recompute must see the forward's weights, not the master's."""
    from fxpipe.runtime.recompute import recomputed
    from fxpipe.runtime.stash import WeightStash
    from passes import comm

    torch.manual_seed(0)
    m = _Counting()
    x = torch.randn(4, 3, dtype=torch.float64)
    w0 = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    want = torch.autograd.grad(torch.func.functional_call(m, w0, (x,)), list(w0.values()))
    m.calls = 0
    stash = WeightStash(m, stash=True)
    box = comm.MailboxTransport()
    loss = stash.forward(0, [x], wrap=lambda call, a: recomputed(call, a, box))
    stash.stepped()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # the optimizer moved the master before this backward
    loss.backward()
    stash.backward_done(0)
    assert m.calls == 2  # forward, then the recompute in backward
    for (name, p), g in zip(m.named_parameters(), want):
        assert torch.allclose(p.grad, g, rtol=0, atol=1e-12), name


class _InPlaceOnReceived(torch.nn.Module):
    """A stage whose first op writes its received value in place (torchvision's GoogLeNet cut after a
    BatchNorm: ``relu(inplace=True)`` on the value the previous stage sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()

    def forward(self) -> torch.Tensor:
        from passes import comm

        h = comm.recv("h", 0, (4, 3), torch.float64, True)
        return self.lin(torch.relu_(h)).pow(2).sum()


def test_recompute_may_write_a_received_value_in_place() -> None:
    """The recompute replays what the first forward received as a value it may write (a leaf may not be)."""
    from fxpipe.runtime.recompute import recomputed
    from passes import comm

    torch.manual_seed(0)
    m = _InPlaceOnReceived()
    h = torch.randn(4, 3, dtype=torch.float64)
    wanted = h.clone().requires_grad_()
    want = torch.autograd.grad(m.lin(torch.relu(wanted)).pow(2).sum(), [wanted, *m.parameters()])
    box = comm.MailboxTransport(owns_inbox=True)
    box.inbox["h"] = h.clone()
    loss = recomputed(m, [], box)
    loss.backward()
    box.collect_grads()
    got = [box.grad_out["h"], *(p.grad for p in m.parameters())]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=1e-12)


class _Decaying(torch.nn.Module):
    """A forward whose output depends on a buffer it also updates (a decaying scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.lin(x) * self.scale.clone()).pow(2).sum()  # what autograd saves: the copy
        self.scale.mul_(0.5)
        return out


def test_recompute_reads_buffers_as_its_forward_found_them() -> None:
    """Two microbatches in flight: each backward's recompute sees the buffer its own forward read (not
    the value the later forward left), and leaves the buffer where both forwards put it."""
    from fxpipe.runtime.recompute import Buffers, recomputed
    from passes import comm

    torch.manual_seed(0)
    m = _Decaying()
    xs = [torch.randn(4, 3, dtype=torch.float64) for _ in range(2)]
    want = [torch.autograd.grad(m(x), list(m.parameters())) for x in xs]  # scale 1, then 0.5
    m.scale.fill_(1.0)
    buffers = Buffers(m)
    losses = [recomputed(m, [x], comm.MailboxTransport(), buffers) for x in xs]
    for loss, w in zip(losses, want):
        got = torch.autograd.grad(loss, list(m.parameters()))
        for g, e in zip(got, w):
            assert torch.allclose(g, e, rtol=0, atol=1e-12)
    assert m.scale.item() == 0.25  # two forwards, no more
