"""A cheap lower bound for PipeDream's hierarchical all-reduce on a two-level machine.

The flat model at the faster bandwidth B1 (``costmodel.flat_bound``) is a bound
of the placed model, but it charges a stage spread over many nodes as if its
all-reduce ran at B1 throughout. PipeDream charges such a stage ``(4(c-1)/(B1·c)
+ 4(n-1)/(B2·n)) · P / r`` (or one ring at B2, ``4(r-1)/(B2·r) · P / r``, when
that is less): r ranks over n nodes, c in the fullest. Whatever its placement,
r ranks touch at least ``n = ceil(r / G)`` nodes, three or more of them with a
full node between (c = G), two with at least half the ranks in one, and the
sum is at least that at the least n (``NodeFloorSolver._band``): what the flat
B1 model misses on plans that replicate stages across nodes (8 blocks on 512
devices: the B1 bound lay 2.9 % under the plan, the floor's 0.17 %).

``NodeFloorSolver`` is the flat segment DP with that floor in its fewest-replicas
step: r <= G as the B1 model counts (one node can hold the stage, and inside it
PipeDream's charge is the flat one at B1); for r > G each band of counts that
touch the same least number of nodes n, ``((n-1)G, nG]``, charges the own
weights that band's least (or the B1 ring, if more) over r, tied weights and
cuts as the B1 model does. Every term falls with r inside a band (PipeDream's ring
``4(r-1)/r^2`` falls from r = 2), so a band holds a count that meets T iff its
top count does, and its fewest is found by bisection; the bands are tried in
order. No placement charges a stage less, so T infeasible here is infeasible
placed: a bound, at the cost of a flat pass.

fxpipe's charges with power-of-two counts get the same floor, simpler: its
all-reduce is one ring at its slowest link, so r > G ranks, which span two
nodes or more wherever they sit, pay the ring at B2 (``2(r-1)/r · P / B2``),
and so does a weight tied to them (its group holds those r ranks); r <= G as
the B1 model counts. The counts past G are few (log2 K), so each is tried in
order. The other bound of that path, the "any" placed DP (``placed.py``), cannot
see that a stage's count rounds up to the next power of two, which on many
devices costs more than the placement it does see (the bundled 8-block GPT on
1,024 devices, 10 s: its bound 18 % under the plan, the floor's 0.07 %); on
fewer devices it is often the higher of the two, and the driver keeps the
higher.
"""
from __future__ import annotations

import math
from typing import List

import numpy as np

from passes.partition.chain import ChainSolver, DeadlineExceeded, stage_compute
from passes.partition.coarsen import Units
from passes.partition.costmodel import (CostOptions, allreduce_nodes, combine_stage_time, flat_bound, min_replicas,
                                        tied_floor_s)
from passes.partition.memory_guard import past
from passes.partition.offsets import EPS, clear_of_integer, least_fitting
from passes.partition.segments import Segment

MAX_BANDS = 16  # node bands tried per stage; past them the count stays a floor (the bound stays a bound)


def applies(opts: CostOptions) -> bool:
    """A machine of several nodes (where the floor says more than B1) under PipeDream's charges with any
    count, or fxpipe's with power-of-two counts (module docstring)."""
    charges = (opts.cost_model, opts.replication) in (("pipedream", "any"), ("fxpipe", "pow2"))
    return (charges and opts.gpus_per_node is not None and opts.gpus_per_node < opts.devices
            and opts.memory is None)


