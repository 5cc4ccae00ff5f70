"""What the runtime benchmarks share: a free local port, and a rank's memory as Linux reports it.

``mark_baseline`` / ``peak_mib`` measure the peak resident memory from a mark
on (training's, not start-up's): ``ru_maxrss`` never goes down, so imports,
unpickling the spawn arguments and loading the split would hide training's
peak. Linux resets the high-water mark (``VmHWM``) when ``5`` is written to
``/proc/self/clear_refs``; elsewhere ``ru_maxrss`` is the fallback.
"""
from __future__ import annotations

import os
import resource
import socket
from typing import Dict, Tuple

_BASE: Dict[str, float] = {}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the spawned ranks' process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_mib(field: str) -> float:
    """``/proc/self/status``'s ``field`` (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(field)


def mark_baseline() -> None:
    """Start measuring: the peak from here on is what ``peak_mib`` reports."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _BASE["rss"] = status_mib("VmRSS")
        _BASE["hwm"] = 1.0
    except OSError:
        _BASE["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_mib() -> float:
    if "hwm" in _BASE:
        return status_mib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def growth_mib() -> float:
    """Peak since the mark minus the resident size at the mark."""
    peak = peak_mib()
    return peak - _BASE.get("rss", peak)


def load_note(before: Tuple[float, float, float]) -> str:
    """The 1-minute load average before a benchmark and now, for its table's footer."""
    return f"load average {before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
