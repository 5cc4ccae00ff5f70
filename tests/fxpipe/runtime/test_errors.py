"""Every mistake on the training path ends with exit code 2 and one line naming it and the way out.

The parent-side checks run in this process (no workers start); the three
worker-side failures (a NaN loss, a raising loss function, a killed worker)
start two real torchrun workers each.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import textwrap
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

from fxpipe.cli import main

BASE = '''
    import os, torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, OUT))
    example_inputs = (torch.randn(4, 16),)
    example_targets = torch.randn(4, OUT)
    calls = [0]
    def loss_fn(out, y):
        calls[0] += 1
        if calls[0] > 3 and os.environ.get("RANK"):  # microbatch 3 in a worker (not the parent's check)
            FAIL
        return F.mse_loss(out, y)
    def batches():
        g = torch.Generator().manual_seed(0)
        for i in range(100):
            x = torch.randn(4, FEATURES, generator=g)
            if i == 3 and NAN_AT_3:
                x[0, 0] = float("nan")
            yield (x,), torch.randn(4, OUT, generator=g)
'''


def model_file(folder: Path, name: str, out: int = 4, features: int = 16, nan: bool = False,
               fail: str = "pass") -> str:
    text = (textwrap.dedent(BASE).replace("OUT", str(out)).replace("FEATURES", str(features))
            .replace("NAN_AT_3", str(nan)).replace("FAIL", fail))
    path = folder / f"{name}.py"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Model files, a 2-stage split of the good model and one of another model, a checkpoint of the first."""
    root = tmp_path_factory.mktemp("errors")
    model_file(root, "good")
    model_file(root, "other", out=5)
    for name in ("good", "other"):
        code, _, err = cli(["split", str(root / f"{name}.py"), "--devices", "2", "--replication", "none",
                            "--time-limit", "3", "--repeats", "1", "-o", str(root / f"split_{name}")])
        assert code == 0, err
    _fake_checkpoint(root / "split_good", root / "ck")
    return root


def _fake_checkpoint(split_dir: Path, folder: Path) -> None:
    """A complete checkpoint of step 2 as ``fxpipe.runtime.checkpoint.save`` lays it out."""
    from fxpipe.split_model import SplitModel

    split = SplitModel.load(split_dir)
    (folder / "step-00000002").mkdir(parents=True)
    for j, stage in enumerate(split.stages):
        torch.save({"step": 2, "stage": j, "module": stage.state_dict(), "optimizer": {}},
                   folder / "step-00000002" / f"stage{j}.pt")
    record = {"schedule": "1f1b-flush", "microbatches": 2, "step": 2, "replicas": [1, 1]}
    (folder / "latest.json").write_text(json.dumps(record))


