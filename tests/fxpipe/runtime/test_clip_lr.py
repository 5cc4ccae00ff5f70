"""Gradient clipping across stages and learning-rate schedules, exact in float64.

The model is ``TiedLM`` (``test_tied_exact``): one embedding table used by
two lookups in stage 0 and by the output head in the last stage, so a tied
weight crosses stages. Layouts: ``1-1`` (two stages) and ``1-2-1`` (three
stages, the middle one on two replicas). One process launch per layout runs
every case in turn, each from freshly loaded stage files.

Checked, every parameter within 1e-9 of its change over the run:

- ``1f1b-flush`` (SGD, cosine decay after a warm-up) and ``gpipe`` (AdamW,
  linear decay), clipped: single-process training of the unsplit model,
  gradient accumulation, ``torch.nn.utils.clip_grad_norm_``, the step's rate,
  step. The norm every rank reports equals ``clip_grad_norm_``'s, and it is
  above the clip threshold, so clipping really acted;
- ``1f1b-stash`` (SGD, linear decay after a warm-up), clipped:
  ``cases.pipedream_split`` with each update clipped by the norm of the
  stages updating together (the tied stages as one, the tied weight once),
  at the rate of the update's minibatch's step;
- resume: 4 steps straight equal (bit for bit) 2 steps, a checkpoint, a crash
  in step 3, and a resumed run of the last 2, learning rates included; a
  resume with another ``lr_schedule`` is refused.
"""
from __future__ import annotations

import io
import math
from contextlib import redirect_stdout
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch

from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig, train
from fxpipe.runtime.lr_schedule import LRScheduleError, lr_at
from fxpipe.runtime.report import Reporter, StepStats
from fxpipe.schedule import build_schedule
from tests.fxpipe.runtime import cases
from tests.fxpipe.runtime import test_tied_exact as tied
from tests.fxpipe.runtime.harness import spawn

NAME, M, TOL = "tiedlm", 4, 1e-9
CLIP = 0.3  # below every step's norm here: each step is clipped (asserted)


@dataclass(frozen=True)
class Run:
    cfg: Dict[str, Any]
    crash_after: int = 0  # raise after this many optimizer steps (a crash after a checkpoint)


class _Crash(RuntimeError):
    pass


def _cfg(**kw: Any) -> Dict[str, Any]:
    return TrainConfig(log=False, microbatches=M, **kw).to_json()


def _runs(ckpt: str) -> List[Run]:
    resumable = dict(schedule="1f1b-flush", steps=4, optimizer="sgd", lr=0.2, clip_grad_norm=CLIP,
                     lr_schedule="cosine", warmup_steps=1, min_lr=0.02)
    return [Run(_cfg(schedule="1f1b-flush", steps=3, optimizer="sgd", lr=0.2, clip_grad_norm=CLIP,
                     lr_schedule="cosine", warmup_steps=1)),
            Run(_cfg(schedule="gpipe", steps=3, optimizer="adamw", lr=0.02, clip_grad_norm=CLIP,
                     lr_schedule="linear")),
            Run(_cfg(schedule="1f1b-stash", steps=2, optimizer="sgd", lr=0.2, clip_grad_norm=CLIP,
                     lr_schedule="linear", warmup_steps=1)),
            Run(_cfg(**resumable)),
            Run(_cfg(**resumable, checkpoint=ckpt, checkpoint_every=2), crash_after=3),
            Run(_cfg(**resumable, checkpoint=ckpt, checkpoint_every=2, resume=True)),
            Run(_cfg(**dict(resumable, lr_schedule="linear"), checkpoint=ckpt, resume=True))]


def _rank(rank: int, layout: Tuple[int, ...], folder: str, runs: Sequence[Run]) -> List[Dict[str, Any]]:
    from fxpipe.split_model import SplitModel

    out: List[Dict[str, Any]] = []
    for run in runs:
        done = [0]

        def observe(_: Any, run: Run = run) -> None:
            done[0] += 1
            if done[0] == run.crash_after:
                raise _Crash("crashed on purpose")
        try:
            res = train(rank=rank, layout=Layout.of(layout), split=SplitModel.load(folder),
                        cfg=TrainConfig.from_json(run.cfg), data=tied.CASES[NAME].data, loss_fn=tied.CASES[NAME].loss,
                        observe=observe if run.crash_after else None)
        except Exception as exc:  # noqa: BLE001 - the test looks at which
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        out.append({"stage": res.stage, "state": res.state, "lrs": res.lrs, "norms": res.grad_norms,
                    "start": res.start_step})
    return out


