"""The order DP under a memory limit: contiguous stages of a topological order, each within T and
within ``--memory`` per device, by parametric search on T.

A stage's memory depends on the stages after it: under 1F1B-flush (and 2BW)
a rank of stage j holds ``n_j = 1 + ceil(W_{j+1} / r_j)`` microbatches,
``W_j = r_j · n_j`` (``costmodel.in_flight``); under 1F1B-stash
``ceil(d_j / r_j)`` with ``d_j`` the devices of stage j and every stage after
it; under GPipe ``ceil(M / r_j)``. So the order is walked from its end: for a
T, each suffix keeps the fewest devices that reach T with every stage within
the limit, and of those the least ``W`` (a smaller ``W`` never costs a stage
before it memory or replicas). A stage's weights and activations per
microbatch do not change with its replicas, so the limit is a floor on them,
``r >= W / (n_max - 1)`` (``n_max`` the microbatches that fit beside the
weights), and the stage takes the fewest allowed replicas meeting both T and
that floor (the counts meeting T form one run, ``order_bisect.fitting``). The
first stage takes every device left, where T and the allowed counts let it
(more replicas there cost no other stage memory); else replicas are stepped
in where they keep T and the limit (``Walk._padded``), so the plan uses
exactly K. Ranges that cannot hold one microbatch are never built.

A heuristic, even on its order: the fewest devices are kept before the least
``W``, and a suffix with more devices can be the one a stage before it
needs, to keep T where padding cannot (on 600 random small graphs it found
the best plan of the order on 593; docs/limitations.md). ZB-H1 holds the
deepest window on every stage: not searched here. A tied weight is counted
in the memory of every stage holding it, its sync is left to ``evaluate`` (as
in ``heuristic.order_dp``). O(ranges) per step of T, whatever K is.
``least_memory`` bisects on the limit for the error that says none fits.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions, in_flight_all, min_replicas, planned_microbatches, stage_time_s
from passes.partition.heuristic import Solution, order_sums, topo_orders
from passes.partition.memory_guard import past
from passes.partition.offsets import EPS
from passes.partition.order_bisect import fitting


class Plan(NamedTuple):
    """A ``Solution`` with the walk's range (pair index) per stage."""

    stage_of: List[int]
    replicas: List[int]
    objective: float
    pairs: List[int]


SCHEDULES = ("1f1b-flush", "2bw", "1f1b-stash", "gpipe")  # the ones whose windows the walk from the end knows
TOLERANCE = 1e-3  # the bisection stops with its plan this close to the least T the walk reaches (the polish
# that follows moves boundaries by more; each step is a walk over every range: 0.1-0.25 s on 800-1,300 units)
CHUNK = 1 << 18  # ranges per ``min_replicas`` call in a walk
PAD_TRIES = 8  # first-stage ends tried by ``_padded`` per T, from the fewest devices up
SLACK = 1e-9  # relative: a microbatch count whose memory lands this close to the limit still fits


def memory_order_dp(units: Units, opts: CostOptions, deadline: float = math.inf) -> Optional[Solution]:
    """The fastest plan within ``opts.memory`` over a few topological orders (``heuristic.topo_orders``),
    or None where none fits (or the schedule is not one of ``SCHEDULES``, or the deadline passes)."""
    if opts.memory is None or opts.schedule not in SCHEDULES:
        return None
    found = []
    for order in topo_orders(units):
        if past(deadline):
            break
        plan = Walk(units, opts, order).bisected(deadline)
        if plan is not None:
            found.append(plan)
    return min(found, key=lambda s: s.objective) if found else None


