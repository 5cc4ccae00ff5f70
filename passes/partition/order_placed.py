"""The order DP on a two-level machine: each stage's ranks follow from the devices before it.

On a two-level machine the solvers that see placement (``placed.py``,
``charged.py``, the downset DP) need segments or a small lattice; PipeDream's
CNN and LSTM graphs on many devices have neither, and CP-SAT searches them
under the flat models only, so their plans moved between runs (gnmt on 8
nodes of 8 under fxpipe's charges: 0.00 to 32.6 % open). Along one
topological order, with stages on contiguous ranks in order (``topology.py``),
a stage that starts after k devices sits on ranks [k, k + r): its all-reduce
is known exactly (``costmodel.allreduce_span``). Its cuts depend on both
neighbours' ranks; charged here at the slower bandwidth on every pair, no
cut costs more than that (``topology.pair_load``), so the DP's bottleneck
is never below the plan's real time, and the plan is scored by ``evaluate``.
The table is O(n^2 · R · K) like ``heuristic.order_dp``'s (K starts per
count): it runs where that is at most ``PLACED_CELLS``, each order until
its share of the time ends (``driver._placed_order``).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions, allreduce_span, combine_stage_time
from passes.partition.heuristic import Solution, order_dp, topo_orders
from passes.partition.memory_guard import past

PLACED_CELLS = 1 << 29  # n^2 · R · K / 2 cells up to which an order is tabled on a two-level machine:
# gnmt_large (93 units) on 256 devices, any count, is 2.8e8 cells, about 2.5 s an order here


def fits(units: Units, opts: CostOptions) -> bool:
    """Whether the table is small enough to run (``PLACED_CELLS``)."""
    n, K, R = len(units), opts.devices, len(opts.allowed_replicas())
    return n * n * R * K / 2 <= PLACED_CELLS


def best_placed_order(units: Units, opts: CostOptions, deadline: float = math.inf) -> Optional[Solution]:
    """The best of ``placed_order_dp`` over ``heuristic.topo_orders`` (those done by the deadline)."""
    found = []
    for order in topo_orders(units):
        plan = placed_order_dp(units, opts, order, deadline)
        if plan is not None:
            found.append(plan)
        elif past(deadline):
            break
    return min(found, key=lambda s: s.objective) if found else None


def placed_order_dp(units: Units, opts: CostOptions, order: Sequence[int],
                    deadline: float = math.inf) -> Optional[Solution]:
    """Best contiguous split of ``order`` with contiguous placement, every cut at the slower bandwidth
    (its objective bounds the plan's real time from above); None past the deadline or where no plan
    uses the devices as ``opts`` asks."""
    slowest = min(opts.bandwidth, opts.intra_bw)

    def times(compute, params, cut_in, cut_out, r, width):
        first = np.arange(width)  # the stage's first rank: the devices before it
        sync = allreduce_span(params[:, None], first[None, :], r, opts)
        comm = 2.0 * np.maximum(cut_in, cut_out) / (slowest * r)
        return combine_stage_time(compute[:, None], r, sync, comm[:, None])

    return order_dp(units, opts, order, deadline, times)