def _reference(split: Any, layout: Tuple[int, ...], cfg: TrainConfig, norms: List[float]) -> Dict[str, torch.Tensor]:
    case = tied.CASES[NAME]
    if cfg.schedule == "1f1b-stash":
        lay = Layout.of(layout)
        tied_stages = sorted({s for st in split.tied.values() for s in st})
        acts = build_schedule(cfg.schedule, lay, cfg.steps * M, split.links, tied_stages)
        return cases.pipedream_split(split, layout, cases.orders_of(acts, lay), lambda m: cfg.lr_of(m // M),
                                     case.data, case.loss, clip=cfg.clip_grad_norm)
    model = tied._model(NAME)
    cases.accumulate_model(model, case.data, case.loss, cfg.steps, M, cfg.optimizer, cfg.lr,
                           clip=cfg.clip_grad_norm, lr_of=cfg.lr_of, norms=norms)
    return {k: p.detach() for k, p in model.named_parameters()}


def _assert_exact(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> None:
    start = dict(tied._model(NAME).named_parameters())
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        moved = (want[k] - start[k]).norm().item()
        assert moved > 1e-6, (what, k, moved)
        err = (got[k] - want[k]).norm().item()
        assert err <= TOL * moved, (what, k, err / moved)


def _check_clipped(layout: Tuple[int, ...], split: Any, runs: List[Run], results: List[List[Dict[str, Any]]]) -> None:
    for i, run in enumerate(runs[:3]):
        cfg = TrainConfig.from_json(run.cfg)
        per_rank = [r[i] for r in results]
        want_norms: List[float] = []
        want = _reference(split, layout, cfg, want_norms)
        _assert_exact(cases.merge_states(split.param_names, per_rank), want, f"{layout} {cfg.schedule}")
        for r in per_rank:
            assert r["lrs"] == [cfg.lr_of(s) for s in range(cfg.steps)], (cfg.schedule, r["lrs"])
            assert len(r["norms"]) == cfg.steps and max(r["norms"]) > CLIP, r["norms"]
            if cfg.schedule != "1f1b-stash":  # the global norm, on every rank, is clip_grad_norm_'s
                assert min(r["norms"]) > CLIP, r["norms"]
                assert r["norms"] == pytest.approx(want_norms, rel=1e-12, abs=0)


def _check_resume(split: Any, runs: List[Run], results: List[List[Dict[str, Any]]]) -> None:
    straight, crashed, resumed, refused = ([r[i] for r in results] for i in range(3, 7))
    cfg = TrainConfig.from_json(runs[3].cfg)
    _assert_exact(cases.merge_states(split.param_names, straight), _reference(split, (1, 1), cfg, []), "straight")
    assert all("crashed on purpose" in r["error"] for r in crashed), crashed
    for a, b in zip(straight, resumed):
        assert b["start"] == 2 and b["lrs"] == a["lrs"][2:] and b["norms"] == a["norms"][2:]
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k
    assert all("CheckpointError" in r["error"] and "lr_schedule='cosine'" in r["error"] for r in refused), refused


@pytest.mark.parametrize("layout", [(1, 1), (1, 2, 1)], ids=lambda l: "-".join(map(str, l)))
def test_clipping_and_schedules_exact(layout: Tuple[int, ...], tmp_path) -> None:
    folder = str(tmp_path / "split")
    split = tied._save_split(NAME, layout, folder)
    runs = _runs(str(tmp_path / "ckpt"))
    if layout != (1, 1):
        runs = runs[:3]  # resume once is enough
    results = spawn(_rank, Layout.of(layout).world_size, (layout, folder, runs), deadline=180.0).ok()
    _check_clipped(layout, split, runs, results)
    if layout == (1, 1):
        _check_resume(split, runs, results)


def test_lr_schedule_values() -> None:
    """The definitions, at points worked out by hand (lr 1, min 0.1, 10 steps, warm-up 2)."""
    kw = dict(lr=1.0, steps=10, warmup=2, min_lr=0.1)
    assert [lr_at(s, lr_schedule="constant", **kw) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    # after the warm-up p = (s - 2) / 8
    assert lr_at(2, lr_schedule="linear", **kw) == 1.0
    assert lr_at(6, lr_schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(9, lr_schedule="linear", **kw) == pytest.approx(0.1 + 0.9 / 8)
    assert lr_at(6, lr_schedule="cosine", **kw) == pytest.approx(0.55)  # cos(pi / 2) = 0
    assert lr_at(9, lr_schedule="cosine", **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 8)))
    assert lr_at(0, lr=0.3, steps=5, lr_schedule="cosine") == 0.3  # no warm-up: the first step at lr


@pytest.mark.parametrize("kw,words", [
    (dict(lr_schedule="step"), ["--lr-schedule", "'step'", "constant, cosine, linear"]),
    (dict(warmup_steps=-1), ["--warmup-steps", ">= 0"]),
    (dict(min_lr=0.5, lr=0.1), ["--min-lr", "between 0 and --lr"]),
    (dict(clip_grad_norm=0.0), ["--clip-grad-norm", "above 0"])])
def test_bad_settings_fail_at_config(kw: Dict[str, Any], words: List[str]) -> None:
    with pytest.raises(LRScheduleError) as err:
        TrainConfig(**kw)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_step_line_shows_lr_and_grad_norm() -> None:
    stats = StepStats(clipping=True)
    stats.record(0, 0.05, torch.tensor(1.25, dtype=torch.float64))
    stats.record(0, 0.05, torch.tensor(1.5, dtype=torch.float64))  # stash: updates of one step, the largest shown
    rep = Reporter(3, 2, 8, True, [(0, 2.0), (1, 4.0)], notes=stats.note)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rep.step_done(0)
    assert buf.getvalue().startswith("step 1/3  loss 3.000000  lr 0.05  grad norm 1.5  samples/s "), buf.getvalue()


def test_finish_prints_the_loss_over_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stash / 2bw: step lines carry replica 0's share; ``finish`` sums the replicas and prints the result."""
    import fxpipe.runtime.report as report

    def as_if_two_replicas(total: torch.Tensor, group: Any = None) -> None:  # the other replica: 2x the losses
        total[:, 0] *= 3.0
        total[:, 1] *= 2.0

    monkeypatch.setattr(report.dist, "all_reduce", as_if_two_replicas)
    rep = Reporter(2, 2, 8, True, [(0, 2.0), (1, 4.0), (2, 1.0), (3, 1.0)], final_group=object())
    buf = io.StringIO()
    with redirect_stdout(buf):
        rep.step_done(0)
        rep.step_done(1)
        rep.finish()
    lines = buf.getvalue().splitlines()
    assert lines[-1] == "over every replica: loss 4.500000 at step 1, 1.500000 at step 2", lines
    assert rep.step_losses == [4.5, 1.5]
