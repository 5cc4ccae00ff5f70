"""The CP-SAT model: units -> stages, replicas per stage, minimise the bottleneck T.

Variables (S = min(K, units with compute) stage slots; unused slots trail):
  ``le[u][b] ⇔ stage(u) <= b`` (order encoding; ``le[u][S-1]`` is true), so
  ``in[u][b] = le[u][b] - le[u][b-1]`` is linear; ``used[b]`` (a prefix of the
  slots); ``y[b][r]`` one boolean per allowed replica count; ``z[k][b]`` for
  every producer k whose value crosses boundary b; integer ``T``.
Constraints: ``le[v][b] -> le[u][b]`` on every edge ``u -> v`` (stages convex
and chained, on any DAG); every used stage has a unit with compute; the
output unit sits in the last used stage; ``sum r·y == K`` (``<=`` with
``fewer_devices``). The products ``C_b / r_b`` are linearised per replica
choice: ``y[b][r] -> r·T >= C_b + a_r·P_b`` and, for both boundaries of b,
``y[b][r] -> r·T >= 2·A/B`` (this is ``2A/(B·min(r_b, r_b+1))``). The cut
``K·T >= sum C`` gives the LP a real bound from the start. A weight that
stage b shares with another stage (``tied[p][b]``: b holds p but not all of
its users) adds ``tied_floor_s`` with one partner replica, a lower bound of
its sync (``costmodel.tied_sync_s``, which needs the other stages' replicas),
and, where the encoding is small (``EXACT_TIED_TERMS``), what the group's
real size adds to that: ``ge[p][n]`` says the ranks of every stage holding p
number at least n, and each stage pays the steps of its sync from r + 1 ranks
up to the group's size (``_tied_groups``). Past that size the objective is a
floor, and the driver scores every improving solution with ``evaluate``.
Under ``1f1b-stash`` the stages sharing tied weights have one replica count
(``_stash_rule``).

Integer scaling: times become multiples of a unit ``q``. Every coefficient is
rounded to the nearest unit, so a constraint with N terms is off by at most
``N·q/2``. ``q = 5e-4 · (sum C / K) / N_max`` keeps every term of every
constraint, hence the bottleneck of any assignment, within 0.05% of
``sum C / K``, which is a lower bound of the true optimum: the scaled optimum
is within 0.05% of the true one, well inside the promised 0.1%. The reported
objective is always re-evaluated in floating point; the reported bound
subtracts that rounding margin, so it stays a proven bound.

Memory (only with a limit, or when asked for the smallest memory that fits):
``w[b][n]`` picks microbatches in flight ``n`` per stage, at least
``costmodel.in_flight`` (exactly that count: a larger n only uses more
memory), coefficients in units of limit/1e7 rounded UP, so a plan the solver
accepts is within memory. The 1F1B-flush count is a recursion over the stages
after b; it is linear in ``held[b] = r_b·win[b]`` (``_windows``).
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable, Dict, Optional, Sequence

from ortools.sat.python import cp_model

from passes.partition.coarsen import Units
from passes.partition.costmodel import CostOptions, allreduce_coeff, most_in_flight, tied_floor_coeff, tied_floor_s
from passes.partition.memory_guard import MemoryGuard
from passes.partition.model_nodes import charge_node_boundaries, crossing_coeffs, slots_of
from passes.partition import stash_ties
from passes.partition.result import SolveResult

EXACT_TIED_TERMS = 100_000  # shared weights x slots x replica counts x K, up to which tied groups are exact
SOLVE_SLACK = 1.0  # seconds of a CP-SAT time limit kept back for its overrun (``PartitionModel.solve``)
STATUS = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE", cp_model.INFEASIBLE: "INFEASIBLE",
          cp_model.MODEL_INVALID: "MODEL_INVALID", cp_model.UNKNOWN: "UNKNOWN"}


class _Callback(cp_model.CpSolverSolutionCallback):
    """Reports each improving solution; with ``plan_of``, also keeps its plan (``PartitionModel.solve``)."""

    def __init__(self, scale: float, report: Optional[Callable[[str], None]], stop_at: float = -math.inf,
                 plan_of: Optional[Callable[[Callable], tuple]] = None) -> None:
        super().__init__()
        self.scale, self.report, self.start, self.trace = scale, report, time.monotonic(), []
        self.stop_at, self.plan_of, self.plans = stop_at, plan_of, []

    def on_solution_callback(self) -> None:
        wall, obj, bound = time.monotonic() - self.start, self.ObjectiveValue() * self.scale, self.BestObjectiveBound() * self.scale
        self.trace.append((wall, obj))
        if self.plan_of is not None:
            self.plans.append((obj, *self.plan_of(self.Value)))
        if self.report:
            self.report(f"partition: {wall:6.1f}s  solution {obj:.6g}  bound {bound:.6g}")
        if obj <= self.stop_at:
            self.StopSearch()  # as good as a bound proven elsewhere allows


class PartitionModel:
    """Builds the model once; ``solve`` runs CP-SAT on it."""

    def __init__(self, units: Units, opts: CostOptions, minimise_memory: bool = False,
                 machine: Optional[CostOptions] = None) -> None:
        """``machine``: a two-level machine that ``opts`` (its flat model at the faster bandwidth)
        bounds; the model then also charges what crossing a node boundary costs (``model_nodes.py``)."""
        self.units, self.opts, self.m = units, opts, cp_model.CpModel()
        self.minimise_memory = minimise_memory
        self.crossing = crossing_coeffs(machine, opts.allowed_replicas()) if machine is not None else {}
        self.wall_bw = machine.bandwidth if machine is not None else opts.bandwidth
        self.S = slots_of(units, opts)
        self.R = opts.allowed_replicas()
        self.groups: Dict[str, list] = {}  # per shared weight, its group-size literals (``_tied_groups``)
        self.steps: Dict[str, Dict[int, list]] = {}  # ... and per replica count, its charge by size
        lb = max(sum(units.compute) / opts.devices, 1e-12)
        n_terms = max(2 * len(units) + 2 * len(units.shared), len(units.producers), 1)
        self.q = 5e-4 * lb / n_terms
        self.margin = n_terms * self.q  # worst rounding of any constraint, seconds
        self._variables()
        self._structure()
        if opts.schedule == stash_ties.SCHEDULE and units.shared:
            self._stash_rule()
        self._times()
        if machine is not None:
            charge_node_boundaries(self, machine)
        if opts.memory is not None or minimise_memory:
            self._memory()

    # ------------------------------------------------------------ variables
    def _variables(self) -> None:
        m, n, S = self.m, len(self.units), self.S
        true = m.NewConstant(1)
        self.le = [[m.NewBoolVar(f"le{u}_{b}") for b in range(S - 1)] + [true] for u in range(n)]
        self.used = [true] + [m.NewBoolVar(f"used{b}") for b in range(1, S)]
        self.y = [{r: m.NewBoolVar(f"y{b}_{r}") for r in self.R} for b in range(S)]
        self.inside = [[self.le[u][b] - (self.le[u][b - 1] if b else 0) for b in range(S)] for u in range(n)]

    def _structure(self) -> None:
        m, u_, S, K = self.m, self.units, self.S, self.opts.devices
        for u in range(len(u_)):
            for b in range(S - 2):
                m.AddImplication(self.le[u][b], self.le[u][b + 1])
            for b in range(S):
                m.Add(self.inside[u][b] <= self.used[b])
            if u_.is_input[u]:
                m.Add(self.le[u][0] == 1)
            if u_.is_output[u]:
                for b in range(S - 1):
                    m.AddImplication(self.le[u][b], self.used[b + 1].Not())
        for a, v in u_.edges:
            for b in range(S - 1):
                m.AddImplication(self.le[v][b], self.le[a][b])
        for b in range(S):
            if b + 1 < S:
                m.AddImplication(self.used[b + 1], self.used[b])
            m.Add(sum(self.y[b].values()) == self.used[b])
            m.Add(sum(self.inside[u][b] for u in range(len(u_)) if u_.has_compute[u]) >= self.used[b])
        total = sum(r * y for b in range(S) for r, y in self.y[b].items())
        m.Add(total <= K) if self.opts.fewer_devices else m.Add(total == K)
        self.shared = {p: [m.NewBoolVar(f"sh{p}_{b}") for b in range(S)] for p in u_.shared}
        self.tied = {p: [m.NewBoolVar(f"ti{p}_{b}") for b in range(S)] for p in u_.shared}
        for p, (_, users) in u_.shared.items():
            for b in range(S):
                whole = m.NewBoolVar(f"wh{p}_{b}")  # every user of p in stage b
                for u in users:
                    m.Add(self.shared[p][b] >= self.inside[u][b])
                    m.Add(self.inside[u][b] >= 1).OnlyEnforceIf(whole)
                m.Add(self.tied[p][b] >= self.shared[p][b] - whole)

    def _stash_rule(self) -> None:
        """Under ``1f1b-stash`` every stage that shares a tied weight has one replica count (the runtime's
        rule, ``fxpipe.schedule._check_stash_groups``: their ranks all-reduce after every backward, so
        each must run as many): one literal per count, at most one set, implied by every tied stage's
        count. A tied literal set without need only adds the rule, so the solver never does; the bound
        is then one of the problem the runtime can run (``stash_ties.py`` evens the other searches')."""
        m = self.m
        common = {r: m.NewBoolVar(f"stash{r}") for r in self.R}
        m.Add(sum(common.values()) <= 1)
        for b in range(self.S):
            held = m.NewBoolVar(f"anytied{b}")
            for lits in self.tied.values():
                m.AddImplication(lits[b], held)
            for r, y in self.y[b].items():
                m.AddBoolOr([held.Not(), y.Not(), common[r]])

    def _sum_var(self, b: int, weights: Sequence[float], shared: Dict[str, float], name: str, up: bool = False):
        """An integer variable equal to the weighted count of stage b's units (one per stage keeps the model small)."""
        rnd = (lambda x: int(math.ceil(x))) if up else self._round
        terms = [rnd(w) * self.inside[u][b] for u, w in enumerate(weights) if rnd(w)]
        terms += [rnd(w) * self.shared[p][b] for p, w in shared.items() if rnd(w)]
        hi = sum(rnd(w) for w in weights) + sum(rnd(w) for w in shared.values())
        var = self.m.NewIntVar(0, hi, f"{name}{b}")
        self.m.Add(var == sum(terms))
        return var

    @staticmethod
    def _round(x: float) -> int:
        return int(round(x))

    def ratio(self, x: float) -> int:
        """``F·x`` rounded down, for a coefficient's ratio to the largest (``_times``). Rounded to the
        nearest, it charged up to 0.5 / F of a stage's weight sync too much, which the rounding margin
        does not cover where that sync is large: a tied chain on 8 devices read 0.016 % above its
        real time, above the margin, so ``upper_bound`` from that very plan left CP-SAT no solution
        (and a bound could exceed the optimum). Rounded down, the model never charges more."""
        return int(math.floor(self.F * x))

    def _times(self) -> None:
        """``r·T >= C_b + a_r·P_b`` written as ``F·r·T >= F·C_b + floor(F·a_r/a_max)·P_b``.

        This is ``costmodel.stage_time_s`` linearised per replica choice (its
        compute + all-reduce term, and each cut as ``r·T >= 2A/B``): the one
        place the formula is restated, because CP-SAT needs it as constraints.

        P_b counts weights in units of ``q / a_max`` seconds of all-reduce, so
        its rounding obeys the same per-term bound as compute; ``F = 10^4``
        keeps the rounding of the ratio ``a_r / a_max`` (down, ``ratio``) below 0.01% (``10^5`` on a two-level machine,
        where a_max is the crossing all-reduce's, up to B1 / B2 times the flat ratios).
        """
        m, u_, S, q, opts = self.m, self.units, self.S, self.q, self.opts
        total = sum(self._round(c / q) for c in u_.compute)
        amax = max([allreduce_coeff(r, opts) for r in self.R] + list(self.crossing.values()))
        self.amax = amax
        slowest = min(opts.bandwidth, self.wall_bw)  # a cut on a node boundary runs at the machine's B2
        hi = total + sum(self._round(2 * nb / (slowest * q)) for _, nb, _ in u_.producers)
        hi += sum(self._round(amax * p / q) for p in u_.param_bytes) + sum(self._round(amax * nb / q) for nb, _ in u_.shared.values())
        extra = {r: tied_floor_coeff(r, opts) - allreduce_coeff(r, opts) for r in self.R}  # >= 0
        emax = max(extra.values()) if u_.shared else 0.0
        hi += sum(self._round(emax * nb / q) for nb, _ in u_.shared.values())
        if emax > 0 and not self.crossing:
            self._tied_groups()
        tops = {p: max(cum[-1] for cum in self.steps[p].values()) for p in self.groups}  # each group's most
        hi += sum(tops.values())
        self.T = m.NewIntVar(0, hi + 1, "T")
        self.t_hi = hi + 1
        m.Add(opts.devices * self.T >= total)
        self.cuts, self.z = [], []
        for b in range(S - 1):
            terms = []
            for k, (unit, nbytes, consumers) in enumerate(u_.producers):
                z = m.NewBoolVar(f"z{k}_{b}")
                self.z.append((k, b, z))
                for c in consumers:
                    m.Add(z >= self.le[unit][b] - self.le[c][b])
                terms.append(self._round(2 * nbytes / (opts.bandwidth * q)) * z)
            cut = m.NewIntVar(0, hi + 1, f"cut{b}")
            m.Add(cut == sum(terms))
            self.cuts.append(cut)
        F = self.F = 100_000 if self.crossing else 10_000  # crossing coefficients make the flat ones' ratios small
        self.compute, self.params, self.tied_b, self.emax, self.extra = [], [], [], emax, extra
        for b in range(S):
            compute = self._sum_var(b, [c / q for c in u_.compute], {}, "C")
            if amax > 0:
                pw = [amax * p / q for p in u_.param_bytes]
                params = self._sum_var(b, pw, {p: amax * nb / q for p, (nb, _) in u_.shared.items()}, "P")
            if emax > 0:
                tied = self._tied_var(b, emax)
            self.compute.append(compute)
            self.params.append(params if amax > 0 else None)
            self.tied_b.append(tied if emax > 0 else None)
            grown = self._group_charge(b, tops) if self.groups else 0
            for r, y in self.y[b].items():
                k = self.ratio(allreduce_coeff(r, opts) / amax) if amax > 0 else 0
                kt = self.ratio(extra[r] / emax) if emax > 0 else 0
                m.Add(F * r * self.T >= F * compute + (k * params if k else 0) + (kt * tied if kt else 0)
                      + F * r * grown).OnlyEnforceIf(y)
                for cut in self.cuts[max(b - 1, 0): b + 1]:
                    m.Add(r * self.T >= cut).OnlyEnforceIf(y)
        if not self.minimise_memory:
            m.Minimize(self.T)

    def _tied_groups(self) -> None:
        """``self.groups``: per shared weight, ``ge[n - 1]`` for n = 1..K: its group (every rank of every
        stage holding it) has at least n ranks; left empty where that encoding would be too large
        (``EXACT_TIED_TERMS``). ``self.steps``: what each replica count pays at each size.

        Without it the model charges a stage's tied sync for a group of its own replicas plus one
        (``tied_floor_s``), a floor: two solutions of one objective then differ in real time, and the
        solver stops at whichever it found (a tied chain on 8 devices: 0.0581 s or 0.0634 s, run to
        run). With it the sync is charged for the group's real size (``_group_charge``)."""
        m, u_, S, K = self.m, self.units, self.S, self.opts.devices
        if len(u_.shared) * S * len(self.R) * K > EXACT_TIED_TERMS:
            return
        for p, (nb, _) in u_.shared.items():
            held = []  # r * (stage b has r replicas and holds p)
            for b in range(S):
                for r, y in self.y[b].items():
                    x = m.NewBoolVar(f"gx{p}_{b}_{r}")
                    m.Add(x >= y + self.shared[p][b] - 1)
                    held.append(r * x)
            ge = [m.NewBoolVar(f"ge{p}_{n}") for n in range(1, K + 1)]
            for lower, upper in zip(ge, ge[1:]):
                m.AddImplication(upper, lower)
            m.Add(sum(ge) >= sum(held))
            self.groups[p], self.steps[p] = ge, {r: self._extra_steps(nb, r, K) for r in self.R}

    def _extra_steps(self, nbytes: float, r: int, K: int) -> list:
        """``cum[n]``, n = 0..K: the least a stage of r replicas pays for ``nbytes`` tied over n or more
        ranks beyond ``tied_floor_s``'s charge (n - r partners against one), in units of q, rounded
        down: never above the real charge of a group that size, so the bound stays a bound; 0 up to
        r + 1 ranks. The least over larger groups too, since ``ge[n - 1]`` only says "at least n" (the
        sync grows with the group, so that is the charge at n itself)."""
        floor = float(tied_floor_s(nbytes, r, self.opts))
        cum = [0] * (K + 1)
        for n in range(K, r + 1, -1):
            at_n = int(math.floor((float(tied_floor_s(nbytes, r, self.opts, n - r)) - floor) / self.q))
            cum[n] = min(at_n, cum[n + 1]) if n < K else at_n
        return cum

    def _group_charge(self, b: int, tops: Dict[str, int]):
        """What stage b's tied weights cost beyond ``tied_floor_s`` for their groups' real sizes (in q):
        one variable per weight, at least its step sum over ``ge`` for the replica count b has;
        ``tops``: per weight, the most any count pays."""
        terms = []
        for p, ge in self.groups.items():
            top = tops[p]
            if top == 0:
                continue
            e = self.m.NewIntVar(0, top, f"gE{p}_{b}")
            for r, y in self.y[b].items():
                cum = self.steps[p][r]
                steps = [(cum[n] - cum[n - 1]) * ge[n - 1] for n in range(1, len(cum)) if cum[n] > cum[n - 1]]
                if steps:
                    self.m.Add(e >= sum(steps)).OnlyEnforceIf([y, self.tied[p][b]])
            terms.append(e)
        return sum(terms) if terms else 0

    def _tied_var(self, b: int, emax: float):
        """Bytes stage b shares with other stages, in units of ``q / emax`` seconds of sync."""
        w = {p: self._round(emax * nb / self.q) for p, (nb, _) in self.units.shared.items()}
        var = self.m.NewIntVar(0, sum(w.values()), f"TI{b}")
        self.m.Add(var == sum(w[p] * self.tied[p][b] for p in w if w[p]))
        return var

    def _memory(self) -> None:
        m, S, opts, u_ = self.m, self.S, self.opts, self.units
        unit = self._mem_unit() if self.minimise_memory else opts.memory / 1e7
        self.mem_unit = unit
        limit = m.NewIntVar(0, 10**12, "mem") if self.minimise_memory else int(opts.memory // unit)
        self.mem_var = limit
        counts = [sum(r * y for r, y in self.y[k].items()) for k in range(S)]
        window = self._windows(counts) if opts.schedule in ("1f1b-flush", "zb-h1", "2bw") else None
        self.flight = []  # per stage slot: the microbatches in flight the memory constraint uses
        most = most_in_flight(opts)
        for b in range(S):
            w = {n: m.NewBoolVar(f"w{b}_{n}") for n in range(1, most + 1)}
            m.Add(sum(w.values()) == self.used[b])
            # one variable for the count, so each replica choice's bound on it is two terms, not a copy of
            # the whole one-hot sum (up to 2K terms): gnmt_large on 256 devices took 10 s and 700 MB to build
            flight = m.NewIntVar(0, most, f"nf{b}")
            m.Add(flight == sum(n * v for n, v in w.items()))
            self.flight.append(flight)
            self._in_flight(b, self.flight[b], counts, window)
            pm = self._sum_var(b, [p / unit for p in u_.param_bytes], {p: nb / unit for p, (nb, _) in u_.shared.items()}, "PM", up=True)
            am = self._sum_var(b, [a / unit for a in u_.act_bytes], {}, "AM", up=True)
            for n, v in w.items():
                versions = n if opts.schedule == "1f1b-stash" else 2 if opts.schedule == "2bw" else 1
                factor = int(math.ceil(1000 * (versions + 1 + opts.optimizer_state)))
                m.Add(factor * pm + 1000 * n * am <= 1000 * limit).OnlyEnforceIf(v)
        if self.minimise_memory:
            m.Minimize(limit)

    def _windows(self, counts: list) -> list:
        """1F1B-flush's uncapped count per slot: ``win[b] >= 1 + r_{b+1}·win[b+1] / r_b`` as
        ``held[b] >= r_b + held[b+1]`` with ``held[b] = r_b·win[b]``; its least solution is
        ``costmodel.in_flight``'s recursion, and nothing forces more."""
        m, S, K = self.m, self.S, self.opts.devices
        win = [m.NewIntVar(0, 2 * K, f"win{b}") for b in range(S)]
        held = [m.NewIntVar(0, 2 * K, f"held{b}") for b in range(S)]
        for b in range(S):
            for r, y in self.y[b].items():
                m.Add(held[b] == r * win[b]).OnlyEnforceIf(y)
            m.Add(held[b] >= counts[b] + (held[b + 1] if b + 1 < S else 0))
        return win

    def _in_flight(self, b: int, nflight, counts: list, window: Optional[list]) -> None:
        """``nflight >= costmodel.in_flight`` of slot b, per replica choice."""
        m, opts = self.m, self.opts
        for r, y in self.y[b].items():
            per_replica = math.ceil(opts.num_microbatches / r)
            if opts.schedule == "gpipe":
                m.Add(nflight >= per_replica).OnlyEnforceIf(y)
            elif opts.schedule == "1f1b-stash":
                m.Add(r * nflight >= sum(counts[b:])).OnlyEnforceIf(y)
            elif opts.schedule == "2bw":  # flush's window, never capped: the run does not drain
                m.Add(nflight >= window[b]).OnlyEnforceIf(y)
            else:  # the smaller of the window and the microbatches the replica gets
                pipeline = m.NewBoolVar(f"pipe{b}_{r}")
                for k in (range(len(window)) if opts.schedule == "zb-h1" else (b,)):  # zb-h1: the deepest window
                    m.Add(nflight >= window[k]).OnlyEnforceIf([y, pipeline])
                m.Add(nflight >= per_replica).OnlyEnforceIf([y, pipeline.Not()])

    def _mem_unit(self) -> float:
        u_ = self.units
        return max(1.0, (sum(u_.param_bytes) + sum(nb for nb, _ in u_.shared.values()) + sum(u_.act_bytes)) / 1e7)

    # ------------------------------------------------------------ solving
    def hint(self, stage_of: Sequence[int], replicas: Sequence[int]) -> None:
        self.m.ClearHints()
        for u, s in enumerate(stage_of):
            for b in range(self.S - 1):
                self.m.AddHint(self.le[u][b], int(s <= b))
        for b in range(self.S):
            if b:
                self.m.AddHint(self.used[b], int(b < len(replicas)))
            for r, y in self.y[b].items():
                self.m.AddHint(y, int(b < len(replicas) and replicas[b] == r))
        for k, b, z in self.z:
            unit, _, consumers = self.units.producers[k]
            self.m.AddHint(z, int(stage_of[unit] <= b < max(stage_of[c] for c in consumers)))

    def upper_bound(self, seconds: float) -> None:
        """Only accept solutions at most as slow as a known plan (plus the rounding margin)."""
        ub = int(math.ceil((seconds + self.margin) / self.q)) + 1
        self.m.Add(self.T <= ub)
        self.m.AddHint(self.T, ub)

    def solve(self, time_limit: float, workers: int = 2, report: Optional[Callable[[str], None]] = None,
              stop_at: float = -math.inf) -> SolveResult:
        """Solve; ``stop_at``: stop once a solution is at most this many seconds (scaled objective)."""
        solver = cp_model.CpSolver()
        # CP-SAT ran past its own limit by up to 1.2 s here (2-core machine: 4.0 s on a 2.8 s limit, HF
        # GPT-2 untied, K=64), which broke partition's limit + 1 s: it gets less, and is told to stop
        # at the limit from a timer as well
        solver.parameters.max_time_in_seconds = max(0.05, float(time_limit) - min(SOLVE_SLACK, 0.25 * time_limit))
        solver.parameters.num_workers = int(workers)
        solver.parameters.relative_gap_limit = 1e-4
        solver.parameters.cp_model_probing_level = 0  # probing cost seconds of presolve and bought no bound here
        # no dual reductions in presolve: removing a variable that appears in one linear constraint runs a
        # knapsack DP over that constraint's range (``RemoveSingletonInLinear``), a table the size of the
        # stage-time scale (12.5 MB each on a 207-unit encoder LM), and an LNS worker's sub-model held 56 of
        # them at once: the process grew by 450-690 MB for a few tenths of a second on models of 200-300
        # units (OR-Tools 9.15; found with gdb and strace), which tripped the memory guard before the proof.
        # Without them the peak stays within 130 MB of the search's start and the same optima are proven
        # as fast. One presolve pass, not three: the branchy benchmark's open rows read as close or closer
        # (inception_v3 on 32 devices 2.77 % open, mean of three runs, 3.30 % with three passes)
        solver.parameters.keep_all_feasible_solutions_in_presolve = True
        solver.parameters.max_presolve_iterations = 1
        scale = self.mem_unit if self.minimise_memory else self.q
        # with tied weights whose groups are not encoded (``_tied_groups``) the objective only floors their
        # sync, so an earlier solution can be faster in real time than the last: every improving
        # solution's plan is kept for the driver to score (``SolveResult.plans``)
        keep = self.units.shared and not self.groups and not self.minimise_memory
        callback = _Callback(scale, report, stop_at, self._plan if keep else None)
        start = time.monotonic()
        timer = threading.Timer(max(0.0, float(time_limit)), solver.stop_search)
        timer.daemon = True
        timer.start()
        try:
            with MemoryGuard(solver.stop_search) as guard:  # its learned clauses grow with the time it has
                code = solver.Solve(self.m, callback)
        finally:
            timer.cancel()
        wall = time.monotonic() - start
        if guard.tripped and report:
            report(f"partition: CP-SAT stopped at {guard.peak_mb:.0f} MB of memory after {wall:.1f}s, "
                   f"{guard.peak_mb - guard.start_mb:.0f} MB more than at its start (the planning's, inside "
                   f"partition; limit "
                   f"{guard.limit_mb:.0f} MB more); answering with what it found")
        status = STATUS.get(code, str(code))
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return SolveResult(status, None, None, math.inf, 0.0, wall, callback.trace)
        stage_of, replicas = self._plan(solver.Value)
        margin = 0.0 if self.minimise_memory else self.margin
        bound = max(0.0, solver.BestObjectiveBound() * scale - margin)
        return SolveResult(status, stage_of, replicas, solver.ObjectiveValue() * scale, bound, wall, callback.trace,
                           plans=callback.plans)

    def _plan(self, value: Callable) -> tuple:
        """(stage per unit, replicas per used stage) of a solution, ``value`` reading its variables."""
        stage_of = [next(b for b in range(self.S) if value(self.le[u][b])) for u in range(len(self.units))]
        return stage_of, [r for b in range(self.S) for r, y in self.y[b].items() if value(y)]


