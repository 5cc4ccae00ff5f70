"""Checks the split runs before cutting: the stage assignment and in-place writes.

``check_assignment`` turns the ``StageAssign`` records into a stage per node and
rejects assignments the split cannot honour, naming the node. ``plan_versions``
decides where a value that crosses a boundary must be copied because its own
stage writes into it in place after a later stage read it (in the original
order), and rejects the in-place patterns a pipeline cannot reproduce.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.fx

from passes import meta
from passes.errors import FxpipeError
from passes.values import COMPUTE_OPS, ValueRun


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


@dataclass
class Versions:
    """Which version of a sent value each reader needs, when its stage overwrites it.

    Version ``k`` of value ``v`` is its content after the first ``k`` in-place
    writes that ``v``'s own stage makes to it; ``None`` is the final content
    (what a send at the end of the stage carries). ``read``: (reader, value) ->
    version, only for readers that need an earlier one; ``copy_before``: writer
    -> [(value, k)] to copy right before that write; ``sends``: (value,
    consumer stage) -> versions to send.
    """

    read: Dict[Tuple[torch.fx.Node, torch.fx.Node], int] = field(default_factory=dict)
    copy_before: Dict[torch.fx.Node, List[Tuple[torch.fx.Node, int]]] = field(default_factory=dict)
    sends: Dict[Tuple[torch.fx.Node, int], List[Optional[int]]] = field(default_factory=dict)


def plan_versions(stage_of: Dict[torch.fx.Node, int], run: Optional[ValueRun]) -> Versions:
    """Find in-place writes to values that other stages read; plan the copies.

    In the original order a reader in another stage may read a value before its
    own stage overwrites it in place; the pipeline runs that stage to the end
    first, so the split copies the value right before the write and sends the
    copy. Writes that a pipeline cannot reproduce raise ``SplitError``: each
    stage holds its own copy of what it received (and of the model inputs), so
    only the stage that produced a value can write into it for others.
    """
    versions = Versions()
    if run is None:
        return versions
    writers: Dict[int, List[torch.fx.Node]] = defaultdict(list)
    for m, keys in run.writes.items():
        for k in keys:
            writers[k].append(m)
    for r, t in stage_of.items():
        for v in r.all_input_nodes:
            later = {m for key in run.keys.get(v, ()) for m in writers.get(key, ())
                     if m is not r and run.order[m] > run.order[v]}
            own = sorted((m for m in later if stage_of.get(m) == stage_of.get(v)), key=run.order.__getitem__)
            for m in later:
                _check_write(r, t, v, m, stage_of)
            if stage_of.get(v, t) != t:
                _plan_read(r, t, v, own, run, versions)
    return versions


def _check_write(r: torch.fx.Node, t: int, v: torch.fx.Node, m: torch.fx.Node,
                 stage_of: Dict[torch.fx.Node, int]) -> None:
    s_m = stage_of.get(m)
    if s_m == t or s_m == stage_of.get(v):
        return  # a stage keeps the original order among its own nodes; own-stage writes are versioned
    raise SplitError(f"split: in-place op '{m.name}' (stage {s_m}) writes into '{v.name}', which '{r.name}' "
                     f"(stage {t}) also reads; stages hold separate copies, so assign '{m.name}' and "
                     f"'{r.name}' to the same stage, or make '{m.name}' out-of-place")


def _plan_read(r: torch.fx.Node, t: int, v: torch.fx.Node, own: List[torch.fx.Node], run: ValueRun,
               versions: Versions) -> None:
    k = sum(1 for m in own if run.order[m] < run.order[r])
    version: Optional[int] = None if k == len(own) else k
    if version is not None:
        versions.read[(r, v)] = version
        pairs = versions.copy_before.setdefault(own[k], [])
        if (v, k) not in pairs:
            pairs.append((v, k))
    wanted = versions.sends.setdefault((v, t), [])
    if version not in wanted:
        wanted.append(version)
