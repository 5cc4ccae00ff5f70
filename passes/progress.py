"""A minimal progress line on stderr for long work (profiling, solving, training).

Passes take an optional ``progress`` callable so an embedding compiler can plug
in its own; this is the default the CLI uses. It redraws one line on a
terminal and prints sparse lines otherwise (CI logs stay short).
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, every_s: float = 0.2) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.done = 0
        self._start = time.monotonic()
        self._last = 0.0
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1

    def __call__(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        now = time.monotonic()
        if self._tty:
            if now - self._last >= self.every_s or self.done == self.total:
                self._last = now
                self._draw(note, end="\r")
        else:
            decile = self.done * 10 // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                self._draw(note, end="\n")

    def _draw(self, note: str, end: str) -> None:
        width = 24
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self._start
        text = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note}"
        self.stream.write(text[:120].ljust(80) + end)
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
