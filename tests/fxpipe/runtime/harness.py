"""Run a function on N local ranks (gloo on 127.0.0.1, one thread each) and collect results.

Each rank is a fresh process (spawn), joins a process group on a free port
through ``fxpipe.runtime.worker.init`` and saves what the function returns.
``spawn`` never hangs a test: after ``deadline`` seconds it kills what is left
and reports it.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: Sequence[Any], out: str,
           timeout_s: float) -> None:
    import torch.distributed as dist

    from fxpipe.runtime.worker import init

    torch.set_num_threads(1)
    result: Dict[str, Any]
    t0 = time.monotonic()
    try:
        init(rank, world, timeout_s, init_method=f"tcp://127.0.0.1:{port}", device="cpu")
        try:
            result = {"ok": fn(rank, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report, not hang
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    result["seconds"] = time.monotonic() - t0
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


class Outcome:
    def __init__(self, results: Dict[int, Dict[str, Any]], exitcodes: List[Optional[int]], seconds: float) -> None:
        self.results, self.exitcodes, self.seconds = results, exitcodes, seconds

    def ok(self) -> List[Any]:
        bad = {r: v for r, v in self.results.items() if "ok" not in v}
        missing = [r for r in range(len(self.exitcodes)) if r not in self.results]
        if bad or missing:
            raise AssertionError(f"ranks failed: {[(r, v.get('trace')) for r, v in bad.items()]}; "
                                 f"no result from {missing}; exit codes {self.exitcodes}")
        return [self.results[r]["ok"] for r in range(len(self.exitcodes))]


_CTX = None


def _context() -> Any:
    """A fork server that imported torch once: each rank then starts in a fraction of a second.

    The server itself never runs torch ops or threads, so forking it is safe. It also
    imports torch._dynamo, which the first optimizer step would import in every rank (seconds).
    """
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "fxpipe.runtime.loop",
                                     "tests.fxpipe.runtime.cases"])
    return _CTX


def spawn(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), deadline: float = 60.0,
          timeout_s: float = 30.0) -> Outcome:
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.monotonic()
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, tuple(args), out, timeout_s))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.1, deadline - (time.monotonic() - t0)))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        seconds = time.monotonic() - t0
        results = {}
        for r in range(world):
            path = os.path.join(out, f"rank{r}.pt")
            if os.path.exists(path):
                results[r] = torch.load(path, weights_only=False)
        return Outcome(results, [p.exitcode for p in procs], seconds)
