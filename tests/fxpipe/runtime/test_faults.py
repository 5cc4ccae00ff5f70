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


MODEL = "chain2-dropout"  # every rank draws dropout masks: the resumed run must draw the same ones


def _run(schedule: str, steps: int, ckpt: str, resume: bool = False) -> list:
    cfg = TrainConfig(log=False, schedule=schedule, microbatches=2, steps=steps, optimizer="adamw", lr=0.01,
                      checkpoint=ckpt, checkpoint_every=2, resume=resume).to_json()
    return spawn(cases.train_case, 2, (MODEL, (1, 1), cfg)).ok()


@pytest.mark.parametrize("schedule", ["1f1b-stash", "2bw"])
def test_resume_continues_like_an_uninterrupted_run(tmp_path, schedule: str) -> None:
    """Weights, optimizer state and each rank's random numbers (dropout) continue where they stopped;
    2bw's checkpoint also holds the version before the master's, which its next batch runs on."""
    whole = _run(schedule, 4, str(tmp_path / "a"))
    _run(schedule, 2, str(tmp_path / "b"))
    resumed = _run(schedule, 4, str(tmp_path / "b"), resume=True)
    assert resumed[0]["start"] == 2 and len(resumed[1]["losses"]) == 2
    assert whole[1]["losses"][2:] == pytest.approx(resumed[1]["losses"], rel=1e-12)
    got, want = cases.merged_state(MODEL, resumed), cases.merged_state(MODEL, whole)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)


def test_checkpoint_without_random_state_resumes_with_a_warning(tmp_path) -> None:
    """A checkpoint an older fxpipe wrote (no ``rng<rank>.pt``) still resumes, and says what differs."""
    import json

    from fxpipe.layout import Layout
    from fxpipe.runtime import checkpoint

    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    where = tmp_path / "step-00000002"
    where.mkdir()
    torch.save({"step": 2, "stage": 0, "module": module.state_dict(), "optimizer": optimizer.state_dict()},
               where / "stage0.pt")
    (tmp_path / "latest.json").write_text(json.dumps({"step": 2, "replicas": [1]}))
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match="no random-number state for rank 0"):
        assert checkpoint.restore(str(tmp_path), 0, Layout.of((1,)), module, optimizer, {}) == 2
    assert torch.equal(torch.get_rng_state(), before)
    torch.save({"cpu": before}, where / "rng0.pt")  # with the file: the generator is put back as saved
    torch.rand(3)
    checkpoint.restore(str(tmp_path), 0, Layout.of((1,)), module, optimizer, {})
    assert torch.equal(torch.get_rng_state(), before)