def cli(argv: List[str]) -> Tuple[int, str, str]:
    """Run ``fxpipe ARGV`` here; exit code, stdout, stderr."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def assert_one_line(code: int, out: str, err: str, *patterns: str) -> str:
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in out + err, err[-3000:]
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    for p in patterns:
        assert re.search(p, errors[0]), (p, errors[0])
    return errors[0]


TRAIN = ["--steps", "3", "--microbatches", "2", "--threads", "1", "--timeout", "60"]


def _bad_features(w: Path) -> List[str]:
    return ["train", model_file(w, "wide", features=17), "--split", str(w / "split_good"), *TRAIN]


def _no_checkpoint_folder(w: Path) -> List[str]:
    return ["train", str(w / "good.py"), "--split", str(w / "split_good"), *TRAIN,
            "--checkpoint", str(w / "nothing"), "--resume"]


def _empty_checkpoint_folder(w: Path) -> List[str]:
    (w / "empty_ck").mkdir(exist_ok=True)
    return ["train", str(w / "good.py"), "--split", str(w / "split_good"), *TRAIN,
            "--checkpoint", str(w / "empty_ck"), "--resume"]


def _corrupt_latest(w: Path) -> List[str]:
    shutil.copytree(w / "ck", w / "ck_corrupt", dirs_exist_ok=True)
    (w / "ck_corrupt" / "latest.json").write_text('{"step": 2, "repl')  # cut off mid-write
    return ["train", str(w / "good.py"), "--split", str(w / "split_good"), *TRAIN,
            "--checkpoint", str(w / "ck_corrupt"), "--resume"]


def _checkpoint_of_other_split(w: Path) -> List[str]:
    return ["train", str(w / "other.py"), "--split", str(w / "split_other"), *TRAIN,
            "--checkpoint", str(w / "ck"), "--resume"]


def _split_of_other_model(w: Path) -> List[str]:
    return ["train", str(w / "good.py"), "--split", str(w / "split_other"), *TRAIN]


def _count(option: str, value: str):
    return lambda w: ["train", str(w / "good.py"), "--split", str(w / "split_good"), *TRAIN, option, value]


def _truncated_profile(w: Path) -> List[str]:
    text = (w / "split_good" / "profile.json").read_text()
    (w / "cut.json").write_text(text[: len(text) // 2])
    return ["plan", str(w / "cut.json"), "--devices", "2"]


def _split_output_is_a_file(w: Path) -> List[str]:
    (w / "a_file").write_text("")
    return ["split", str(w / "good.py"), "--devices", "2", "-o", str(w / "a_file")]


_SHAPE = r"(\[[\d, ]*\]|missing)"
PARENT_SIDE = {
    "batches-wrong-feature-size": (_bad_features, [r"wide\.py", r"batches\(\)", r"\(4, 17\)", r"\(4, 16\)",
                                                   "example_inputs"]),
    "resume-no-checkpoint-folder": (_no_checkpoint_folder, [r"--resume", r"nothing", r"does not exist",
                                                            r"drop --resume"]),
    "resume-no-latest-json": (_empty_checkpoint_folder, [r"--resume", r"empty_ck", r"no latest\.json",
                                                         r"drop --resume"]),
    "resume-corrupt-latest-json": (_corrupt_latest, [r"latest\.json", r"damaged", r"without --resume"]),
    "resume-checkpoint-of-other-split": (_checkpoint_of_other_split, [
        r"stage\d\.pt", r"does not belong", rf"tensor \d\.\w+: {_SHAPE} there, {_SHAPE} here", r"new --checkpoint"]),
    "split-of-other-model": (_split_of_other_model, [r"split in .*split_other", r"good\.py", r"4\.weight",
                                                     r"fxpipe split"]),
    "microbatches-0": (_count("--microbatches", "0"), [r"--microbatches", r"at least 1", r"--help"]),
    "steps-0": (_count("--steps", "0"), [r"--steps", r"at least 1"]),
    "devices-0": (_count("--devices", "0"), [r"--devices", r"at least 1"]),
    "timeout-negative": (_count("--timeout", "-1"), [r"--timeout", r"positive"]),
    "resume-without-checkpoint": (lambda w: ["train", str(w / "good.py"), "--resume"],
                                  [r"--resume needs --checkpoint DIR"]),
    "plan-bandwidth-fast": (lambda w: ["plan", str(w / "split_good" / "profile.json"), "--devices", "2",
                                       "--bandwidth", "fast"], [r"--bandwidth", r"'fast'", r"10Gbit/s"]),
    "plan-truncated-profile": (_truncated_profile, [r"cut\.json", r"not valid JSON", r"fxpipe profile"]),
    "split-output-is-a-file": (_split_output_is_a_file, [r"-o .*a_file", r"not a folder"]),
}


@pytest.mark.parametrize("case", list(PARENT_SIDE))
def test_parent_side_mistake_is_one_line(work: Path, case: str) -> None:
    argv, patterns = PARENT_SIDE[case]
    code, out, err = cli(argv(work))
    assert_one_line(code, out, err, *patterns)
    assert "starting 2 workers" not in err  # found before any worker started


def test_debug_shows_the_traceback(work: Path) -> None:
    with pytest.raises(Exception, match="was not made from"):
        main(["--debug", *_split_of_other_model(work)])


WORKER_SIDE = {
    "nan-loss": (dict(nan=True), [r"rank 1 \(stage 1\)", r"step 2, forward of microbatch 3", r"loss is nan",
                                  r"Lower --lr", r"last complete checkpoint is step 1"]),
    "loss-fn-raises": (dict(fail='raise ValueError("my loss broke")'),
                       [r"rank 1 \(stage 1\), step 2, forward of microbatch 3: ValueError: my loss broke",
                        r"workers\.log"]),
    # rank 0's "lost rank 1" follows when it writes its record before torchrun stops it (a race: a clean
    # checkout's CI run once had torchrun first); the dead rank's own line is what the message must name
    "worker-killed": (dict(fail="os._exit(9)"), [r"rank 1 exited with code 9 without an error line"]),
}


@pytest.mark.parametrize("case", list(WORKER_SIDE))
def test_worker_failure_is_one_line_and_stops_every_rank(work: Path, tmp_path: Path, case: str) -> None:
    kwargs, patterns = WORKER_SIDE[case]
    path = model_file(tmp_path, case.replace("-", "_"), **kwargs)
    ck, trace = tmp_path / "ck", tmp_path / "trace.json"
    code, out, err = cli(["train", path, "--split", str(work / "split_good"), "--steps", "4", "--microbatches", "2",
                          "--threads", "1", "--timeout", "60", "--checkpoint", str(ck), "--checkpoint-every", "1",
                          "--trace", str(trace)])
    assert_one_line(code, out, err, *patterns, re.escape(f"up to the failure: {trace}"))
    assert "step 1/4" in out and "step 2/4" not in out  # stopped in step 2: no rank waits for the timeout
    events = json.loads(trace.read_text())["traceEvents"]  # every rank that lived saved what it did
    ranks = {e["pid"] for e in events if e.get("ph") == "X"}
    assert ranks == ({0} if case == "worker-killed" else {0, 1}), ranks
    assert not list(tmp_path.glob("trace.json.rank*"))
    assert json.loads((ck / "latest.json").read_text())["step"] == 1  # the last complete checkpoint stays
    assert os.path.exists(ck / "step-00000001" / "stage1.pt")


def test_root_cause_is_the_first_failure_that_did_not_just_lose_a_peer(tmp_path: Path) -> None:
    from fxpipe.runtime import failure

    failure.record(str(tmp_path), 0, "rank 0 (stage 0), step 1, backward of microbatch 1: RECV_B1: lost rank 1 (...)")
    failure.record(str(tmp_path), 1, "rank 1 (stage 1), step 1, forward of microbatch 1: ValueError: bad")
    records = failure.read(str(tmp_path))
    records[1]["time"] = records[0]["time"] + 1.0  # reported later than its peer's loss, still the cause
    assert failure.root_cause(records)["rank"] == 1
    failure.clear(str(tmp_path))
    assert failure.root_cause(failure.read(str(tmp_path))) is None


def test_silent_rank_found_in_torchrun_failure_table(tmp_path: Path) -> None:
    """torchrun's one-line report may name a rank that did report (it left first, losing its peer);
    the rank that died without a word is then found in torchrun's failure table, and a rank torchrun
    stopped with SIGTERM is not named while another one is there."""
    from fxpipe.runtime.launch import _silent_exit

    log = tmp_path / "workers.log"
    log.write_text(textwrap.dedent("""\
        E1125 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 11) of binary: python
        Failures:
        [1]:
          time      : 2026-11-25_20:00:00
          host      : localhost
          rank      : 2 (local_rank: 2)
          exitcode  : -15 (pid: 13)  (SIGTERM)
        [2]:
          time      : 2026-11-25_20:00:00
          host      : localhost
          rank      : 1 (local_rank: 1)
          exitcode  : 9 (pid: 12)
        Root Cause (first observed failure):
        [0]:
          rank      : 0 (local_rank: 0)
          exitcode  : 1 (pid: 11)
        """))
    assert _silent_exit(str(log), {0}).startswith("rank 1 exited with code 9 without an error line")
    assert _silent_exit(str(log), {0, 1}).startswith("rank 2 exited with code -15")
    assert _silent_exit(str(log), {0, 1, 2}) == ""


def test_a_schedule_the_layout_cannot_run_is_refused_before_the_workers_start(work: Path, monkeypatch) -> None:
    """The parent builds the workers' action lists first: a ScheduleError is one line, no torchrun."""
    from fxpipe.runtime import launch
    from fxpipe.schedule import ScheduleError

    seen = []

    def refuse(cfg, layout, split, n, *a, **kw):
        seen.append((cfg.schedule, n))
        raise ScheduleError("1f1b-stash: this layout cannot run it")

    monkeypatch.setattr(launch, "segment_schedule", refuse)
    code, out, err = cli(["train", str(work / "good.py"), "--split", str(work / "split_good"), "--steps", "5",
                          "--schedule", "1f1b-stash", "--checkpoint", str(work / "ck_refused"),
                          "--checkpoint-every", "2"])
    assert_one_line(code, out, err, r"this layout cannot run it")
    assert seen == [("1f1b-stash", 1)]  # the first of the runs of steps (1, 2): sorted, it stops there
