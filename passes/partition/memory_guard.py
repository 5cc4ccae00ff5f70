"""Stop a CP-SAT search when it has grown the process's memory past a limit.

CP-SAT's learned clauses grow with the time it is given: HF GPT-2 with a tied
head on 64 devices took the planner's process to 349 MB after 30 s of search
and to 0.8–1.5 GB after 60 s (four runs) on a 2-core machine. Its own ``max_memory_in_mb``
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
"""
from __future__ import annotations

import os
import resource
import sys
import threading
from typing import Callable, Optional

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
    grown by ``limit_mb`` since the block began; ``tripped`` says whether it did, ``peak_mb`` the most
    the process held, ``start_mb`` what it held at the start."""

    def __init__(self, stop: Callable[[], None], limit_mb: Optional[float] = None, poll_s: float = POLL_S) -> None:
        self.stop, self.poll_s = stop, poll_s
        self.limit_mb = LIMIT_MB if limit_mb is None else limit_mb
        self.tripped, self.peak_mb, self.start_mb = False, 0.0, 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fxpipe-memory-guard", daemon=True)

    def _watch(self) -> None:
        while True:
            now = resident_mb()
            self.peak_mb = max(self.peak_mb, now)
            if now - self.start_mb > self.limit_mb:
                self.tripped = True
                self.stop()
                return
            if self._done.wait(self.poll_s):
                return

    def __enter__(self) -> "MemoryGuard":
        self.start_mb = self.peak_mb = resident_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
