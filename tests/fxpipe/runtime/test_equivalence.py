"""Pipelined training over gloo equals single-process training (float64, several steps)."""
from __future__ import annotations

import pytest

from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig
from fxpipe.schedule import build_schedule
from tests.fxpipe.runtime import cases, fakes
from tests.fxpipe.runtime.harness import spawn


def _cfg(**kw: object) -> dict:
    return TrainConfig(log=False, **kw).to_json()


def _rel(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in a)


def _moved(a: dict, name: str) -> float:
    start = {k: v.detach() for k, v in fakes.MODELS[name]()[0].state_dict().items()}
    return max((a[k] - start[k]).norm().item() for k in a)


def test_flush_equals_gradient_accumulation_with_tied_weights() -> None:
    cfg = _cfg(schedule="1f1b-flush", microbatches=4, steps=3, optimizer="adamw", lr=0.01)
    results = spawn(cases.train_case, 2, ("tied", (1, 1), cfg)).ok()
    got = cases.merged_state("tied", results)  # also checks the two copies of inp.weight agree
    want = cases.accumulate("tied", 3, 4, "adamw", 0.01)
    assert _moved(got, "tied") > 1e-3
    assert _rel(got, want) <= 1e-5


def test_gpipe_with_skip_link_and_non_tensor_value() -> None:
    cfg = _cfg(schedule="gpipe", microbatches=3, steps=3, optimizer="sgd", lr=0.1)
    results = spawn(cases.train_case, 3, ("skip", (1, 1, 1), cfg)).ok()
    got = cases.merged_state("skip", results)
    assert _moved(got, "skip") > 1e-3
    assert _rel(got, cases.accumulate("skip", 3, 3, "sgd", 0.1)) <= 1e-5
    assert len(results[2]["losses"]) == 3


def _train_over_grads(rank: int, *args: object) -> object:
    """``cases.train_case`` with SGD writing every parameter's update over its gradient (the test
    models' tensors are all under the size from which it does so by default)."""
    from fxpipe.runtime import optim

    optim.INTO_GRAD_NUMEL = 0
    return cases.train_case(rank, *args)


@pytest.mark.parametrize("train", [cases.train_case, _train_over_grads], ids=["new-tensors", "over-grads"])
def test_stash_equals_pipedream_reference_four_stages(train) -> None:
    cfg = _cfg(schedule="1f1b-stash", microbatches=4, steps=2, optimizer="sgd", lr=0.1)
    results = spawn(train, 4, ("chain4", (1, 1, 1, 1), cfg)).ok()
    got = cases.merged_state("chain4", results)
    layout = Layout.of((1, 1, 1, 1))
    links = [(0, 1), (1, 2), (2, 3)]
    orders = cases.orders_of(build_schedule("1f1b-stash", layout, 8, links), layout)
    want = cases.pipedream((1, 3, 4), (1, 1, 1, 1), orders, 0.1)
    assert _rel(got, want) <= 1e-5
    # and stashing matters: plain accumulation (or no stashing) gives other weights
    assert _rel(got, cases.accumulate("chain4", 8, 1, "sgd", 0.1)) > 1e-4


def test_replicated_stage_flush_and_stash() -> None:
    layout = Layout.of((2, 1))
    flush = spawn(cases.train_case, 3, ("chain2", (2, 1), _cfg(schedule="1f1b-flush", microbatches=4, steps=3,
                                                                 optimizer="sgd", lr=0.1))).ok()
    assert _rel(cases.merged_state("chain2", flush), cases.accumulate("chain2", 3, 4, "sgd", 0.1)) <= 1e-5
    stash = spawn(cases.train_case, 3, ("chain2", (2, 1), _cfg(schedule="1f1b-stash", microbatches=4, steps=2,
                                                                 optimizer="sgd", lr=0.1))).ok()
    orders = cases.orders_of(build_schedule("1f1b-stash", layout, 8, [(0, 1)]), layout)
    want = cases.pipedream((2,), (2, 1), orders, 0.1)
    assert _rel(cases.merged_state("chain2", stash), want) <= 1e-5


def test_stash_losses_cover_every_replica_of_the_last_stage() -> None:
    """The step lines show replica 0's microbatches; the run's losses average every replica's."""
    layout, M, steps = Layout.of((1, 2)), 4, 2
    stash = spawn(cases.train_case, 3, ("chain2", (1, 2), _cfg(schedule="1f1b-stash", microbatches=M, steps=steps,
                                                                 optimizer="sgd", lr=0.1))).ok()
    orders = cases.orders_of(build_schedule("1f1b-stash", layout, steps * M, [(0, 1)]), layout)
    per_mb: dict = {}
    want = cases.pipedream((2,), (1, 2), orders, 0.1, losses=per_mb)
    assert _rel(cases.merged_state("chain2", stash), want) <= 1e-5
    expected = [sum(per_mb[s * M + m] for m in range(M)) / M for s in range(steps)]
    for rank in (1, 2):  # both replicas of the last stage
        assert stash[rank]["losses"] == pytest.approx(expected, rel=1e-9)
    shares = [sum(per_mb[s * M + m] for m in range(0, M, 2)) / (M // 2) for s in range(steps)]
    assert shares != pytest.approx(expected, rel=1e-6)  # replica 0's share alone is not the step's loss


def _within_change(got: dict, want: dict, name: str, tol: float = 1e-9) -> None:
    """Every parameter within ``tol`` of its change over the run (Frobenius norms)."""
    start = {k: v.detach() for k, v in fakes.MODELS[name]()[0].state_dict().items()}
    for k in want:
        change = (want[k] - start[k]).norm().item()
        assert change > 0, k
        assert (got[k] - want[k]).norm().item() <= tol * change, (k, (got[k] - want[k]).norm().item(), change)


def test_zb_h1_equals_gradient_accumulation() -> None:
    """Split backward (B then W, W deferred by the stage's lag) on 4 stages, and with replicas, tied weights,
    a skip link and a non-tensor value: the weights single-process accumulation gives."""
    cfg = _cfg(schedule="zb-h1", microbatches=4, steps=3, optimizer="sgd", lr=0.1)
    got = cases.merged_state("chain4", spawn(cases.train_case, 4, ("chain4", (1, 1, 1, 1), cfg)).ok())
    _within_change(got, cases.accumulate("chain4", 3, 4, "sgd", 0.1), "chain4")
    got = cases.merged_state("chain2", spawn(cases.train_case, 3, ("chain2", (2, 1), cfg)).ok())
    _within_change(got, cases.accumulate("chain2", 3, 4, "sgd", 0.1), "chain2")
    cfg = _cfg(schedule="zb-h1", microbatches=3, steps=3, optimizer="adamw", lr=0.01)
    got = cases.merged_state("skip", spawn(cases.train_case, 3, ("skip", (1, 1, 1), cfg)).ok())
    _within_change(got, cases.accumulate("skip", 3, 3, "adamw", 0.01), "skip")
    got = cases.merged_state("tied", spawn(cases.train_case, 2, ("tied", (1, 1), cfg)).ok())
    _within_change(got, cases.accumulate("tied", 3, 3, "adamw", 0.01), "tied")
