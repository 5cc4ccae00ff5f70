"""Posting point-to-point messages from a thread of their own, so the rank keeps computing.

A gloo ``dist.isend`` / ``dist.irecv`` call can return milliseconds after it
was made while using a fraction of that in CPU (docs/benchmarks.md, runtime): the
calling thread sleeps inside gloo (its I/O thread holds the pair's lock) and
the rank's next forward or backward waits for nothing. One poster thread per
process takes the posts instead, in the order the executor makes them (so
both sides still post in schedule order); the executor gets a handle at once
and waits on it where it waited on gloo's work before. The thread releases
Python's lock inside gloo, so compute goes on meanwhile.

Only for gloo on CPU: NCCL posts are cheap launches onto a stream and belong
on the caller's thread.
"""
from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Optional


class Posted:
    """A message handed to the poster thread; ``wait`` waits for the post, then for the message.

    The signal is a bare lock, held from creation until the post is made:
    releasing and acquiring it are single C calls, where an ``Event`` runs
    Python code (a condition variable) on both threads for every message,
    and the poster thread holds Python's lock meanwhile.
    """

    __slots__ = ("_posting", "_work", "_error")

    def __init__(self) -> None:
        self._posting = threading.Lock()
        self._posting.acquire()
        self._work: Any = None
        self._error: Optional[BaseException] = None

    def _done(self) -> None:
        self._posting.release()

    def wait(self, timeout: timedelta) -> Any:
        if self._work is None and self._error is None:
            if not self._posting.acquire(timeout=timeout.total_seconds()):
                raise RuntimeError(f"the message was not posted within {timeout.total_seconds():.0f} s")
            self._posting.release()
        if self._error is not None:
            raise self._error
        return self._work.wait(timeout)


class Poster:
    """One daemon thread that posts messages in the order they are given."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="fxpipe-poster", daemon=True)
        self._thread.start()

    def post(self, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Posted:
        handle = Posted()
        self._queue.put((handle, op, args, kwargs))
        return handle

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread once the posts before it are made, and wait for it: the process group
        must not be torn down under a thread that may still be inside gloo."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, op, args, kwargs = item
            try:
                handle._work = op(*args, **kwargs)
            except BaseException as exc:  # surfaces at the handle's wait, on the executor's thread
                handle._error = exc
            handle._done()


_POSTER: Optional[Poster] = None
_LOCK = threading.Lock()


def poster() -> Poster:
    """The process's poster thread (started on first use)."""
    global _POSTER
    with _LOCK:
        if _POSTER is None:
            _POSTER = Poster()
        return _POSTER


def stop_poster() -> None:
    """Stop the process's poster thread, if one runs (before ``destroy_process_group``)."""
    global _POSTER
    with _LOCK:
        if _POSTER is not None:
            _POSTER.close()
            _POSTER = None
