"""The plan: which nodes run where, with how many replicas, and what it should cost.

All costs are per MICROBATCH (the example input given to fxpipe is one
microbatch): ``bottleneck_s`` is the predicted time between two microbatches
leaving the pipeline, so ``samples_per_s = batch_size / bottleneck_s``. The
speedups compare with one device running the whole model and with pure data
parallelism (all devices replicas of one stage), both under the same cost model.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

from passes.costgraph import CostGraph
from passes.errors import FxpipeError
from passes.partition import PartitionResult, data_parallel, evaluate
from passes.partition.costmodel import CostOptions, StagePlan, assignment_of

from fxpipe.layout import Layout

PLAN_SCHEMA = "fxpipe-plan/1"


@dataclass
class Plan:
    stages: List[StagePlan]
    devices: int
    batch_size: int
    bottleneck_s: float
    samples_per_s: float
    speedup_vs_one: float
    speedup_vs_dp: float
    options: Dict[str, object] = field(default_factory=dict)
    solver: Dict[str, object] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def layout(self) -> Layout:
        return Layout.of([s.replicas for s in self.stages])

    def assignment(self) -> Dict[str, int]:
        return assignment_of(self.stages)

    # ------------------------------------------------------------ JSON
    def cost_options(self, **overrides: object) -> CostOptions:
        """The ``CostOptions`` the plan was made under, with ``overrides`` (``CostOptions.from_dict``)."""
        return CostOptions.from_dict(self.options, **overrides)

    def to_json(self) -> dict:
        data = asdict(self)
        data["schema"] = PLAN_SCHEMA
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        if data.get("schema", PLAN_SCHEMA) != PLAN_SCHEMA:
            raise FxpipeError(f"plan schema is {data.get('schema')!r}, expected {PLAN_SCHEMA!r}; re-run `fxpipe plan`")
        data = {k: v for k, v in data.items() if k != "schema"}
        data["stages"] = [StagePlan(**s) for s in data["stages"]]
        return cls(**data)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Plan":
        path = Path(path)
        if not path.exists():
            raise FxpipeError(f"plan file not found: {path}")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FxpipeError(f"cannot read plan {path}: {exc}; pass the plan.json written by `fxpipe split`") from exc
        if not isinstance(data, dict) or "stages" not in data:
            raise FxpipeError(f"{path} is not a plan (no 'stages'); pass plan.json or the folder `fxpipe split` wrote")
        return cls.from_json(data)

    # ------------------------------------------------------------ printing
    def table(self) -> str:
        from tabulate import tabulate

        two_level = self.options.get("gpus_per_node") is not None
        rows = [[s.index, len(s.nodes), s.replicas, _ranks(s.ranks)] + ([_on_nodes(s)] if two_level else []) +
                [f"{s.compute_s * 1e3:.3f}", f"{s.allreduce_s * 1e3:.3f}", f"{s.comm_s * 1e3:.3f}",
                 f"{s.time_s * 1e3:.3f}", _mib(s.param_bytes), _mib(s.send_bytes), _mib(s.memory_bytes)]
                for s in self.stages]
        head = ["stage", "nodes", "replicas", "ranks"] + (["machine node: ranks"] if two_level else []) + [
            "compute ms", "allreduce ms", "comm ms", "time ms", "params MiB", "sends MiB", "memory MiB"]
        solver = self.solver
        lines = [
            tabulate(rows, head, tablefmt="simple"),
            f"bottleneck {self.bottleneck_s * 1e3:.3f} ms per microbatch, {self.samples_per_s:.1f} samples/s; "
            f"speedup {self.speedup_vs_one:.2f}x vs one device, {self.speedup_vs_dp:.2f}x vs data parallel "
            f"on {self.devices} devices ({self.options.get('cost_model')} cost model); "
            f"{self.options.get('microbatches')} microbatches per step ({self.options.get('schedule')})",
            f"solver {solver.get('status')} ({solver.get('method', 'CP-SAT')}): bound {float(solver.get('bound_s', 0)) * 1e3:.3f} ms, "
            f"gap {float(solver.get('gap', 0)) * 100:.2f}%, {float(solver.get('wall_s', 0)):.2f} s",
        ]
        if two_level:
            lines.insert(1, f"{self.devices} devices on {self.devices // int(self.options['gpus_per_node'])} nodes of "
                            f"{self.options['gpus_per_node']}: {_rate(self.options.get('intra_bandwidth'))} inside a "
                            f"node, {_rate(self.options.get('bandwidth'))} between nodes")
        if solver.get("memory_stop_mb") is not None:
            lines[-1] += (f"; the searches stopped at the memory limit ({float(solver['memory_stop_mb']):.0f} MB), "
                          "before the time limit")
        fewer = solver.get("fewer_devices")
        if fewer:  # under --memory the walk's plan on fewer devices was faster (``driver._fewer_hint``)
            lines.append(f"within the same memory a plan on {fewer['devices']} of the {self.devices} devices runs "
                         f"{float(fewer['bottleneck_s']) * 1e3:.3f} ms per microbatch: --fewer-devices plans for it")
        levels = solver.get("pipedream_hierarchical")
        if levels:
            lines.append(f"PipeDream's hierarchical optimizer (levels solved one after another): "
                         f"{float(levels['time_s']):.4f} s, GPUs per stage {'-'.join(map(str, levels['replicas']))}")
        return "\n".join(lines)


def _ranks(ranks: List[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _on_nodes(stage: StagePlan) -> str:
    """``n0: 0-3, n1: 4-5``: the ranks of the stage on each machine node."""
    by_node: Dict[int, List[int]] = {}
    for rank, node in zip(stage.ranks, stage.rank_nodes):
        by_node.setdefault(node, []).append(rank)
    return ", ".join(f"n{node}: {_ranks(sorted(ranks))}" for node, ranks in sorted(by_node.items()))


def _rate(value: object) -> str:
    return f"{float(value) / 1e9:.3g} GB/s" if value is not None else "?"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def plan_from_result(result: PartitionResult, graph: CostGraph, batch_size: Optional[int] = None) -> Plan:
    """Build the Plan of a partition; ``batch_size`` defaults to the profile's ``info['batch_size']`` or 1."""
    opts: CostOptions = result.options
    stages = list(result.stages)  # evaluate's records, placed on the runtime's ranks (Layout, topology.py)
    batch = int(batch_size or graph.info.get("batch_size", 1) or 1)
    one = evaluate(graph, {n: 0 for n in graph.nodes}, [1], opts).bottleneck_s
    dp = data_parallel(graph, opts).bottleneck_s
    bottleneck = result.bottleneck_s
    return Plan(
        stages=stages, devices=opts.devices, batch_size=batch, bottleneck_s=bottleneck,
        samples_per_s=batch / bottleneck if bottleneck > 0 else float("inf"),
        speedup_vs_one=one / bottleneck if bottleneck > 0 else float("inf"),
        speedup_vs_dp=dp / bottleneck if bottleneck > 0 else float("inf"),
        options=opts.as_dict(), solver=result.solver_stats(),
    )
