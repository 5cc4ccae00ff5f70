"""A pass's pool stages kept row by row in one table per field, read back by gathering.

A placed pass asks, for every segment, the stages from each earlier point still
in its pool to each point of the segment: a row of records per pool point.
Equal runs of blocks give equal rows (``ChainSolver.row_keys``), so a row is
worked out once per T and read again. Keeping those rows as separate records
meant stitching every field of every row together for each segment, though
most of a pass reads a few fields for all its pairs and the rest for a few
(96 blocks on 1,024 devices under PipeDream's charges: 0.7 s of a 4-s pass).
Here every row lives in one 2-D table per field, and a segment's stages are a
view that gathers a field when it is first read, for all pairs or for some.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np


class RowStore:
    """Rows of ``width`` stage records (a NamedTuple of equal-length arrays), one table per field.

    Rows with a key are kept for the pass (as many as the caller has room for); the others (no key,
    or no room) live in the slots after the kept ones until the next ``put`` overwrites them, which
    is as long as the segment that asked for them uses them."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.kind: Optional[type] = None
        self.tables: Dict[str, np.ndarray] = {}
        self.kept = 0
        self.slot: Dict[object, int] = {}

    def find(self, keys: Sequence[object]) -> np.ndarray:
        """Per key, its kept row, or -1 (no key, or not kept)."""
        return np.fromiter((-1 if key is None else self.slot.get(key, -1) for key in keys), dtype=np.int64,
                           count=len(keys))

    def put(self, records, keys: List[object], room: int) -> np.ndarray:
        """Store ``records`` (``len(keys)`` rows of ``width`` stages, row after row), keeping at most
        ``room`` of the rows with keys; their slots."""
        n = len(keys)
        if self.kind is None:
            self.kind = type(records)
        keep = [k for k, key in enumerate(keys) if key is not None and key not in self.slot]
        keep = keep[:max(0, room)]
        slots = np.empty(n, dtype=np.int64)
        slots[keep] = self.kept + np.arange(len(keep))
        for at, k in enumerate(keep):
            self.slot[keys[k]] = self.kept + at
        self.kept += len(keep)
        rest = np.ones(n, dtype=bool)
        rest[keep] = False
        slots[rest] = self.kept + np.arange(int(rest.sum()))
        self._grow(self.kept + int(rest.sum()), records)
        for name in self.kind._fields:
            field = np.asarray(getattr(records, name))
            table = self.tables[name]
            if field.dtype != table.dtype:  # never cast a value down into an earlier row's type
                table = self.tables[name] = table.astype(np.result_type(table.dtype, field.dtype))
            table[slots] = field.reshape(n, self.width)
        return slots

    def _grow(self, rows: int, records) -> None:
        have = next(iter(self.tables.values())).shape[0] if self.tables else 0
        if rows <= have:
            return
        size = max(rows + rows // 4, 16)  # a quarter spare, not double: rows of a wide lattice are large
        for name in self.kind._fields:
            old = self.tables.get(name)  # keeps its type (``put`` widens it where a row needs more)
            new = np.empty((size, self.width), dtype=old.dtype if old is not None
                           else np.asarray(getattr(records, name)).dtype)
            if old is not None:
                new[:have] = old
            self.tables[name] = new

    def view(self, slots: np.ndarray) -> "Gathered":
        """The stages of rows ``slots``, flattened row after row, as ``records`` were."""
        return Gathered(dict(self.tables), slots, self.width)  # a later ``put`` may grow the tables


class Gathered:
    """Rows of a ``RowStore`` read as one record: a field is gathered when first read; ``take`` gives
    some of the stages, gathered the same way (only theirs)."""

    __slots__ = ("_tables", "_rows", "_cols", "_width", "_got")

    def __init__(self, tables: Dict[str, np.ndarray], rows: np.ndarray, width: int,
                 cols: Optional[np.ndarray] = None) -> None:
        self._tables, self._rows, self._cols, self._width, self._got = tables, rows, cols, width, {}

    def __getattr__(self, name: str) -> np.ndarray:
        got = self._got.get(name)
        if got is None:
            table = self._tables[name]
            got = table[self._rows].reshape(-1) if self._cols is None else table[self._rows, self._cols]
            self._got[name] = got
        return got

    def take(self, idx) -> "Gathered":
        idx = np.asarray(idx)
        if self._cols is None:
            rows, cols = np.divmod(idx, self._width)
            return Gathered(self._tables, self._rows[rows], self._width, cols)
        return Gathered(self._tables, self._rows[idx], self._width, self._cols[idx])
