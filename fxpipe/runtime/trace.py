"""Chrome trace events (chrome://tracing, Perfetto) of what each rank did.

Every rank records complete events (``"ph": "X"``) with wall-clock
microseconds, so files written by processes on one machine line up when
merged: ``pid`` is the rank, thread 0 holds compute (``F3``, ``B3``,
``STEP``, ``ALLREDUCE``), thread 1 communication (``SEND_F3>r1``,
``RECV_B2<r2``) and thread 2 the time spent blocked waiting for a peer.
Every event's ``args.cpu_us`` is the CPU time the rank's thread spent in it:
wall time minus that is time the thread was blocked or waited for a core
(with more ranks than cores, a forward that took 2.8 ms of wall for 1.9 ms of
CPU was descheduled for the rest). A disabled tracer costs one attribute
check per action.

A long run is not held in memory: given its file (``spill``), a tracer writes
its events there every ``SPILL_EVENTS``, one per line, and ``save`` finishes
the file. ``merge`` reads the rank files line by line, so the parent joining
them holds no more than a line at a time either.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO

_THREADS = {"compute": 0, "comm": 1, "wait": 2}
SPILL_EVENTS = 4096  # events a tracer holds before it writes them out (a few hundred bytes each)
_HEAD, _TAIL = '{"traceEvents": [\n', '\n], "displayTimeUnit": "ms"}\n'


class Tracer:
    def __init__(self, rank: int, enabled: bool = True, spill: Optional[str] = None) -> None:
        """``spill``: the file ``save`` will write; events go there as they pile up (else all are kept)."""
        self.rank = rank
        self.enabled = enabled
        self.events: List[Dict[str, Any]] = []  # the events not written out yet
        self.spill = spill
        self._out: Optional[TextIO] = None
        self.written = 0
        self.saved = False  # a second ``save`` (after a failure past the first) leaves the file as it is

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args: Any) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.time_ns()
        cpu = time.thread_time_ns()
        try:
            yield
        finally:
            end = time.time_ns()
            args = dict(args, cpu_us=(time.thread_time_ns() - cpu) / 1000.0)
            self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank,
                                "tid": _THREADS.get(cat, 0), "ts": start / 1000.0,
                                "dur": (end - start) / 1000.0, "args": args})
            if self.spill is not None and len(self.events) >= SPILL_EVENTS:
                self._write_out(self.spill)

    def wait_span(self, what: str) -> Any:
        return self.span(f"wait {what}", "wait") if self.enabled else None

    def _write_out(self, path: str) -> None:
        """The events held to ``path``, one per line (opened, with the rank's names, the first time)."""
        if self._out is None:
            self._out = open(path, "w")
            self._out.write(_HEAD)
            meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
            meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": cat}}
                     for cat, tid in _THREADS.items()]
            self._out.write(",\n".join(json.dumps(e) for e in meta))
        for e in self.events:
            self._out.write(",\n" + json.dumps(e))
        self.written += len(self.events)
        self.events = []

    def save(self, path: str) -> None:
        """The trace file: the events written out so far (``spill`` must be ``path`` then), then the rest."""
        if self._out is not None and os.path.abspath(path) != os.path.abspath(self.spill or ""):
            raise ValueError(f"this tracer writes {self.spill}, not {path}")
        if self.saved:
            return
        self.saved = True
        self._write_out(path)
        out, self._out = self._out, None
        if out is not None:
            out.write(_TAIL)
            out.close()


def rank_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its part of the trace ``path``."""
    return f"{path}.rank{rank}"


def _events(path: str, partial: bool = False) -> Iterator[Dict[str, Any]]:
    """The events of a rank's file, a line at a time (as ``Tracer.save`` writes them).

    ``partial``: the file may be cut short (a rank killed while writing it);
    it is read up to its last whole event."""
    with open(path) as f:
        for line in f:
            line = line.strip().rstrip(",")
            if line.startswith("{") and not line.startswith('{"traceEvents"'):
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    if partial:
                        return
                    raise
                yield event


def merge(parts: Sequence[str], out: str, remove: bool = True, partial: bool = False) -> int:
    """Join per-rank trace files into one, streaming; timestamps start at zero. Returns the event count.

    ``partial``: after a failed run, where a killed rank's file may end mid-event."""
    parts = [p for p in parts if os.path.exists(p)]
    t0 = min((e["ts"] for p in parts for e in _events(p, partial) if "ts" in e), default=0.0)
    n = 0
    with open(out, "w") as f:
        f.write(_HEAD)
        for p in parts:
            for e in _events(p, partial):
                if "ts" in e:
                    e["ts"] -= t0
                f.write((",\n" if n else "") + json.dumps(e))
                n += 1
        f.write(_TAIL)
    if remove:
        for p in parts:
            os.remove(p)
    return n