class Walk:
    """One order's stage ranges with what the walk from its end needs of them."""

    def __init__(self, units: Units, opts: CostOptions, order: Sequence[int]) -> None:
        self.units, self.opts, self.order = units, opts, list(order)
        n = self.n = len(order)
        comp, par, work, cut, first_cut = order_sums(units, order)
        acts = np.concatenate([[0.0], np.cumsum([units.act_bytes[u] for u in order])])
        ss, ee = _ranges_within(par, acts, opts)  # the ranges [s, e) one microbatch can fit, by start, ends rising
        keep = (work[ee] - work[ss] >= 1) & ((ss == 0) | (ss >= first_cut))
        ss, self.ee = ss[keep], ee[keep]  # ``starts`` says where each start's ranges lie: ``ss`` is not kept
        self.sums = (comp[self.ee] - comp[ss], par[self.ee] - par[ss], cut[ss], cut[self.ee])
        self.starts = np.searchsorted(ss, np.arange(n + 2))  # ranges starting at s: starts[s] .. starts[s+1]
        self.comp_total = float(comp[n])
        held = self.sums[1] + self._shared_held(ss)
        self.nmax = microbatches_fit(held, acts[self.ee] - acts[ss], opts)
        self.floors = Floors.of(self.nmax, opts)
        self.allowed = np.asarray(opts.allowed_replicas(), dtype=np.int64)

    def _shared_held(self, ss: np.ndarray) -> np.ndarray:
        """Per range (starting at ``ss``), the bytes of tied weights it holds (each once): a weight is held
        where one of its units lies in the range."""
        pos = {u: p for p, u in enumerate(self.order)}
        out = np.zeros(len(ss))
        for nbytes, holders in self.units.shared.values():
            at = np.sort([pos[u] for u in holders])
            nxt = np.searchsorted(at, ss)  # the first holder at or after the range's start
            first = np.where(nxt < len(at), at[np.minimum(nxt, len(at) - 1)], self.n)
            out += np.where(first < self.ee, float(nbytes), 0.0)
        return out

    def bisected(self, deadline: float = math.inf, hi: Optional[float] = None) -> Optional[Solution]:
        """The least T (within ``TOLERANCE``) whose walk finds a plan, as a ``Solution``; None where no
        T does (the limit is too small for any plan of this order) or the deadline passes. ``hi``: a T
        where a plan is expected (a coarser walk's), tried first, so the bisection starts from there."""
        K = self.opts.devices
        lo = self.comp_total / K  # every plan spends sum C over at most K devices
        if not lo > 0:
            return None
        best = self.walk(lo)
        if best is None and hi is not None and hi > lo:
            best = self.walk(hi)
        if best is None:
            best = self.walk(math.inf)  # memory alone decides: if no plan fits at any T, none fits
            if best is None:
                return None
        hi = best.objective
        while hi > lo * (1 + TOLERANCE):
            if past(deadline):
                break
            T = math.sqrt(lo * hi)
            got = self.walk(T)
            if got is not None:
                best, hi = (got, min(T, got.objective)) if got.objective < best.objective else (best, T)
            else:
                lo = T
        return Solution(best.stage_of, best.replicas, best.objective)

    def walk(self, T: float) -> Optional[Solution]:
        """A plan with every stage within T and the memory limit, or None: the walk from the end."""
        n, K = self.n, self.opts.devices
        least = np.empty(len(self.ee))  # the fewest replicas meeting T, K + 1 where none does; in chunks, so the
        for a in range(0, len(least), CHUNK):  # temporaries of ``min_replicas`` stay small beside the ranges
            least[a:a + CHUNK] = min_replicas(*(x[a:a + CHUNK] for x in self.sums), T, self.opts)
        dev = np.full(n + 1, np.inf)
        win = np.full(n + 1, np.inf)
        took = np.full(n + 1, -1, dtype=np.int64)
        reps = np.zeros(n + 1, dtype=np.int64)
        dev[n] = win[n] = 0.0
        stash = self.opts.schedule == "1f1b-stash"
        rank = 4.0 * K + 8  # (devices, W) ordered as one number: W < 2 x (K + 1)
        for s in range(n - 1, -1, -1):
            a, b = self.starts[s], self.starts[s + 1]
            if a == b:
                continue
            live = np.nonzero((least[a:b] <= K) & (dev[self.ee[a:b]] < K))[0]
            if not live.size:
                continue
            e = self.ee[a + live]
            after, window = dev[e], win[e]
            r = self._fewest(a + live, window, after, least[a + live], T)
            if s == 0:
                return self._first_stage(a + live, r, after, T, took, reps)
            ok = np.nonzero(after + r <= K)[0]
            if not ok.size:
                continue
            r, after, window = r[ok], after[ok], window[ok]
            grown = after + r if stash else r * (1 + np.ceil(window / r))  # gpipe: unused
            best = int(np.argmin((after + r) * rank + grown))
            dev[s], win[s], took[s], reps[s] = after[best] + r[best], grown[best], a + live[ok[best]], r[best]
        return None

    def _fewest(self, pairs: np.ndarray, window: np.ndarray, after: np.ndarray, least: np.ndarray,
                T: float) -> np.ndarray:
        """Per range of ``pairs`` (each meeting T on at most K replicas), the fewest allowed replicas
        meeting T and the memory limit given the suffix after it (``window`` W on ``after`` devices);
        inf where none does.

        ``least`` (the fewest meeting T) starts the run of counts that meet T; where the memory floor
        lies above it the floor's count is checked, and past the run's end (an all-reduce that outgrows
        the compute it splits) nothing fits. Only where one replica fits and two do not (PipeDream's
        charges) can the run start again further up: ``fitting`` finds where."""
        behind = after if self.opts.schedule == "1f1b-stash" else window
        need = np.maximum(least, self.floors.least(pairs, behind))
        idx = np.searchsorted(self.allowed, need, side="left")
        r = np.full(len(pairs), np.inf)
        at = np.nonzero(idx < len(self.allowed))[0]
        r[at] = self.allowed[idx[at]]
        above = at[r[at] > least[at]]  # raised by the floor: does that count still meet T?
        if above.size:
            slow = stage_time_s(*(x[pairs[above]] for x in self.sums), r[above], self.opts) > T * (1 + EPS)
            bad = above[slow]
            r[bad] = np.inf
            again = bad[least[bad] == 1]
            if again.size:
                _, first, last = fitting(tuple(x[pairs[again]] for x in self.sums), T, self.opts)
                idx = np.maximum(np.searchsorted(self.allowed, need[again], side="left"), first)
                ok = idx <= last
                r[again[ok]] = self.allowed[idx[ok]]
        return r

    def _first_stage(self, pairs: np.ndarray, r: np.ndarray, after: np.ndarray, T: float, took: np.ndarray,
                     reps: np.ndarray) -> Optional[Solution]:
        """The plan on exactly K devices (the fewest with ``fewer_devices``): where it can, the first stage
        takes every device left (replicas beyond its fewest only lower its own microbatches in flight; the
        count must be allowed and still meet T), the fastest such first stage; else the fewest-device
        plan with devices added where they keep T and the limit (``_padded``), trying the first stage's
        ends from the fewest devices up (the fewest may be one stage that cannot grow). None where
        neither does."""
        opts, K = self.opts, self.opts.devices
        k = np.nonzero(after + r <= K)[0]
        if not k.size:
            return None
        use = r[k] if opts.fewer_devices else K - after[k]
        times = stage_time_s(*(x[pairs[k]] for x in self.sums), use, opts)
        keep = np.isin(use, self.allowed) & (times <= T * (1 + EPS))
        if keep.any():
            pick = int(np.nonzero(keep)[0][np.argmin(times[keep])])
            took[0], reps[0] = pairs[k[pick]], int(use[pick])
            return self._plan(took, reps)
        for pick in k[np.argsort(after[k] + r[k], kind="stable")][:PAD_TRIES]:
            took[0], reps[0] = pairs[pick], int(r[pick])
            padded = self._padded(self._plan(took, reps), T)
            if padded is not None:
                return padded
        return None

    def _padded(self, plan: Solution, T: float) -> Optional[Solution]:
        """``plan`` on exactly K devices: one allowed step of replicas at a time, to the first stage (from
        the input's) whose time stays within T and with which every stage's microbatches in flight still
        fit the limit (a stage's extra replicas raise the windows of the stages before it); None where
        no stage can take the next step."""
        K, allowed = self.opts.devices, self.allowed
        pairs = np.array(plan.pairs)
        sums = tuple(x[pairs] for x in self.sums)
        nmax = self.nmax[pairs]
        replicas = np.array(plan.replicas, dtype=np.int64)
        while replicas.sum() < K:
            left = K - int(replicas.sum())
            for j in range(len(replicas)):
                pos = int(np.searchsorted(allowed, replicas[j], side="right"))
                if pos >= len(allowed) or allowed[pos] - replicas[j] > left:
                    continue
                trial = replicas.copy()
                trial[j] = allowed[pos]
                fast = stage_time_s(*(x[j] for x in sums), float(trial[j]), self.opts) <= T * (1 + EPS)
                flight = in_flight_all([int(x) for x in trial], self.opts.schedule, planned_microbatches(self.opts))
                if fast and np.all(np.array(flight) <= nmax):
                    replicas = trial
                    break
            else:
                return None
        times = stage_time_s(*sums, replicas.astype(float), self.opts)
        return Solution(plan.stage_of, [int(r) for r in replicas], float(np.max(times)))

    def _plan(self, took: np.ndarray, reps: np.ndarray) -> Solution:
        """The stages the walk chose, from the first, scored as ``order_dp`` scores its plans."""
        ranges: List[Tuple[int, int, int]] = []
        s = 0
        while s < self.n:
            pair = int(took[s])
            ranges.append((pair, s, int(reps[s])))
            s = int(self.ee[pair])
        stage_of = [0] * self.n
        for stage, (pair, s, _) in enumerate(ranges):
            for p in range(s, int(self.ee[pair])):
                stage_of[self.order[p]] = stage
        pairs = [p for p, _, _ in ranges]
        replicas = [r for _, _, r in ranges]
        objective = float(np.max(stage_time_s(*(x[pairs] for x in self.sums), np.array(replicas, dtype=float),
                                              self.opts)))
        return Plan(stage_of, replicas, objective, pairs)


