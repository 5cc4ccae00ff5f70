"""A failing peer ends the run with an error in bounded time; resume equals an uninterrupted run."""
from __future__ import annotations

import pytest
import torch

from fxpipe.runtime.loop import TrainConfig
from tests.fxpipe.runtime import cases
from tests.fxpipe.runtime.harness import spawn


@pytest.mark.parametrize("how", ["raise", "kill", "hang"])
def test_failing_worker_stops_the_others(how: str) -> None:
    timeout = 3.0
    cfg = TrainConfig(log=False, schedule="1f1b-flush", microbatches=4, steps=6, lr=0.1,
                      timeout_s=timeout).to_json()
    fault = (1, "hang" if how == "hang" else how, 9)  # rank 1 fails inside step 2
    out = spawn(cases.train_case, 2, ("chain2", (1, 1), cfg, fault), deadline=20.0, timeout_s=timeout)
    survivor = out.results.get(0, {})
    assert "error" in survivor, f"rank 0 did not fail: {survivor}"
    assert "TransportError" in survivor["error"] and "rank 1" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < timeout + 10.0  # bounded: the timeout at worst, not a hang
    if how == "raise":
        assert "injected failure" in out.results[1]["error"]


def _run(steps: int, ckpt: str, resume: bool = False) -> list:
    cfg = TrainConfig(log=False, schedule="1f1b-stash", microbatches=2, steps=steps, optimizer="adamw", lr=0.01,
                      checkpoint=ckpt, checkpoint_every=2, resume=resume).to_json()
    return spawn(cases.train_case, 2, ("chain2", (1, 1), cfg)).ok()


def test_resume_continues_like_an_uninterrupted_run(tmp_path) -> None:
    whole = _run(4, str(tmp_path / "a"))
    _run(2, str(tmp_path / "b"))
    resumed = _run(4, str(tmp_path / "b"), resume=True)
    assert resumed[0]["start"] == 2 and len(resumed[1]["losses"]) == 2
    assert whole[1]["losses"][2:] == pytest.approx(resumed[1]["losses"], rel=1e-12)
    got, want = cases.merged_state("chain2", resumed), cases.merged_state("chain2", whole)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
