"""How a failure on one rank becomes the one line ``fxpipe train`` prints.

A worker that fails writes ``errors/rank<r>.json`` in the run folder (its one
line, when it failed, and whether it merely lost a peer) and prints the same
line. The parent reads those files after torchrun exits and shows the root
cause: the first failure that is not "lost rank N" (a rank that dies makes
its peers fail with that), else the first at all. torchrun's own report, and
any traceback, go to ``workers.log`` in the run folder, not to the screen.

The line says which rank, which stage, which action (``step 2, forward of
microbatch 5``) and what went wrong. ``Executor.run`` marks an exception with
the action it escaped from (``mark_action``) only when one is raised, so the hot
loop keeps no bookkeeping for the rare case that it fails.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any, Dict, List, Optional, Tuple

from passes.errors import FxpipeError

ERRORS_DIR = "errors"
_LOST = re.compile(r"lost (rank \d+|a peer)")
_GLOO_NOTE = re.compile(r"\[[^\]]*gloo[^\]]*\] | This is typically caused by a remote worker crashing\..*$")


class NonFiniteLoss(FxpipeError):
    """The loss of a microbatch is NaN or infinite: training stops before the update."""


def check_loss(value: float) -> None:
    """Raise ``NonFiniteLoss`` unless a microbatch's loss ``value`` is finite (``where`` adds which one)."""
    if not math.isfinite(value):
        raise NonFiniteLoss(f"the loss is {value} (not finite); nothing was updated with it. Lower --lr, "
                            "check the data and the loss function, or resume from the last checkpoint")


_ACTIONS = {"F": "forward", "B": "backward", "SEND_F": "sending the activations",
            "RECV_F": "receiving the activations", "SEND_B": "sending the gradients",
            "RECV_B": "receiving the gradients"}


def mark_action(exc: BaseException, action: Any, g: int) -> None:
    """Record on ``exc`` the action it escaped from (the executor calls this); the first mark stays."""
    if getattr(exc, "fxpipe_action", None) is None:
        try:
            exc.fxpipe_action = (action, g)
        except AttributeError:  # an exception type without attributes: the line then names no action
            pass


def _failed_action(exc: Optional[BaseException]) -> Optional[Tuple[Any, int]]:
    """The action marked on ``exc`` or on an exception it was raised from, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = getattr(exc, "fxpipe_action", None)
        if found is not None:
            return found
        exc = exc.__cause__ or exc.__context__
    return None


def where(exc: BaseException, microbatches: int) -> str:
    """``step 2, forward of microbatch 5`` for an exception raised inside an action, else ``""``."""
    found = _failed_action(exc)
    if found is None:
        return ""
    a, g = found
    kind = getattr(getattr(a, "kind", None), "value", "")
    if kind == "ALLREDUCE":
        return "the gradient all-reduce"
    if kind == "STEP":
        return "the optimizer step"
    what = _ACTIONS.get(kind, str(a))
    peer = getattr(a, "peer", -1)
    to = ""
    if kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B") and peer >= 0:
        to = f" {'to' if kind.startswith('SEND') else 'from'} rank {peer}"
    step = f"step {g // max(microbatches, 1) + 1}, " if g >= 0 else ""
    return f"{step}{what} of microbatch {g}{to}"


def describe(exc: BaseException, rank: int, stage: Optional[int], microbatches: int) -> str:
    """The one line for ``exc`` on ``rank``: who, doing what, and the message."""
    who = f"rank {rank}" + (f" (stage {stage})" if stage is not None else "")
    action = where(exc, microbatches)
    text = _GLOO_NOTE.sub("", " ".join(str(exc).split()))
    if not isinstance(exc, FxpipeError):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{who}{', ' + action if action else ''}: {text}"


def record(run_dir: str, rank: int, line: str) -> None:
    """Write this rank's failure for the parent (best effort: the line is printed as well)."""
    folder = os.path.join(run_dir, ERRORS_DIR)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".rank{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "time": time.time(), "line": line, "lost_peer": bool(_LOST.search(line))}, f)
        os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))
    except OSError:
        pass


def clear(run_dir: str) -> None:
    """Forget failures of an earlier run in the same folder."""
    folder = os.path.join(run_dir, ERRORS_DIR)
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        os.remove(os.path.join(folder, name))


def read(run_dir: str) -> List[Dict[str, Any]]:
    """Every failure the ranks recorded (``rank``, ``time``, ``line``, ``lost_peer``)."""
    folder = os.path.join(run_dir, ERRORS_DIR)
    records: List[Dict[str, Any]] = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    records.append(json.load(f))
            except (OSError, ValueError):
                continue
    return records


def root_cause(records: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The failure that started it all: the first that is not a lost peer, else the first; None if none."""
    if not records:
        return None
    return min(records, key=lambda r: (bool(r.get("lost_peer")), float(r.get("time", 0.0))))