def range_count(units: Units, opts: CostOptions, order: Sequence[int]) -> int:
    """How many ranges a ``Walk`` of ``order`` holds (``_ranges_within``, before the compute and input
    rules), from prefix sums alone, so a caller can size it first: about 115 bytes each at the peak."""
    _, par, _, _, _ = order_sums(units, order)
    acts = np.concatenate([[0.0], np.cumsum([units.act_bytes[u] for u in order])])
    return int(np.sum(_last_ends(par, acts, opts) - np.arange(len(par))))


def _last_ends(par: np.ndarray, acts: np.ndarray, opts: CostOptions) -> np.ndarray:
    """Per start s, the last end e of a range whose untied weights and one microbatch of activations fit."""
    n = len(par) - 1
    reach = par * _weight_copies(opts, 1) + acts  # nondecreasing: a range's need is reach[e] - reach[s]
    last = np.searchsorted(reach, reach + float(opts.memory) * (1 + SLACK), side="right") - 1
    return np.minimum(np.maximum(last, np.arange(n + 1)), n)


def _ranges_within(par: np.ndarray, acts: np.ndarray, opts: CostOptions) -> Tuple[np.ndarray, np.ndarray]:
    """Every range [s, e) of the order (prefix sums ``par``, ``acts``) whose untied weights and one
    microbatch of activations fit the limit (``microbatches_fit`` >= 1, tied weights aside): a longer
    range never fits, so under a tight limit the walk looks at far fewer than the n^2 / 2 ranges (the
    96-block GPT under 256 MiB on 64 devices: its stages are a few units long)."""
    n = len(par) - 1
    counts = _last_ends(par, acts, opts) - np.arange(n + 1)
    ss = np.repeat(np.arange(n + 1), counts)
    ee = ss + 1 + (np.arange(len(ss)) - np.repeat(np.cumsum(counts) - counts, counts))
    return ss, ee


