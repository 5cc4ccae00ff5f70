"""The placed segment DP for charges that are not one replica interval per bandwidth.

``placed.py``'s look-ups rely on fxpipe's ring, whose time at each bandwidth
is monotone in r. PipeDream's hierarchical all-reduce depends on how a stage
that crosses nodes splits over them (so on the offset it starts at), and
``pow2`` counts reach only some offsets. ``ChargedChainSolver`` keeps the same
state (fewest devices per point and offset within a node) but tries each
candidate count at every offset with the exact charge; ``solver_for`` picks
between the two.

With ``exact_cuts`` (``pow2`` only) the state also holds the class of the
previous stage's replica count, so a stage added after it is charged the cut
between the two as their ranks pay it (``offsets.cut_load_table``) rather than
each side at the least any neighbour allows; a pass then keeps log2 K + 1
times the states (``driver._cuts_exact`` runs it where the plain pass leaves
more than 1 % open).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import numpy as np

from passes.errors import FxpipeError
from passes.partition.chain import DeadlineExceeded
from passes.partition.coarsen import Units
from passes.partition.costmodel import (CostOptions, allreduce_span, combine_stage_time, min_replicas,
                                        stage_time_s, tied_across_rates, tied_floor_s)
from passes.partition.memory_guard import past
from passes.partition.node_floor import NodeFloor, applies as node_floor_applies
from passes.partition.offsets import CLEAR, EPS, clear_of_integer, cut_floors, cut_load_table, least_fitting
from passes.partition.placed import PlacedChainSolver
from passes.partition.pool_rows import Gathered
from passes.partition.segments import Segment

KNOWN_CELLS = 1 << 24  # the most (pair, count, offset) cells ``_known_fits`` keeps for one level
POOL_CHUNK = 1 << 17  # pool pairs a charged pass answers at once (``ChargedChainSolver._from_pool``)
WINDOW = 4  # node widths of counts tried exactly per stage under ``any`` (``ChargedChainSolver._candidates``)
_CHARGED = ("C", "own", "tied", "far", "partners", "near", "in_far", "out_far", "empty_first", "lo", "hi",
            "one_fast", "one_slow", "rise_fast", "rise_slow", "settle", "looped")


class _Charged(NamedTuple("_ChargedFields", [(name, np.ndarray) for name in _CHARGED])):
    """What a stage's exact placed time needs, per pair (see ``ChargedChainSolver``): compute, own
    weight bytes (tied ones left out), tied bytes, of those the bytes synced across nodes for sure,
    the tied group's least partner replicas, the cut floors of ``cut_floors``, whether it is a first
    stage without compute, the candidate counts ``[lo, hi]``, and, under PipeDream's charges, where the
    two flat models meet T (one replica meets it; every count from ``rise`` on does, none from 2 below
    it; see ``ChargedChainSolver._flat_fits``), the count from which it fits at every offset where
    that settles it (``ChargedChainSolver._settled``; 0: not settled), and whether any count is
    left for the column loop."""

    def take(self, idx) -> "_Charged":
        return _Charged(*(x[idx] for x in self))


class _Rows:
    """Rows ``idx`` of a ``_Charged`` (or of a lazy view of one), each field gathered when first read:
    as columns (``column``: ``_Charged.take(idx[:, None])``) for a column of the DP, which reads a few
    of the fields for most pairs and the rest for few; else flat, for the pairs a pass still tries
    count by count (few on a deep stack)."""

    __slots__ = ("_of", "_idx", "_column", "_got")

    def __init__(self, of, idx: np.ndarray, column: bool = True) -> None:
        self._of, self._idx, self._column, self._got = of, idx, column, {}

    def __getattr__(self, name: str) -> np.ndarray:
        got = self._got.get(name)
        if got is None:
            got = getattr(self._of, name)[self._idx]
            got = self._got[name] = got[:, None] if self._column else got
        return got

    def take(self, idx) -> "_Rows":
        return _Rows(self._of, self._idx[idx], self._column)


class ChargedChainSolver(PlacedChainSolver):
    """The placed DP for charges that are not one interval per bandwidth: PipeDream's all-reduce (a
    ring inside the fullest node plus one across the n nodes, so it depends on where in its node a
    stage starts) and power-of-two counts (which reach only some offsets).

    For each stage and each offset m it starts at, a count r is tried with the stage's exact
    all-reduce there (``costmodel.allreduce_span``), its tied weights at their floor
    (``_tied_charge``) and each cut at the least its placement allows (``cut_floors``); the fewest
    devices after it at offset m' is the least ``dev[m] + r`` with ``m + r = m' (mod G)``. The
    counts tried: every allowed one under ``pow2`` (at most log2 K + 1); under ``any``, from the
    fewest the flat model at the faster bandwidth allows to G past the first count from which the
    flat model at the slower one meets T for every larger count, since no placement charges less
    than the first nor more than the second (``flat_bound``), so every residue's fewest count lies
    there. Where that fewest count passes G, the counts start instead at the fewest that meets T with
    the all-reduce of the least nodes it must touch (``node_floor.NodeFloor``): none below fits at any
    offset, and on many devices they were most of what a pass tried (96 blocks on 1,024 devices: a
    pass near the optimum 18.7 s before, 5.1 s with it and the pool rows' reuse,
    ``PlacedChainSolver._pool_stages``). Under PipeDream's charges nearly every pair of such a pass
    is settled from its least count on (``_settled``): only the pairs with counts left go through the
    column loop, with their fields gathered as read (the same pass 5.4 -> 2.4 s). T infeasible is
    still a proof; the plan is scored placed by the caller.
    """

    SPLIT_HOLDERS = False  # its candidate windows assume every count of a stage is open

    def __init__(self, units: Units, segments: List[Segment], opts: CostOptions, exact_cuts: bool = False) -> None:
        super().__init__(units, segments, opts)
        K, G = opts.devices, self.G
        if K >= _LOW:
            raise FxpipeError(f"partition: the placed DP packs replica counts in 20 bits; {K} devices are more "
                              "(plan a flat machine, without --gpus-per-node)")
        counts, offsets = np.arange(K + 1)[:, None], np.arange(G)[None, :]
        # by count (rows 0..K) and offset in a node: ``allreduce_span`` per weight byte (linear in the
        # bytes, so one table serves every stage of every pass), and ``_packed(0, r, (m' - r) mod G)`` for
        # a stage of r replicas that ends at offset m' (``_charged_targets``)
        self._span = allreduce_span(1.0, offsets, counts, opts)
        self._payload = _packed(0, counts, (offsets - counts) % G)
        self._known: tuple = ((), {})  # (T, holders) and ``_known_fits``'s tables at them
        # the first count past G worth trying: below it none fits at any offset (``node_floor.NodeFloor``)
        self._floor = NodeFloor(opts) if node_floor_applies(opts) else None
        # under PipeDream's charges with any count, pairs settle from some count on (``_settled``)
        self._settles = opts.cost_model == "pipedream" and opts.replication == "any"
        # under PipeDream's charges, per group size the least sync per tied byte across nodes
        self._across = tied_across_rates(opts) if opts.cost_model == "pipedream" else None
        if exact_cuts:  # the previous stage's count joins the state: cuts charged exactly
            if opts.replication != "pow2":
                raise FxpipeError("partition: exact cut charges need --replication pow2 (a state per count)")
            allowed = opts.allowed_replicas()
            self.R = len(allowed)
            self._class = np.full(K + 1, -1, dtype=np.int64)
            self._class[allowed] = np.arange(self.R)
            self._cut_load = cut_load_table(tuple(allowed), G, float(opts.intra_bw), float(opts.bandwidth))

    def _stage_intervals(self, stages, T: float) -> _Charged:
        C, params, cut_in, cut_out, tied, first, last, shares, flags = stages
        far = self._far(first, last, shares, T)
        o, K = self.opts, self.opts.devices
        q = np.ones(C.shape) if shares is None else np.broadcast_to(
            self._partner_count(shares, flags, T), C.shape).astype(float)
        fast, slow = self.flat
        at = lambda flat: lambda r, k: stage_time_s(C[k], params[k], 0.0, 0.0, r, flat, tied[k], q[k])  # noqa: E731
        allowed = np.asarray(o.allowed_replicas(), dtype=np.int64) if o.replication == "pow2" else None
        closed = o.cost_model == "pipedream" and allowed is None  # the thresholds' guesses (``_pipedream_rise``)
        untied = tied <= 0

        def rise(f):  # per flat model, ``_rising_from``: the closed form's count read where it is the answer
            guess, clear = _pipedream_rise(C, params - tied, T, f.bandwidth) if closed else (None, None)
            return _rising_from(at(f), C.size, T, K, allowed, guess, None if clear is None else clear & untied)

        one_fast = one_slow = rise_fast = np.zeros(C.shape)  # read under PipeDream only (``_flat_fits``)
        if o.cost_model == "pipedream":  # from r = 2 on its times fall: meeting T is a threshold in r
            one_fast, one_slow = (_one_fits(at(f), C, untied, T) for f in self.flat)
            rise_fast = rise(fast)
            # so the fewest count is one where one fits, else that threshold (``min_replicas``' answer)
            lo = np.where(one_fast, 1, rise_fast)
        else:
            lo = np.minimum(min_replicas(C, params, 0.0, 0.0, T, fast, tied, q), K + 1)
        wide = np.nonzero((lo > self.G) & (lo <= K))[0] if self._floor is not None else ()
        if len(wide):  # past G ranks no placement charges less than the nodes they must touch
            self._floor.deadline = self.deadline
            lo[wide] = self._floor.fewest(C[wide], (params - tied)[wide], tied[wide], q[wide],
                                          np.zeros(len(wide)), lo[wide], T)
        near, in_far, out_far = cut_floors(cut_in, cut_out, T, o)
        rise_slow = rise(slow)
        sure = np.maximum(rise_slow, np.maximum(in_far, out_far))
        hi = np.minimum(sure + self.G - 1, K)  # every residue's fewest count lies below G past ``sure``
        if allowed is not None:  # counts of at least G are multiples of G: the first past ``sure`` ends it
            step = allowed[np.minimum(np.searchsorted(allowed, np.maximum(sure, self.G)), allowed.size - 1)]
            hi = np.where((self.G & (self.G - 1)) == 0, np.where(sure <= K, step, K), K)
        empty_first = first & (C <= 0)
        settle, looped = np.zeros(C.shape, dtype=np.int64), np.ones(C.shape, dtype=bool)
        if self._settles:  # read by ``_settled`` (see there)
            least = np.maximum.reduce([np.full(C.shape, 2), lo, rise_slow, in_far, out_far, near]).astype(np.int64)
            last = least + self.G - 1
            ok = ~empty_first & (last <= hi) & (last < lo + WINDOW * self.G)
            settle, looped = np.where(ok, least, 0), ~ok | (lo < least)
        return _Charged(C, params - tied, tied, far, q, near, in_far, out_far, empty_first, lo, hi,
                        one_fast, one_slow, rise_fast, rise_slow, settle, looped)

    def _tied_charge(self, ch: _Charged, r, one_node):
        """The least sync of a stage's tied weights (``costmodel.tied_floor_s``): fxpipe's ring runs at
        B2 when the stage crosses nodes or a partner sits on another node for sure
        (``PlacedChainSolver._far``), else at least at B1;
        PipeDream's charge over a group is never below the flat one at B1 (``flat_bound``), and for
        the bytes synced across nodes for sure never below the least over groups that span two nodes
        or more (``costmodel.tied_across_rates``)."""
        o = self.opts
        fast, slow = self.flat
        if o.cost_model == "pipedream":
            near = tied_floor_s(ch.tied - ch.far, r, fast, ch.partners)
            if not np.any(ch.far):
                return near
            group = np.minimum(np.rint(r + ch.partners), o.devices).astype(np.int64)
            return near + self._across[group] * ch.far / np.maximum(r, 1)
        inside = tied_floor_s(ch.tied - ch.far, r, fast, ch.partners) + tied_floor_s(ch.far, r, slow, ch.partners)
        return np.where(one_node, inside, tied_floor_s(ch.tied, r, slow, ch.partners))

    def _fits(self, ch: _Charged, m, r, T: float):
        """Whether stages (column arrays) of ``r`` replicas (a column, or one count for all) starting at
        offset ``m`` (a row) meet T.

        Only stages that meet T under the faster flat model but not under the slower one depend on
        where they start (no placement charges less than the first nor more than the second), so
        only those are charged at every offset."""
        G = self.G
        fast, slow = self._flat_fits(ch, r, T)
        ok = np.broadcast_to(slow, (slow.shape[0], G)).copy()
        torn = np.nonzero((fast & ~slow)[:, 0])[0]
        if torn.size:
            some, rt = ch.take(torn), (r[torn] if r.shape[0] > 1 else r)
            one = m + rt <= G
            sync = some.own * self._span[rt, m]
            if some.tied.any():
                sync = sync + self._tied_charge(some, rt, one)
            ok[torn] = combine_stage_time(some.C, rt, sync, 0.0) <= T * (1 + EPS)
        # cuts: a count at or above every floor fits them wherever the stage starts; below the least, nowhere
        n = ok.shape[0]
        far = np.maximum(ch.in_far, ch.out_far)
        row = lambda x: np.broadcast_to(x, (n, 1))[:, 0]  # noqa: E731
        cleared = row(r >= np.maximum(far, ch.near))
        anywhere = row(slow).copy()
        if torn.size:
            anywhere[torn] = ok[torn].any(axis=1)
        check = np.nonzero(~cleared & row(r >= np.minimum(far, ch.near)) & anywhere)[0]
        out = ok & cleared[:, None]
        if check.size:
            sub, rc = ch.take(check), (r[check] if r.shape[0] > 1 else r)
            cuts = np.where(m + rc <= G, (rc >= sub.near) & ((m + rc < G) | (rc >= sub.out_far))
                            & ((m > 0) | (rc >= sub.in_far)), rc >= np.maximum(sub.in_far, sub.out_far))
            out[check] = ok[check] & cuts
        return out & ~ch.empty_first

    def _flat_fits(self, ch: _Charged, r, T: float):
        """Whether stages (columns) of ``r`` replicas meet T under the faster and the slower flat model.
        Under PipeDream's charges a stage's time falls from r = 2 on (``costmodel.min_replicas``), so
        that is r = 1's answer or ``r >= rise``, worked out once per T (``_stage_intervals``) instead
        of two stage times per candidate count; fxpipe's tied ring can rise again, so there they are
        computed."""
        if self.opts.cost_model == "pipedream":
            return (np.where(r == 1, one, r >= rise) for one, rise in
                    ((ch.one_fast, ch.rise_fast), (ch.one_slow, ch.rise_slow)))
        return (stage_time_s(ch.C, ch.own + ch.tied, 0.0, 0.0, r, f, ch.tied, ch.partners) <= T * (1 + EPS)
                for f in self.flat)

    def _candidates(self, ch: _Charged):
        """(columns of counts, per pair, to try; whether each is in its pair's window; whether it is
        charged exactly). Under ``any`` at most ``WINDOW`` node widths are tried exactly; a wider
        window (a stage the slower flat model cannot fit, or only with many more counts) gets, past
        them, the next count of each residue at its least charge: every count from ``lo`` on meets T
        under the faster flat model, whose charge no placement undercuts, so the bound stays a bound
        (the plan may then score above T, as with cuts)."""
        if self.opts.replication == "pow2":
            allowed = np.asarray(self.opts.allowed_replicas(), dtype=np.int64)
            cols = np.broadcast_to(allowed, ch.lo.shape + allowed.shape)
            return cols, (cols >= ch.lo[:, None]) & (cols <= ch.hi[:, None]), np.ones(cols.shape[1], dtype=bool)
        span = WINDOW * self.G
        width = int(min(span + self.G, max(0, (ch.hi - ch.lo).max(initial=-1) + 1)))
        cols = ch.lo[:, None] + np.arange(width)[None, :]
        exact = np.arange(width) < span
        inside = (cols <= np.where(exact[None, :], ch.hi[:, None], self.opts.devices)) \
            & (exact[None, :] | (ch.hi - ch.lo >= span)[:, None])
        return cols, inside & (ch.lo[:, None] <= self.opts.devices), exact

    def _charged_targets(self, rows, s, ch: _Charged, T: float, room=None, known=None, cuts=None):
        """``_charged_best`` unpacked: per pair and end state the fewest devices after the stage (> K:
        none), the source state and the replicas."""
        best = self._charged_best(rows, s, ch, T, room, known, cuts)
        return best >> _VAL, best & _LOW, (best >> _REPS) & _LOW

    def _charged_best(self, rows, s, ch: _Charged, T: float, room=None, known=None, cuts=None):
        """For pairs (source row s of ``rows``, their ``_Charged``): per end state (last axis: the offset,
        times the previous count's classes with ``exact_cuts``) the fewest devices after the stage (> K:
        none), the replicas and the source state, packed (``_packed``). ``room``: per
        pair, the most devices its end point may hold (K less what the compute after it needs at T:
        the pass drops more at once, ``PlacedChainSolver._needed``); counts past it are not tried.
        ``known``: whether each pair fits with each candidate count at each start offset, worked out
        before (``_known_fits``), else worked out here for the counts tried. ``cuts``: the bytes cut
        at each row's point, where the state holds the previous stage's count (``_column_loop``)."""
        K, G = self.opts.devices, self.G
        n = s.size
        room = np.full(n, K, dtype=np.int64) if room is None else room
        settled = self._settled(rows, s, ch)
        if settled is None:
            return self._column_loop(rows, s, ch, T, room, known, None, cuts)
        # those pairs' counts from ``first`` on are done: the loop tries those below, for the pairs that have any
        none = _packed(K + 1, 0, 0)
        done, got = settled
        if done.size == n:  # every pair (most of a deep stack's pool): no scatter
            best = np.where(got >> _VAL <= room[:, None], got, none)
        else:
            best = np.full((n, G), none, dtype=np.int64)
            best[done] = np.where(got >> _VAL <= room[done, None], got, none)
        loop = np.nonzero(ch.looped)[0]  # on a deep stack nearly every pair is settled from its least count
        if loop.size:
            sub = ch.take(loop) if isinstance(ch, Gathered) else _Rows(ch, loop, column=False)  # lazy either way
            below = np.where(sub.settle > 0, sub.settle, K + 2)  # per pair, the counts it still tries lie under it
            part = self._column_loop(rows, s[loop], sub, T, room[loop], None if known is None else known[loop], below)
            best[loop] = np.minimum(best[loop], part)
        return best

    def _column_loop(self, rows, s, ch, T: float, room, known, below, cuts=None):
        """``_charged_targets``'s candidate counts tried one column at a time, for pairs (source row s of
        ``rows``, their ``_Charged``; ``below``: per pair, counts from it on are settled already, or None):
        per pair and end state the best packed (devices, replicas, source state).

        Where the state holds the previous stage's count (``R`` classes, pow2: ``_entering``), a count of
        class q reads, per source row and start offset, the fewest devices over the classes whose
        cut into it (``cuts``, the row's bytes) meets T, and writes the states of class q."""
        K, G = self.opts.devices, self.G
        # per pair and end state the best (devices, replicas, source state) packed in one integer, so one
        # minimum keeps it: the fewest devices, and among those the fewest replicas (the earliest count
        # tried, as the columns rise), whose source offset follows from it
        best = np.full((s.size, G * self.R), _packed(K + 1, 0, 0), dtype=np.int64)
        cols, inside, exact = self._candidates(ch)
        if below is not None:
            inside = inside & (cols < below[:, None])
        same = self.opts.replication == "pow2"  # one count per column: every pair shifts offsets alike
        least = rows.min(axis=1)[s]
        entered, came = rows, None  # per source row and start offset, the fewest devices (and their class)
        for w in range(cols.shape[1]):
            if past(self.deadline):  # one segment's pairs can take seconds on many devices
                raise DeadlineExceeded()
            live = np.nonzero(inside[:, w])[0]
            if not live.size:
                continue
            live = live[least[live] + cols[live, w] <= room[live]]
            if not live.size:
                continue
            r = cols[live[:1], w][:, None] if same else cols[live, w][:, None]
            fits = known[live, w] if known is not None else self._column_fits(ch, live, r, exact[w], T)
            keep = np.nonzero(fits.any(axis=1))[0]  # a pair that fits at no offset adds nothing
            if keep.size < live.size:
                if not keep.size:
                    continue
                live, r, fits = live[keep], (r if same else r[keep]), fits[keep]
            pay = self._payload[r[:, 0]]  # replicas and, per end offset, the offset the stage starts at
            src = pay & _LOW
            band = slice(None)
            if self.R > 1:  # pow2: one count, so one class q, per column
                q = int(self._class[int(r[0, 0])])
                entered, came = self._entering(rows, cuts, q, T)
                band = slice(q * G, (q + 1) * G)
            after = entered[s[live]] + r
            tot = np.where(fits & (after <= room[live, None]), after, K + 1)
            got = tot[:, src[0]] if same else np.take_along_axis(tot, src, axis=1)
            if came is not None:  # the source state: its class, then its offset
                pay = (pay & ~_LOW) | (came[s[live]][:, src[0]] * G + src[0])
            best[live, band] = np.minimum(best[live, band], (got << _VAL) | pay)
        return best

    def _entering(self, rows, cuts, q: int, T: float):
        """Per source row and start offset, the fewest devices over the previous stage's classes whose
        cut into a stage of class q meets T there (``offsets.cut_load_table``: both sides' ranks and
        nodes known, so the cut is charged exactly), and that class."""
        n, K = rows.shape[0], self.opts.devices
        by_class = rows.reshape(n, self.R, self.G)
        ok = cuts[:, None, None] * self._cut_load[None, :, q, :] <= T * (1 + EPS)
        held = np.where(ok, by_class, K + 1)
        came = held.argmin(axis=1)
        return np.take_along_axis(held, came[:, None, :], axis=1)[:, 0, :], came

    def _settled(self, rows, s, ch: _Charged):
        """Under PipeDream's charges and any count, the pairs whose stage fits at every offset from some
        count ``first`` on, with their best over all counts from ``first`` on (packed, devices past K
        left in: the caller drops what passes the room of its end); None when no pair is.

        From r = 2 on a stage meets T under the slower flat model for every r >= ``rise_slow``
        (``_flat_fits``), and then at every offset (no placement charges more), and it clears its cuts
        for every r >= their floors: from ``first``, the largest of those, it fits everywhere. A count
        G past another one that fits everywhere reaches the same end offsets from the same start
        offsets with G more devices, so counts ``first`` to ``first + G - 1`` decide (where all of them
        are in the pair's exact window, as the column loop would try them). Their best at end offset m'
        is, with k = (m' - first) mod G, ``first`` plus the least over j < G of
        ``dev[(k - j) mod G] + j``, which depends on the source row only: one G x G table per row
        instead of G columns per pair.
        """
        if not self._settles:
            return None
        G = self.G
        done = np.nonzero(ch.settle)[0]
        if not done.size:
            return None
        first = ch.settle[done]
        if rows.shape[0] <= done.size:  # a table for every source row costs less than finding those used
            used, row_of = rows, s[done]
        else:
            at, row_of = np.unique(s[done], return_inverse=True)
            used = rows[at]
        k, j = np.arange(G)[:, None], np.arange(G)[None, :]
        start = (k - j) % G  # (k, j): the start offset of count first + j for end offset first + k
        table = np.min(_packed(used[:, start] + j, j, start), axis=2)  # (sources, k)
        # per source, the table turned for each residue of ``first``: (sources, first mod G, end offset)
        turned = table[:, (np.arange(G)[None, :] - np.arange(G)[:, None]) % G].reshape(-1, G)
        got = np.take(turned, row_of * G + first % G, axis=0)
        got += _packed(first, first, 0)[:, None]
        return done, got

    def _from_pool(self, pool, seg: Segment, T: float, dev, src_b, dev_all, rest=None):
        """Stages from pool points to this segment's points (``PlacedChainSolver._from_pool``), every
        pair through ``_charged_targets``; returns which pool points still reach past the segment.

        The pool points go ``POOL_CHUNK`` pairs at a time, each chunk's best kept per point and state
        (the earliest source on a tie, as one argmin over all would): the packed answers take 8 bytes
        per pair and state, and on a lattice that keeps the shape reads (8 H100-profiled blocks on 128
        devices, up to 450 pool points into segments of 1,588) all at once they put 225 MB on a pass
        that grew the process by 770 MB, past the planner's memory stop."""
        K = self.opts.devices
        ids = pool[0]
        d, n = len(seg.compute), ids.size
        step = max(1, POOL_CHUNK // (d + 1))
        reach = np.zeros(n, dtype=bool)
        least = np.full(dev.shape, K + 1, dtype=np.int64)  # per point and state: the best devices so far,
        won = np.zeros(dev.shape, dtype=np.int64)  # their packed answer, and the pool row they came from
        came = np.zeros(dev.shape, dtype=np.int64)
        for a in range(0, n, step):
            part = tuple(x[a:a + step] for x in pool)
            m = part[0].size
            ch = self._pool_stages(part, seg, T)
            room = None if rest is None else np.broadcast_to(K - np.append(rest, 0)[None, :], (m, d + 1)).ravel()
            cuts = np.where(part[0] == 0, 0.0, part[4])  # no stage before the first: nothing cut into it
            best = self._charged_best(dev_all[part[0]], np.repeat(np.arange(m), d + 1), ch, T, room,
                                      cuts=cuts).reshape(m, d + 1, -1)
            val = best >> _VAL  # the rest unpacked only where a source wins
            reach[a:a + m] = (val[:, d, :] <= K).any(axis=1)
            row = val[:, :d].argmin(axis=0)  # (d, states)
            got = np.take_along_axis(val[:, :d], row[None], axis=0)[0]
            better = got < least
            if better.any():
                least = np.where(better, got, least)
                won = np.where(better, np.take_along_axis(best[:, :d], row[None], axis=0)[0], won)
                came = np.where(better, row + a, came)
        xs, ms = np.nonzero(least < dev)
        if xs.size:
            got = won[xs, ms]
            dev[xs, ms] = got >> _VAL
            src_b[xs, ms] = np.stack([ids[came[xs, ms]], got & _LOW, (got >> _REPS) & _LOW], axis=1)
        return reach

    def _inside(self, seg: Segment, off: int, T: float, dev, src_b, rest=None) -> None:
        """Stages with both ends in this segment (``PlacedChainSolver._inside``), through
        ``_charged_targets``."""
        j = seg.sub_j
        ch = self._near_intervals(seg, off, T)
        cuts = np.asarray(seg.cut, dtype=float).copy()
        if off == 0:
            cuts[0] = 0.0  # no stage before the first: nothing cut into it
        for pairs, starts, targets in self._levels(seg):
            room = None if rest is None else self.opts.devices - rest[seg.sub_i[pairs]]
            some = ch.take(pairs)
            val, from_m, reps = self._charged_targets(dev, j[pairs], some, T, room,
                                                      self._known_fits(ch, pairs, some, T), cuts)
            keyed = val * (1 << 32) + np.arange(pairs.size)[:, None]
            mins = np.minimum.reduceat(keyed, starts, axis=0)
            best_val, idx = mins >> 32, mins & ((1 << 32) - 1)
            rows, ms = np.nonzero(best_val < dev[targets])
            if not rows.size:
                continue
            x, k = targets[rows], idx[rows, ms]
            dev[x, ms] = best_val[rows, ms]
            src_b[x, ms, 0] = off + j[pairs[k]]
            src_b[x, ms, 1] = from_m[k, ms]
            src_b[x, ms, 2] = reps[k, ms]

    def _known_fits(self, ch: _Charged, pairs: np.ndarray, some: _Charged, T: float) -> Optional[np.ndarray]:
        """Whether each pair of a level (``some``: ``ch``'s rows ``pairs``) fits with each candidate count
        at each start offset (pairs x counts x G), for the second and later segments that ask for the
        same level at the same T; None the first time (``_charged_targets`` then works out only the
        counts it tries) and where the table would pass ``KNOWN_CELLS``.

        Whether a stage fits depends on the stage alone, not on the devices before it, and repeated
        blocks have equal stages (``PlacedChainSolver._near_intervals`` hands them one ``ch``): on a
        deep stack most of a pass went to asking every block the same question."""
        key = (T, self.holders)
        if self._known[0] != key:
            self._known = (key, {})
        seen = self._known[1]
        slot = (id(ch), id(pairs))
        if slot not in seen:  # the objects are kept with the answer, so their ids stay theirs
            seen[slot] = (ch, pairs, None)
            return None
        table = seen[slot][2]
        if table is not None:  # False: too large to keep
            return None if table is False else table
        cols, inside, exact = self._candidates(some)
        G = self.G
        if cols.shape[0] * cols.shape[1] * G > KNOWN_CELLS:
            seen[slot] = (ch, pairs, False)  # too large to keep: worked out per segment, as the first time
            return None
        out = np.zeros(cols.shape + (G,), dtype=bool)
        same = self.opts.replication == "pow2"
        for w in range(cols.shape[1]):
            if past(self.deadline):
                raise DeadlineExceeded()
            live = np.nonzero(inside[:, w])[0]
            if not live.size:
                continue
            r = cols[live[:1], w][:, None] if same else cols[live, w][:, None]
            out[live, w] = self._column_fits(some, live, r, exact[w], T)
        seen[slot] = (ch, pairs, out)
        return out

    def _column_fits(self, ch: _Charged, live: np.ndarray, r, exact: bool, T: float) -> np.ndarray:
        """Whether pairs ``live`` of ``ch`` meet T with ``r`` replicas (a column, or one count for all) at
        each start offset: ``_fits`` on a count charged exactly, the cut floor alone past the exact window
        (``_candidates``)."""
        some = _Rows(ch, live)
        return self._fits(some, np.arange(self.G)[None, :], r, T) if exact else (r >= some.near) & ~some.empty_first


_VAL, _REPS, _LOW = 40, 20, (1 << 20) - 1  # bit positions of ``_packed``'s fields, and a field's mask


def _packed(devices, replicas, offset):
    """(devices, replicas, offset) as one int64 that orders like the tuple (each field below 2^20)."""
    return (np.asarray(devices, dtype=np.int64) << _VAL) | (np.asarray(replicas, dtype=np.int64) << _REPS) \
        | np.asarray(offset, dtype=np.int64)


def _one_fits(time_at, C, untied, T: float) -> np.ndarray:
    """Per stage, whether one replica meets T: one replica pays no all-reduce, so a stage without tied
    weights fits iff its compute does; the rest are asked (``time_at(counts, which)``)."""
    t = np.asarray(C, dtype=float).copy()
    k = np.nonzero(~untied)[0]
    if k.size:
        t[k] = time_at(np.ones(k.size), k)
    return t <= T * (1 + EPS)


def _rising_from(time_at, n: int, T: float, K: int, allowed: Optional[np.ndarray] = None,
                 guess: Optional[np.ndarray] = None, sure: Optional[np.ndarray] = None) -> np.ndarray:
    """Per stage, the least count r >= 2 from which ``time_at(counts, which)`` meets T for every larger
    count up to K, for times that fall, or fall and then rise, from r = 2 on (both models, tied or not;
    see ``costmodel.min_replicas``); K + 1 where even K does not. Bisection: where K and r meet T, so
    does every count between them. ``allowed`` (sorted; ``pow2``): only those counts are asked, the
    answer is the least allowed one from which every larger allowed one meets T (log2 of their number
    steps instead of log2 K: all the DP reads, as it tries no other count). ``guess`` (any count): per
    stage a count near the answer (``_pipedream_rise``); it and its neighbour are asked first, which
    settles every stage whose guess is within one, and bisection narrows the rest from there.
    ``sure``: where the guess is the answer already (an untied stage whose root is clear of an
    integer, ``_pipedream_rise``): those stages are not asked at all."""
    grid = None if allowed is None else allowed[allowed >= 2]  # bisect over indices into it, else the counts
    if grid is not None and not grid.size:
        return np.full(n, K + 1, dtype=np.int64)
    if sure is not None and guess is not None and grid is None and sure.any():
        out = np.where(guess <= K, np.maximum(guess, 2), K + 1).astype(np.int64)
        rest = np.nonzero(~sure)[0]
        if rest.size:
            out[rest] = _rising_from(lambda r, k: time_at(r, rest[k]), rest.size, T, K, None, guess[rest])
        return out
    at = (lambda i: i) if grid is None else (lambda i: grid[i])  # noqa: E731
    top = K if grid is None else grid.size - 1
    lo, hi = np.full(n, 2 if grid is None else 0, dtype=np.int64), np.full(n, top, dtype=np.int64)
    every = np.arange(n)
    fits = time_at(np.maximum(at(hi), 1), every) <= T * (1 + EPS)
    k = np.nonzero(fits)[0]
    lo[k] = least_fitting(lambda i, j: time_at(at(i), k[j]), lo[k], hi[k], T,
                          guess[k] if guess is not None and grid is None else None)
    return np.where(fits, np.maximum(lo if grid is None else grid[np.minimum(lo, top)], 1), K + 1)


def _pipedream_rise(C, P, T: float, bandwidth: float):
    """Per stage, the ceiling of the larger root of ``T'·r^2 - (C + b)·r + b`` (``b = 4P/B``, ``T' =
    T(1 + EPS)``, the tolerance every fit is asked at): PipeDream's flat time ``(C + b)/r - b/r^2``
    (``costmodel._allreduce`` on the stage's own weight bytes P; no cuts) meets T from there on, and
    falls from r = 2 on; 2 where it meets T at every r. With it, whether that count is the answer
    for a stage without tied weights whatever the rounding: where the root lies more than ``CLEAR``
    (relative) from an integer and the discriminant as far from 0, the quadratic's sign at each count
    is far larger than the rounding of a stage time. A guess for ``_rising_from`` elsewhere, which
    checks it: a tied weight's sync adds a term, so there the answer lies at or above it, and rounding
    can move it by one."""
    b = 4.0 * np.asarray(P, dtype=float) / bandwidth
    s = np.asarray(C, dtype=float) + b
    top = T * (1 + EPS)
    disc = s * s - 4.0 * top * b
    root = (s + np.sqrt(np.maximum(disc, 0.0))) / (2.0 * top)
    guess = np.where(disc < 0, 2.0, np.ceil(np.minimum(root, 2.0 ** 40))).astype(np.int64)
    clear = (np.abs(disc) > CLEAR * s * s) & ((disc < 0) | clear_of_integer(root))
    return guess, clear & (root < 2.0 ** 40)


def solver_for(units: Units, segments: List[Segment], opts: CostOptions,
               exact_cuts: bool = False) -> PlacedChainSolver:
    """The placed DP for ``opts``: interval look-ups where fxpipe's charges allow them (any count),
    else every candidate count tried at every offset (``ChargedChainSolver``); ``exact_cuts`` (pow2
    only): with the previous stage's count in the state."""
    if opts.cost_model == "fxpipe" and opts.replication == "any" and not exact_cuts:
        return PlacedChainSolver(units, segments, opts)
    return ChargedChainSolver(units, segments, opts, exact_cuts)
