"""What crossing a node boundary costs, added to the CP-SAT model of a two-level machine.

CP-SAT cannot search the placed cost model directly, so it searches the flat
model at the faster bandwidth B1 (``costmodel.flat_bound``): a lower bound of
every placement, but far below all of them wherever something must cross
nodes, and on a machine of several nodes something must. Stages sit on
contiguous ranks in pipeline order (``topology.py``), so every node boundary
(rank g·G) either falls inside a stage, whose replicas then all-reduce across
nodes, or between two stages, whose cut then runs entirely between nodes. The
model knows each stage's first rank (the replicas of the slots before it), so
it can tell which, and charge:

- a stage across a boundary: the least all-reduce over the placements of its
  count that cross nodes (``crossing_coeffs``: fxpipe's ring at B2;
  PipeDream's hierarchical charge at the fewest nodes and the fewest ranks in
  the fullest node that such a placement has). A count above G crosses
  wherever it starts, so it pays that at any position;
- a cut on a boundary: every pair of its ranks sits in different nodes, so the
  cut costs ``2A / (B2 · min(r_b, r_b+1))`` exactly (``topology.pair_load``).

Every other stage and cut keeps its B1 charge. The model stays a relaxation
of the placed cost model (its bound a bound), and its plans see where the
nodes end; the driver scores them placed (``costmodel.evaluate``). Without
this, on inception_v3 over 2 nodes of 4 the bound was sum C / K (12 % under
the plan) and CP-SAT's plans were made for one of two flat machines.
"""
from __future__ import annotations

from typing import Dict, Sequence

from passes.partition.costmodel import CostOptions, allreduce_nodes
from passes.partition.topology import span_nodes

MOST_WALLS = 4000  # (node boundaries x stage slots) up to which the boundaries are modelled; past it only counts above G


def crossing_coeffs(machine: CostOptions, counts: Sequence[int]) -> Dict[int, float]:
    """Per replica count r that can cross a node boundary, the least ``r · allreduce / P`` over the
    placements of r contiguous ranks that touch two nodes or more (the model's weight on P)."""
    G = int(machine.gpus_per_node)
    out: Dict[int, float] = {}
    for r in counts:
        if r < 2:
            continue
        spans = [span_nodes(m, r, G) for m in range(G)]
        costs = [r * float(allreduce_nodes(1.0, r, int(n), int(c), machine)) for n, c in spans if n >= 2]
        if costs:
            out[r] = min(costs)
    return out


def slots_of(units, opts: CostOptions) -> int:
    """The CP-SAT model's stage slots (``model.PartitionModel.S``): at most one per unit with compute,
    unless every stage holds one replica and all K must be used."""
    n_work = sum(units.has_compute)
    return min(opts.devices, n_work) if opts.replication != "none" or opts.fewer_devices else opts.devices


def walls_modelled(machine: CostOptions, slots: int) -> bool:
    """Whether the model of ``slots`` stage slots charges every node boundary (each adds two booleans
    per slot); past ``MOST_WALLS`` only counts above G pay their crossing, wherever they sit."""
    walls = (machine.devices - 1) // int(machine.gpus_per_node)
    return 0 < walls * slots <= MOST_WALLS


def charge_node_boundaries(pm, machine: CostOptions) -> None:
    """Add the charges of the module docstring to ``pm`` (a ``model.PartitionModel`` built on the
    faster flat model of ``machine``, with ``pm.crossing = crossing_coeffs(machine, ...)``)."""
    walls = _walls(pm, machine) if walls_modelled(machine, pm.S) else None
    if pm.amax > 0:
        _crossing_allreduce(pm, int(machine.gpus_per_node), walls[0] if walls else None)
    if walls:
        _cuts_on_walls(pm, machine, walls[1])


def _walls(pm, machine: CostOptions):
    """Per slot, a boolean forced true where the slot spans a node boundary, and one where the cut
    after it sits on a boundary (the next slot a stage)."""
    m, S, K, G = pm.m, pm.S, machine.devices, int(machine.gpus_per_node)
    across = [m.NewBoolVar(f"across{b}") for b in range(S)]
    on_wall = [m.NewBoolVar(f"onwall{b}") for b in range(S - 1)]
    ends = []  # ranks used by the slots up to b: the next slot's first rank
    for b in range(S):
        end = m.NewIntVar(0, K, f"end{b}")
        m.Add(end == (ends[-1] if ends else 0) + sum(r * y for r, y in pm.y[b].items()))
        ends.append(end)
    for t in range(G, K, G):
        reach = [_at_least(m, end, t, f"r{t}_{b}") for b, end in enumerate(ends)]  # end_b >= t
        past = [_at_least(m, end, t + 1, f"p{t}_{b}") for b, end in enumerate(ends)]  # end_b > t
        for b in range(S):
            # slot b starts before t (the slots before it end under t) and ends past it
            m.AddBoolOr(([reach[b - 1]] if b else []) + [past[b].Not(), across[b]])
            if b + 1 < S:  # slot b ends exactly at t and slot b + 1 is a stage: the cut is on the wall
                m.AddBoolOr([reach[b].Not(), past[b], pm.used[b + 1].Not(), on_wall[b]])
    return across, on_wall


def _crossing_allreduce(pm, G: int, across) -> None:
    """``r·T >= C_b + a_cross(r)·P_b`` (with the base model's tied term) where slot b's r replicas
    cross nodes: always for r > G, else where ``across[b]`` (None: boundaries not modelled)."""
    for b in range(pm.S):
        for r, y in pm.y[b].items():
            coeff = pm.crossing.get(r)
            if coeff is None or (r <= G and across is None):
                continue
            k = pm.ratio(coeff / pm.amax)
            kt = pm.ratio(pm.extra[r] / pm.emax) if pm.emax > 0 else 0
            rhs = pm.F * pm.compute[b] + k * pm.params[b] + (kt * pm.tied_b[b] if kt else 0)
            pm.m.Add(pm.F * r * pm.T >= rhs).OnlyEnforceIf([y] if r > G else [y, across[b]])


def _cuts_on_walls(pm, machine: CostOptions, on_wall) -> None:
    """Both sides of a cut on a boundary pay its bytes at B2: ``r·T >= 2A/B2`` for either slot."""
    terms = {}
    for k, b, z in pm.z:
        nbytes = pm.units.producers[k][1]
        terms.setdefault(b, []).append(pm._round(2 * nbytes / (machine.bandwidth * pm.q)) * z)
    for b in range(pm.S - 1):
        cut = pm.m.NewIntVar(0, pm.t_hi, f"wallcut{b}")
        pm.m.Add(cut == sum(terms.get(b, [])))
        for slot in (b, b + 1):
            for r, y in pm.y[slot].items():
                pm.m.Add(r * pm.T >= cut).OnlyEnforceIf([y, on_wall[b]])


def _at_least(m, var, t: int, name: str):
    """A boolean that holds iff ``var >= t``."""
    v = m.NewBoolVar(name)
    m.Add(var >= t).OnlyEnforceIf(v)
    m.Add(var <= t - 1).OnlyEnforceIf(v.Not())
    return v
