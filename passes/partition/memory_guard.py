"""Stop the planner's searches when they have grown the process's memory past a limit.

CP-SAT's learned clauses grow with the time it is given: HF GPT-2 with a tied
head on 64 devices took the planner's process to 349 MB after 30 s of search
and to 0.8–1.5 GB after 60 s (four runs) on a 2-core machine (its presolve's
dual reductions, repeated in the LNS workers, and its later presolve passes
are now off, ``model.py``: 723–725 MB at 60 s since, 1,121–1,249 MB the same
day with them). Its own ``max_memory_in_mb``
parameter did not stop it there (set to 300 MB, the same run reached 1.3 GB;
or-tools issue 1944 calls it a known issue), and the planner promises at most
1 GiB. So a thread polls the process's resident size while the search runs
and stops it once the search has added ``LIMIT_MB`` to what the process held
when it began: CP-SAT then answers the best plan and bound it holds, as it
does at its time limit. The growth, not the size, is what is limited: the
process may hold a captured model, torch and whatever its caller loaded
(pytest's process after a thousand tests, or ``fxpipe split`` on a large
model, sits far above 1 GiB before any search), and a limit on the size
stopped every search there at once.

The dynamic programs allocate too: on the H100-profiled 8-block GPT, two-level
machine of 256 devices under PipeDream's charges, the placed DP's passes took a
planner-only process from 51 MB to 953 MB within a 60-s limit (the memory is
given back when the passes end). So ``partition`` runs inside ``planning()``:
a watcher measures the growth from the call's start, and once it passes
``LIMIT_MB`` every deadline check of the searches (``past``) answers "past",
so each search stops as it would at the time limit; CP-SAT's guard counts
from the same start.
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

LIMIT_MB = 600.0  # growth: a planner-only process starts at 50-190 MB, so it stays under 1 GiB with room for
# what the search allocates before it stops (44 MB seen between polls; at 800 MB, the H100-profiled HF GPT-2
# untied on 32 devices, which begins its search at 131 MB, ended at 1,174 MB in three runs of fourteen)
POLL_S = 0.05


def resident_mb() -> float:
    """This process's resident memory now (Linux), else its peak so far (other systems)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024


class MemoryGuard:
    """``with MemoryGuard(solver.stop_search): solver.Solve(...)`` stops the search once the process has
    grown by ``limit_mb`` since the block began (inside ``planning()``: since the planning began);
    ``tripped`` says whether it did, ``peak_mb`` the most the process held, ``start_mb`` what it held at
    the start."""

    def __init__(self, stop: Callable[[], None], limit_mb: Optional[float] = None, poll_s: float = POLL_S) -> None:
        self.stop, self.poll_s = stop, poll_s
        self.limit_mb = LIMIT_MB if limit_mb is None else limit_mb
        self.tripped, self.peak_mb, self.start_mb = False, 0.0, 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fxpipe-memory-guard", daemon=True)

    def _watch(self) -> None:
        while True:
            if not self.tripped:
                now = resident_mb()
                self.peak_mb = max(self.peak_mb, now)
                self.tripped = now - self.start_mb > self.limit_mb
            if self.tripped:  # again at every poll: a stop that comes before the search has begun is lost
                self.stop()
            if self._done.wait(self.poll_s):
                return

    def __enter__(self) -> "MemoryGuard":
        self.peak_mb = resident_mb()
        self.start_mb = min(self.peak_mb, _active.start_mb) if _active is not None else self.peak_mb
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


_active: Optional[MemoryGuard] = None  # the planning budget of the ``partition`` call running now


@contextmanager
def planning(limit_mb: Optional[float] = None) -> Iterator[MemoryGuard]:
    """The budget of one planning call: ``past`` answers True once the process has grown by
    ``limit_mb`` (default ``LIMIT_MB``) since it began. A call inside another shares the outer budget."""
    global _active
    if _active is not None:
        yield _active
        return
    guard = MemoryGuard(lambda: None, limit_mb)
    with guard:
        _active = guard
        try:
            yield guard
        finally:
            _active = None


def past(deadline: float) -> bool:
    """Whether a search must stop now: the deadline has passed, or the planning budget is spent."""
    return time.monotonic() > deadline or (_active is not None and _active.tripped)


def pass_deadline(began: float, done: float, soft: float, deadline: float) -> float:
    """Until when a pass begun at ``began``, with the share ``done`` (0 to 1) of its work behind it, may
    run: ``deadline`` where its pace so far brings it to its end by then, else ``soft`` (where earlier).
    ``chain.solve`` lets the one pass that can prove the caller's plan within 1 % run past the search's
    deadline (``soft``) into the time of the polish that follows: only a pass that will finish there
    takes that time, one that could not stops at ``soft`` as any other pass would."""
    if soft >= deadline:
        return deadline
    on_pace = done > 0 and began + (time.monotonic() - began) / done <= deadline
    return deadline if on_pace else soft