class NodeFloor:
    """The floor itself, for one two-level machine: the fewest count from a start meeting T when every
    count past G pays the all-reduce of the least nodes it must touch (module docstring).
    ``NodeFloorSolver`` takes its fewest replicas from it; the charged placed DP
    (``charged.ChargedChainSolver``) starts its candidate counts there, since no count below fits at
    any offset."""

    deadline = math.inf  # of the pass asking: a band search on many devices checks it

    def __init__(self, machine: CostOptions) -> None:
        if not applies(machine):
            raise ValueError("NodeFloor: PipeDream's charges with any count, or fxpipe's with pow2 "
                             "counts, on several nodes only")
        self.machine, self.G = machine, machine.gpus_per_node
        self.opts = flat_bound(machine, fast=True)
        self.ring = machine.cost_model == "fxpipe"  # one ring at its slowest link (module docstring)
        r = np.arange(machine.devices + 1)
        ring = allreduce_nodes(1.0, r, 1, r, self.opts)  # the B1 ring, per weight byte
        self._ring_r = ring * r  # times r: grows with r (``_fewest_across``' closed form)
        # per band n (1..ceil(K/G)), ``_band(n)``: a pass asks it for every open stage of every band
        self._bands = np.concatenate([[0.0], self._band(np.arange(1, -(-machine.devices // self.G) + 1))])
        if self.ring:  # past G ranks the ring crosses nodes: B2
            wide = allreduce_nodes(1.0, r, 2, self.G, machine)
        else:
            wide = np.maximum(ring, self._bands[np.maximum((r + self.G - 1) // self.G, 1)] / np.maximum(r, 1))
        # per count, the floor's charge per own weight byte: it depends on r alone (its band is ceil(r/G)),
        # so one table serves every stage and T (a pass evaluates it for millions of stage-count pairs)
        self._own = np.where(r > self.G, wide, ring)
        self._slow = flat_bound(machine, fast=False)  # fxpipe: a tied weight's ring past G ranks
        allowed = np.asarray(self.opts.allowed_replicas(), dtype=np.int64)
        self._wide_counts = allowed[allowed > self.G]

    def fewest(self, C, own, tied, q, cut, start, T: float) -> np.ndarray:
        """Per stage (flat arrays: compute, own and tied weight bytes, tied partners, the larger cut),
        the fewest count from ``start`` (each > G) meeting T under the floor; ``devices + 1`` where
        none does."""
        fewest = self._fewest_counted if self.ring else self._fewest_across
        return fewest(C, own, tied, q, cut, start, T)

    def _band(self, n):
        """Per weight byte, times r, the least PipeDream charges (``costmodel.allreduce_nodes``) r ranks of
        band n (``r > (n-1)G``) anywhere: at the band's least count (the flat B2 ring grows with r); over
        n >= 3 nodes a full middle one holds G of them; over two at least half sit in one, unless the
        stage spans three."""
        G, machine = self.G, self.machine
        least = (n - 1) * G + 1
        k = allreduce_nodes(1.0, least, n, np.where(n == 2, (G + 2) // 2, G), machine) * least
        return np.where(n == 2, np.minimum(k, allreduce_nodes(1.0, least, 3, G, machine) * least), k)

    def _time(self, C, own, tied, q, cut, r):
        """A stage's floor at r replicas (arrays; r > G spans at least ceil(r/G) nodes): its own weights at
        their band's least, or the B1 ring if more (``_own``); tied weights and cuts as the B1 model
        charges them."""
        fast = self.opts
        sync = own * self._own[r]
        if np.any(tied):  # fxpipe's ring over a group holding r > G ranks runs at B2
            sync = sync + tied_floor_s(tied, r, self._slow if self.ring and np.all(r > self.G) else fast, q)
        return combine_stage_time(C, r, sync, 2.0 * cut / (fast.bandwidth * r))

    def _fewest_counted(self, C, own, tied, q, cut, start, T):
        """fxpipe's charges, power-of-two counts: the fewest count from ``start`` (> G, where the B1
        model's fewest lies) meeting T under the floor, every allowed count past G tried in order (at
        most log2 K of them); ``devices + 1`` where none does."""
        got = np.full(C.shape, self.opts.devices + 1, dtype=np.int64)
        for r in self._wide_counts:
            open_ = np.nonzero((got > self.opts.devices) & (r >= start))[0]
            if open_.size:
                fits = self._time(C[open_], own[open_], tied[open_], q[open_], cut[open_], r) <= T * (1 + EPS)
                got[open_[fits]] = r
        return got

    def _fewest_across(self, C, own, tied, q, cut, start, T):
        """Fewest counts from ``start`` (> G, where the B1 model's fewest lies) meeting T under the floor,
        band by band; ``devices + 1`` where none does, a floor past ``MAX_BANDS`` bands.

        Inside band n a stage's own weights cost ``max(r·ring(r), band(n)) / r`` (``_own``), and r·ring(r)
        grows with r: where the band's least charge is at least the ring's at the band's top count, every
        count of the band pays it, and a stage without tied weights then takes ``x / r`` with ``x = max(C +
        own·band(n), 2·cut/B1)``: its fewest count is ceil(x / T), read without asking, where x / T lies
        clear of an integer (``offsets.clear_of_integer``). The rest are asked, count by count."""
        K, G = self.opts.devices, self.G
        out = np.full(C.shape, K + 1, dtype=np.int64)
        open_ = np.arange(C.size)
        n = (start + G - 1) // G
        lo = start.copy()
        untied = tied <= 0
        most = T * (1 + EPS)
        for _ in range(MAX_BANDS):
            if not open_.size:
                return out
            if past(self.deadline):
                raise DeadlineExceeded()
            top = np.minimum(n * G, K)
            band = self._bands[n]
            x = np.maximum(C[open_] + own[open_] * band, 2.0 * cut[open_] / self.opts.bandwidth) / most
            read = untied[open_] & (band >= self._ring_r[top]) & clear_of_integer(x)
            fits = x <= top  # read where ``read``; the rest asked below
            ask = np.nonzero(~read)[0]
            if ask.size:
                fits[ask] = self._time(*(v[open_[ask]] for v in (C, own, tied, q, cut)), top[ask]) <= most
            k = np.nonzero(fits & read)[0]
            out[open_[k]] = np.maximum(lo[k], np.ceil(x[k]).astype(np.int64))
            k = np.nonzero(fits & ~read)[0]
            if k.size:
                sub = tuple(v[open_[k]] for v in (C, own, tied, q, cut))
                # the top meets T and the band's time falls with r; its own weights' charge times r is
                # about the same over the band, so (compute + that) / T is near the fewest
                b = top[k]
                guess = np.ceil(np.minimum((sub[0] + sub[1] * self._own[b] * b) / T, K))
                out[open_[k]] = least_fitting(lambda r, j: self._time(*(v[j] for v in sub), r), lo[k], b, T,
                                              guess)
            keep = ~fits & (top < K)
            open_, n, lo = open_[keep], n[keep] + 1, top[keep] + 1
        out[open_] = np.minimum(lo, K + 1)  # not settled within the bands tried: at least the next count
        return out


class NodeFloorSolver(ChainSolver):
    """The flat segment DP under ``flat_bound(machine, fast=True)`` with the all-reduce of a stage over
    more than G ranks floored at the nodes it must touch (``NodeFloor``, module docstring)."""

    def __init__(self, units: Units, segments: List[Segment], machine: CostOptions) -> None:
        self.floor = NodeFloor(machine)
        super().__init__(units, segments, self.floor.opts)
        self.machine, self.G = machine, machine.gpus_per_node

    def _stage_r(self, cj, pj, sj, cutj, ci, pi, si, cuti, T):
        if past(self.deadline):  # few, large segments on many devices: one can take a second
            raise DeadlineExceeded()
        params, tied, shares, flags = self._held(pi - pj, sj, si)
        q = self._partner_count(shares, flags, T)
        C = stage_compute(ci, cj, self.two)
        R = min_replicas(C, params, cutj, cuti, T, self.opts, tied, q)
        wide = np.nonzero(np.ravel(R > self.G) & np.ravel(R <= self.opts.devices))[0]
        if not wide.size:
            return R
        shape = R.shape
        C, own, tied, q, cut = (np.broadcast_to(x, shape).ravel()[wide] for x in
                                (C, params - tied, tied, q, np.maximum(cutj, cuti)))
        out = R.ravel().copy()
        self.floor.deadline = self.deadline
        out[wide] = self.floor.fewest(C, own, tied, q, cut, out[wide], T)
        return out.reshape(shape)
