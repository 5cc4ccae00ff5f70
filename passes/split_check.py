"""Checks the split runs before cutting: the stage assignment and in-place writes.

``check_assignment`` turns the ``StageAssign`` records into a stage per node and
rejects assignments the split cannot honour, naming the node. ``plan_snapshots``
decides where a value that crosses a boundary must be copied because its own
stage writes into it in place after a later stage read it (in the original
order), and rejects the in-place patterns a pipeline cannot reproduce.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch.fx

from passes import meta
from passes.errors import FxpipeError
from passes.split_values import ValueRun

COMPUTE_OPS = ("call_function", "call_method", "call_module")


class SplitError(FxpipeError):
    """The stage assignment or the graph cannot be split as asked."""


def is_dropped(node: torch.fx.Node) -> bool:
    """Nodes the split leaves out: torch.export's input guard module.

    ``_guards_fn`` only re-checks input shapes captured by export; it has no
    users and would make stage 0 take every model input.
    """
    return node.op == "call_module" and node.target == "_guards_fn"


def check_assignment(gm: torch.fx.GraphModule) -> Tuple[Dict[torch.fx.Node, int], int]:
    """Stage of every compute node (and of the output: the last), and the count."""
    stage_of: Dict[torch.fx.Node, int] = {}
    missing = []
    for n in gm.graph.nodes:
        if n.op not in COMPUTE_OPS or is_dropped(n):
            continue
        rec = meta.get(n, meta.StageAssign, None)
        if rec is None:
            missing.append(n.name)
            continue
        if not isinstance(rec.stage, int) or rec.stage < 0:
            raise SplitError(f"split: node '{n.name}' has stage {rec.stage!r}; stages are integers from 0")
        stage_of[n] = rec.stage
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise SplitError(f"split: {len(missing)} nodes have no stage assignment ({shown}): run "
                         "passes.partition.apply_assignment(gm, plan) or meta.put(node, StageAssign(k)) on each")
    if not stage_of:
        raise SplitError("split: the graph has no computation to split")
    count = max(stage_of.values()) + 1
    empty = sorted(set(range(count)) - set(stage_of.values()))
    if empty:
        raise SplitError(f"split: stage {empty[0]} has no node (stages used: {sorted(set(stage_of.values()))}); "
                         "number stages 0..K-1 without gaps")
    for n, s in stage_of.items():
        for u in n.all_input_nodes:
            if u in stage_of and stage_of[u] > s:
                raise SplitError(f"split: node '{n.name}' (stage {s}) uses '{u.name}' from later stage "
                                 f"{stage_of[u]}: a pipeline only sends forward; move '{u.name}' to stage "
                                 f"≤ {s} or '{n.name}' to stage ≥ {stage_of[u]}")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    stage_of[out] = count - 1
    return stage_of, count


def first_reads(stage_of: Dict[torch.fx.Node, int], order: Dict[torch.fx.Node, int]
                ) -> Dict[Tuple[torch.fx.Node, int], int]:
    """(value, consumer stage) -> position of that stage's first reader of it."""
    first: Dict[Tuple[torch.fx.Node, int], int] = {}
    for r, t in stage_of.items():
        for v in r.all_input_nodes:
            if v in stage_of and stage_of[v] != t:
                key = (v, t)
                first[key] = min(first.get(key, order[r]), order[r])
    return first


def _writes_in_stage(run: ValueRun, stage_of: Dict[torch.fx.Node, int]) -> Dict[int, List[torch.fx.Node]]:
    by_key: Dict[int, List[torch.fx.Node]] = defaultdict(list)
    for m, keys in run.writes.items():
        for k in keys:
            by_key[k].append(m)
    return by_key


def plan_snapshots(stage_of: Dict[torch.fx.Node, int], run: Optional[ValueRun]
                   ) -> Dict[torch.fx.Node, List[Tuple[torch.fx.Node, int]]]:
    """Where to copy a sent value before its own stage overwrites it.

    Returns ``writer -> [(value, consumer stage)]``: insert a copy of ``value``
    right before ``writer`` and send the copy to that stage. Raises when a
    write would be seen by a stage that, in the original order, must not see it
    (or must and cannot): in a pipeline each stage holds its own copy of what it
    received, so only the stage that produced a value can write into it for
    others.
    """
    if run is None:
        return {}
    writers = _writes_in_stage(run, stage_of)
    first = first_reads(stage_of, run.order)
    snapshots: Dict[torch.fx.Node, List[Tuple[torch.fx.Node, int]]] = defaultdict(list)
    for r, t in stage_of.items():
        for v in r.all_input_nodes:
            for key in run.keys.get(v, ()):
                for m in writers.get(key, ()):
                    _check_one_read(r, t, v, m, stage_of, run, first, snapshots)
    earliest: Dict[Tuple[torch.fx.Node, int], torch.fx.Node] = {}
    for m in sorted(snapshots, key=run.order.__getitem__):
        for pair in snapshots[m]:
            earliest.setdefault(pair, m)
    result: Dict[torch.fx.Node, List[Tuple[torch.fx.Node, int]]] = defaultdict(list)
    for pair, m in earliest.items():
        result[m].append(pair)
    return dict(result)


def _check_one_read(r: torch.fx.Node, t: int, v: torch.fx.Node, m: torch.fx.Node,
                    stage_of: Dict[torch.fx.Node, int], run: ValueRun,
                    first: Dict[Tuple[torch.fx.Node, int], int],
                    snapshots: Dict[torch.fx.Node, List[Tuple[torch.fx.Node, int]]]) -> None:
    order, s_m = run.order, stage_of.get(m)
    if r is m or s_m == t or order[v] >= order[m]:
        return  # same stage keeps the original order; a value made after the write includes it
    if stage_of.get(v) == s_m:
        read_at = first[(v, t)]
        if order[m] < read_at:
            return  # written before any reader in stage t: the send at the end carries it
        if order[r] > order[m]:
            raise SplitError(f"split: stage {t} reads '{v.name}' both before and after the in-place op "
                             f"'{m.name}' of stage {s_m} overwrites it; make '{m.name}' out-of-place or put "
                             f"'{r.name}' in stage {s_m}")
        if (v, t) not in snapshots[m]:
            snapshots[m].append((v, t))
        return
    raise SplitError(f"split: in-place op '{m.name}' (stage {s_m}) writes into '{v.name}', which '{r.name}' "
                     f"(stage {t}) also reads; stages hold separate copies, so assign '{m.name}' and "
                     f"'{r.name}' to the same stage, or make '{m.name}' out-of-place")
