"""The placed passes' store of pool rows (``passes/partition/pool_rows.py``): what it gives back must be
exactly the rows it was given, for every field, all pairs or some, kept or not."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from passes.partition.pool_rows import RowStore


class _Rec(NamedTuple):
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray

    def take(self, idx) -> "_Rec":
        return _Rec(*(x[idx] for x in self))


def _records(rng, rows: int, width: int) -> _Rec:
    n = rows * width
    return _Rec(rng.normal(size=n), rng.integers(0, 1 << 40, n), rng.random(n) < 0.5)


def _same(got, want: _Rec) -> None:
    for name in _Rec._fields:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


def test_rows_come_back_as_given_whole_or_in_part():
    """Rows put in several calls (keys, no keys, more than the room) read back through ``view`` equal the
    records stitched together, and ``take`` of any pairs equals those pairs; kept rows survive later
    calls, rows without a key or past the room are not found again."""
    rng = np.random.default_rng(0)
    width = 7
    store = RowStore(width)
    first = _records(rng, 5, width)
    keys = ["k0", None, "k2", "k3", None]
    slots = store.put(first, keys, room=2)  # room for two of the three keyed rows
    _same(store.view(slots), first)
    assert store.find(keys).tolist()[:3] == [slots[0], -1, slots[2]]
    assert (store.find(["k3", None, "nope"]) == -1).all()
    second = _records(rng, 4, width)
    later = store.put(second, ["k5", None, "k6", "k7"], room=1)
    _same(store.view(later), second)
    # the first call's kept rows are intact; its unkept ones may have been overwritten
    kept = store.find(["k0", "k2"])
    _same(store.view(kept), first.take(np.r_[0:width, 2 * width:3 * width]))
    mixed = np.array([kept[1], later[0], kept[0], later[3]])
    want = _Rec(*(np.concatenate(f) for f in zip(first.take(np.s_[2 * width:3 * width]), second.take(np.s_[:width]),
                                                  first.take(np.s_[:width]), second.take(np.s_[3 * width:]))))
    view = store.view(mixed)
    _same(view, want)
    pick = rng.integers(0, mixed.size * width, 25)
    _same(view.take(pick), want.take(pick))
    again = rng.integers(0, pick.size, 9)
    _same(view.take(pick).take(again), want.take(pick[again]))


def test_the_tables_grow_without_losing_kept_rows():
    rng = np.random.default_rng(1)
    width = 3
    store = RowStore(width)
    given = {}
    for call in range(40):
        recs = _records(rng, 6, width)
        keys = [f"{call}-{j}" for j in range(6)]
        store.put(recs, keys, room=10 ** 6)
        given.update((key, recs.take(np.s_[j * width:(j + 1) * width])) for j, key in enumerate(keys))
    names = sorted(given)
    _same(store.view(store.find(names)), _Rec(*(np.concatenate(f) for f in zip(*(given[k] for k in names)))))


def test_a_later_row_of_a_wider_type_is_not_cast_down():
    """Rows put later with a field of a wider type (a float where the first rows held integers) keep
    their values, and the earlier rows theirs."""
    width = 2
    store = RowStore(width)
    ints = _Rec(np.array([1, 2]), np.array([3, 4]), np.array([True, False]))
    floats = _Rec(np.array([1.5, 2.25]), np.array([3, 4]), np.array([False, True]))
    first = store.put(ints, ["i"], room=50)
    second = store.put(floats, ["f"], room=50)
    _same(store.view(first), ints)
    _same(store.view(second), floats)
    more = _Rec(*(np.tile(x, 30) for x in ints))  # 30 more integer rows: the tables grow
    store.put(more, [f"m{j}" for j in range(30)], room=50)
    _same(store.view(store.find(["i", "f"])), _Rec(*(np.concatenate(f) for f in zip(ints, floats))))