def _weight_copies(opts: CostOptions, n: int) -> float:
    """Copies of its weights a device holds with n microbatches in flight: the versions kept
    (``costmodel.weight_versions``: one per microbatch under 1F1B-stash, two under 2BW, else one), a
    gradient buffer and the optimizer state."""
    versions = n if opts.schedule == "1f1b-stash" else 2 if opts.schedule == "2bw" else 1
    return versions + 1.0 + opts.optimizer_state


def microbatches_fit(params: np.ndarray, acts: np.ndarray, opts: CostOptions) -> np.ndarray:
    """Per range, the most microbatches a device of it may hold within ``opts.memory``
    (``costmodel.device_memory_bytes``): weights × (versions + a gradient buffer + optimizer state)
    + activations × microbatches; 1F1B-stash keeps a weight version per microbatch. Below 1: none fits."""
    limit = float(opts.memory)
    with np.errstate(divide="ignore", invalid="ignore"):
        if opts.schedule == "1f1b-stash":  # weights x (n + extra) + acts x n
            room, per = limit - params * _weight_copies(opts, 0), params + acts
        else:
            room, per = limit - params * _weight_copies(opts, 0), acts
        most = np.where(per > 0, np.floor(room / per + SLACK), np.where(room >= 0, np.inf, -1.0))
    return most


