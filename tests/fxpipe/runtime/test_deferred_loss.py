"""Losses kept as device tensors until the next update (what the executor does off the CPU).

On a GPU, reading each microbatch's loss as a number would make the host wait
for that forward before it can queue the backward. So there the last stage
keeps the loss tensors and reads them before each optimizer step and before
a step's report (``Executor.settle_losses``). The path is forced on here, on
the CPU (two gloo ranks, TinyGPT split in two): the losses and the weights
are bitwise those of reading at once, under flush and under stashing (an
update per minibatch), and a NaN loss still stops the run before any
update takes it.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from fxpipe.layout import Layout
from fxpipe.runtime.executor import Executor
from fxpipe.runtime.failure import NonFiniteLoss
from fxpipe.runtime.loop import TrainConfig, train
from tests.fxpipe.runtime.harness import spawn
from tests.fxpipe.runtime.test_real_split import M, _data, _load, _loss, _split

BAD = 5  # global microbatch whose loss is NaN: step 1 (0-based), microbatch 1


def _deferred() -> None:
    plain = Executor.__init__

    def init(self: Executor, *args: Any, **kwargs: Any) -> None:
        plain(self, *args, **kwargs)
        self.defer_loss = True
    Executor.__init__ = init  # this spawned process only


def _nan_at_bad(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = _loss(logits, targets.clamp_min(0))
    return loss * float("nan") if bool((targets < 0).any()) else loss


def _marked(g: int) -> Any:
    (x,), y = _data(g)
    if g == BAD:
        y = y.clone()
        y[0, 0] = -1
    return (x,), y


def _rank(rank: int, folder: str, cfg: Dict[str, Any], defer: bool, nan: bool) -> Dict[str, Any]:
    if defer:
        _deferred()
    steps: List[Dict[str, torch.Tensor]] = []
    observe = lambda ex: steps.append({k: v.detach().clone() for k, v in ex.module.state_dict().items()})  # noqa: E731
    try:
        res = train(rank=rank, layout=Layout.of((1, 1)), split=_load(folder), cfg=TrainConfig.from_json(cfg),
                    data=_marked if nan else _data, loss_fn=_nan_at_bad if nan else _loss, observe=observe)
    except NonFiniteLoss as exc:
        return {"stage": rank, "error": str(exc), "updates": len(steps)}
    except Exception as exc:  # noqa: BLE001 - the peer of the failing rank loses it
        return {"stage": rank, "lost": type(exc).__name__, "updates": len(steps)}
    return {"stage": res.stage, "state": res.state, "losses": res.losses, "updates": len(steps)}


@pytest.mark.parametrize("schedule", ["1f1b-flush", "1f1b-stash"])
def test_deferred_losses_train_bitwise_like_reading_at_once(tmp_path, schedule: str) -> None:
    folder = str(tmp_path / "split")
    _split(folder)
    cfg = TrainConfig(log=False, schedule=schedule, microbatches=M, steps=3, lr=0.05).to_json()
    now = {r["stage"]: r for r in spawn(_rank, 2, (folder, cfg, False, False)).ok()}
    later = {r["stage"]: r for r in spawn(_rank, 2, (folder, cfg, True, False)).ok()}
    assert later[1]["losses"] == now[1]["losses"] and len(now[1]["losses"]) == 3
    for stage in (0, 1):
        for k, v in now[stage]["state"].items():
            assert torch.equal(later[stage]["state"][k], v), (stage, k)


def test_a_deferred_nan_loss_stops_before_the_update_that_would_take_it(tmp_path) -> None:
    folder = str(tmp_path / "split")
    _split(folder)
    cfg = TrainConfig(log=False, schedule="1f1b-flush", microbatches=M, steps=3, lr=0.05).to_json()
    last = {r["stage"]: r for r in spawn(_rank, 2, (folder, cfg, True, True)).ok()}[1]
    assert "loss is nan" in last["error"] and "nothing was updated with it" in last["error"]
    assert last["updates"] == BAD // M  # step 0 updated; step 1, which holds the NaN, did not