class Floors(NamedTuple):
    """Per range, what the memory limit asks of its replica count (``least``), worked out once."""

    per: np.ndarray  # 1 / (nmax - 1): the floor is ceil(behind x per) (inf where nmax < 2)
    last: np.ndarray  # the floor with nothing behind (the last stage): 1, or inf where nmax < 1
    capped: np.ndarray  # ceil(M / nmax): enough replicas that the step's M microbatches fit (inf: no M)

    @classmethod
    def of(cls, nmax: np.ndarray, opts: CostOptions) -> "Floors":
        M = planned_microbatches(opts)
        with np.errstate(divide="ignore", invalid="ignore"):
            per = np.where(nmax >= 2, 1.0 / (nmax - 1), np.inf)
            last = np.where(nmax >= 1, 1.0, np.inf)
            capped = np.where(nmax >= 1, np.ceil(M / nmax), np.inf) if M is not None else np.full(len(nmax), np.inf)
        if opts.schedule == "gpipe":  # every stage holds ceil(M / r): the cap is the floor, whatever is behind
            per, last = np.full(len(nmax), np.inf), capped
        return cls(per, last, capped)

    def least(self, pairs: np.ndarray, behind: np.ndarray) -> np.ndarray:
        """The fewest replicas whose microbatches in flight fit, before a suffix that puts ``behind``
        (W, or its devices under 1F1B-stash) on them: ``1 + ceil(behind / r) <= nmax``, or, under a cap of
        M microbatches, ``ceil(M / r) <= nmax`` (float; inf where no count does)."""
        per = self.per[pairs]
        own = np.ceil(np.multiply(behind, per, out=np.zeros(len(pairs)), where=behind > 0))
        own = np.where(behind > 0, own, self.last[pairs])
        return np.minimum(own, self.capped[pairs])


LEAST_TOLERANCE = 0.01  # ``least_memory`` stops with a limit this close (relative) above the least that fits


def least_memory(units: Units, opts: CostOptions, deadline: float = math.inf) -> Optional[int]:
    """The least ``--memory`` (within ``LEAST_TOLERANCE``) under which the walk finds a plan of the first
    topological order at any T, for the message that says no plan fits; None where the deadline passes
    first. Geometric bisection between a limit no plan meets (every device holds at least one unit's
    weights and one microbatch of its activations) and one that the walk meets (doubled until it does).
    None too for a schedule the walk does not know (ZB-H1: its windows are not the walk's, and the memory it
    found was below limits no plan met)."""
    if opts.schedule not in SCHEDULES:
        return None
    order = topo_orders(units)[0]
    extra = 1.0 + opts.optimizer_state
    lo = max(1.0, max(p * (1 + extra) + a for p, a in zip(units.param_bytes, units.act_bytes)) - 1)
    hi = 2 * lo

    def fits(limit: float) -> bool:
        trial = CostOptions(**{**opts.__dict__, "memory": int(limit)})
        return Walk(units, trial, order).walk(math.inf) is not None

    while not fits(hi):
        if past(deadline) or hi > 2.0 ** 80:
            return None
        lo, hi = hi, 2 * hi
    while hi > lo * (1 + LEAST_TOLERANCE):
        if past(deadline):
            break
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return int(math.ceil(hi))
