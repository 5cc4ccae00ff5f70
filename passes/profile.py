"""Profile a captured graph: measured cost of every node, and the CostGraph the partitioner reads.

``profile(gm, example_inputs)`` first runs the whole graph once
(``passes.values.ValueRecorder``, which keeps every node's value), writing
``meta.ValueMeta`` on every node. Then every computing node is timed
in isolation on those recorded inputs (``passes.profile_timing``), forward
and backward, and gets a ``meta.NodeCost``. The whole model's forward and
backward are timed the same way (same clock, median of ``repeats``) and kept
in ``meta.ProfileInfo``, so a user can see how far the sum of the parts is
from the whole.

Parameters: a ``call_module`` node uses its
module's parameters; any node uses the parameters that reach it through
``get_attr`` nodes (export graphs, and attributes used directly in
``forward``). A parameter is named by its first name in
``gm.named_parameters()`` (so a tied weight has one name), is owned by its
first user in graph order (``param_bytes``), and every user lists it in
``params``; users of a parameter used by more than one node also list it in
``shared_params``. ``get_attr`` nodes cost nothing themselves.

Both symbolic-trace graphs and export graphs (ATen-level, parameters as
``get_attr``) profile the same way. Buffers such as BatchNorm running stats are
restored afterwards: profiling must not change the model.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree

from passes import meta
from passes.capture_check import restore_buffers, save_buffers
from passes.costgraph import CostGraph, CostNode
from passes.device_move import home_device, to_device
from passes.errors import FxpipeError
from passes.profile_timing import Clock, grad_call_overhead, measure, time_node
from passes.values import COMPUTE_OPS, ValueRecorder, node_failed, value_bytes

__all__ = ["profile", "to_cost_graph", "ProfileError"]

ProgressFn = Callable[..., None]
_PRECISION = {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # ProfileInfo's


class ProfileError(FxpipeError):
    """The graph cannot be profiled as asked (device missing, a node fails)."""


def profile(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    progress: Optional[ProgressFn] = None,
    autocast_dtype: Optional[torch.dtype] = None,
) -> torch.fx.GraphModule:
    """Measure every node of ``gm`` on ``example_inputs`` (one microbatch); returns ``gm``.

    ``progress``, if given, is called as ``progress(1, note=node_name)`` once per
    computing node (``passes.progress.Progress`` fits). ``autocast_dtype``
    (``torch.bfloat16``, ``torch.float16``): run and time everything under
    ``torch.autocast`` to that dtype, as mixed-precision training runs it, so
    the recorded values (``ValueMeta``: what crosses a cut, its bytes) and
    the times are the low-precision ones. Parameters stay as they are, and
    where they are: ``gm`` (which shares them with the model it was captured
    from) is moved to ``device`` to be measured and back afterwards, so
    profiling a CPU model on a GPU leaves it on the CPU, next to its inputs.
    """
    dev = _device(device)
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"profile: repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    home = _placement(gm)
    was = home_device(gm)
    to_device(gm, dev, was)  # export graphs name their capture device in constants: those move too
    try:
        inputs = tuple(pytree.tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x,
                                       tuple(example_inputs)))
        _train_mode(gm)
        clock = Clock(dev)
        saved = save_buffers(gm)
        try:
            with _autocast(dev, autocast_dtype):
                env, fwd_s, bwd_s = _measure_all(gm, inputs, clock, repeats, warmup, progress)
        finally:
            restore_buffers(saved)
    finally:
        _move_back(home)
        if was is not None:
            to_device(gm, was, home=dev)
    _write_param_costs(gm, env)
    meta.put(gm, meta.ProfileInfo(
        device=str(dev), repeats=repeats, batch_size=_batch_size(inputs),
        torch_version=torch.__version__, whole_fwd_s=fwd_s, whole_bwd_s=bwd_s, clock=clock.name,
        precision=_PRECISION.get(autocast_dtype, str(autocast_dtype)),
    ))
    return gm


def _placement(gm: torch.fx.GraphModule) -> List[Tuple[torch.nn.Module, str, str, torch.device]]:
    """Where every parameter and buffer of ``gm`` lives: (module, "_parameters" or "_buffers", name, device)."""
    return [(m, kind, name, t.device) for m in gm.modules() for kind in ("_parameters", "_buffers")
            for name, t in getattr(m, kind).items() if t is not None]


def _move_back(placement: List[Tuple[torch.nn.Module, str, str, torch.device]]) -> None:
    """Each tensor back where ``_placement`` found it (a parameter keeps its object: tied ones stay tied)."""
    for module, kind, name, dev in placement:
        t = getattr(module, kind)[name]
        if t.device == dev:
            continue
        if kind == "_parameters":
            t.data = t.data.to(dev)
            if t.grad is not None:
                t.grad = t.grad.to(dev)
        else:
            module._buffers[name] = t.to(dev)


def _autocast(dev: torch.device, dtype: Optional[torch.dtype]) -> Any:
    if dtype is None:
        return contextlib.nullcontext()
    if dtype not in (torch.bfloat16, torch.float16):
        raise ProfileError(f"profile: autocast dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    return torch.autocast(device_type=dev.type, dtype=dtype)


def _measure_all(gm: torch.fx.GraphModule, inputs: Sequence[Any], clock: Clock, repeats: int, warmup: int,
                 progress: Optional[ProgressFn]) -> Tuple[Dict[torch.fx.Node, Any], float, float]:
    """Record every value, time every node, then the whole model: (values, whole fwd s, whole bwd s)."""
    env = _record_values(gm, inputs)
    overhead = grad_call_overhead(clock)
    _time_nodes(gm, env, clock, repeats, warmup, progress, overhead)
    fwd_s, bwd_s = _time_whole(gm, inputs, clock, repeats, warmup, overhead)
    return env, fwd_s, bwd_s


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ProfileError(f"profile: unknown device {device!r} (use 'cpu' or 'cuda')") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("profile: --device cuda was asked for, but this torch build sees no CUDA device; use --device cpu")
    return dev


def _train_mode(gm: torch.fx.GraphModule) -> None:
    """Profile as training runs. Export graphs are fixed in the mode they were captured in."""
    if not gm.training:
        try:
            gm.train()
        except Exception as exc:  # noqa: BLE001 - torch.export modules refuse mode changes
            raise ProfileError("profile: this exported graph was captured in eval mode; capture it in training mode") from exc


def _batch_size(inputs: Sequence[Any]) -> Optional[int]:
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


# ------------------------------------------------------------ values


def _record_values(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> Dict[torch.fx.Node, Any]:
    recorder = ValueRecorder(gm, lambda n, exc: ProfileError(node_failed("profile", n, exc)))
    recorder.run(*inputs)
    return recorder.env


# ------------------------------------------------------------ timing


def _time_nodes(gm: torch.fx.GraphModule, env: Dict[torch.fx.Node, Any], clock: Clock,
                repeats: int, warmup: int, progress: Optional[ProgressFn], overhead: float) -> None:
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        try:
            t = time_node(gm, node, env, clock, repeats, warmup, overhead)
        except Exception as exc:
            raise ProfileError(
                f"profile: timing node '{node.name}' ({node.op} {node.target}) in isolation failed: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc
        meta.put(node, meta.NodeCost(fwd_s=t.fwd_s, bwd_s=t.bwd_s, out_bytes=value_bytes(env[node]),
                                     param_bytes=0, peak_mem_bytes=t.peak_mem_bytes))
        if progress is not None:
            progress(1, note=node.name)


def _time_whole(gm: torch.fx.GraphModule, inputs: Sequence[Any], clock: Clock,
                repeats: int, warmup: int, overhead: float) -> Tuple[float, float]:
    """Whole-model forward and backward, measured like a node (for comparison)."""
    params = [p for p in gm.parameters() if p.requires_grad]
    t = measure(clock, lambda: ((lambda: gm(*inputs)), params), repeats, warmup, overhead)
    return t.fwd_s, t.bwd_s


# ------------------------------------------------------------ parameters


def param_names(gm: torch.fx.GraphModule) -> Dict[int, str]:
    """Tensor id -> its one name (the first in ``named_parameters``), tied weights included."""
    return {id(p): name for name, p in gm.named_parameters()}


def _params_used(gm: torch.fx.GraphModule, node: torch.fx.Node, env: Dict[torch.fx.Node, Any],
                 names: Dict[int, str]) -> List[str]:
    used: List[str] = []
    if node.op == "call_module":
        used += [names[id(p)] for p in gm.get_submodule(str(node.target)).parameters() if id(p) in names]
    for inp in node.all_input_nodes:
        if inp.op == "get_attr":
            for leaf in pytree.tree_leaves(env.get(inp)):
                if isinstance(leaf, torch.nn.Parameter) and id(leaf) in names:
                    used.append(names[id(leaf)])
    return list(dict.fromkeys(used))


def _write_param_costs(gm: torch.fx.GraphModule, env: Dict[torch.fx.Node, Any]) -> None:
    names = param_names(gm)
    sizes = {name: p.numel() * p.element_size() for name, p in gm.named_parameters()}
    used = {n: _params_used(gm, n, env, names) for n in gm.graph.nodes if n.op in COMPUTE_OPS}
    users: Dict[str, int] = {}
    for plist in used.values():
        for p in plist:
            users[p] = users.get(p, 0) + 1
    owned: set = set()
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            plist = used[node]
            mine = [p for p in plist if p not in owned]
            owned.update(mine)
            cost = meta.get(node, meta.NodeCost)
            meta.put(node, meta.NodeCost(
                fwd_s=cost.fwd_s, bwd_s=cost.bwd_s, out_bytes=cost.out_bytes,
                param_bytes=sum(sizes[p] for p in mine), params=tuple(plist),
                shared_params=tuple(p for p in plist if users[p] > 1), peak_mem_bytes=cost.peak_mem_bytes,
            ))
        elif node.op in ("placeholder", "get_attr", "output"):
            out_bytes = value_bytes(env[node]) if node.op != "output" else 0
            meta.put(node, meta.NodeCost(fwd_s=0.0, bwd_s=0.0, out_bytes=out_bytes, param_bytes=0))


# ------------------------------------------------------------ CostGraph


def _target_name(node: torch.fx.Node) -> str:
    if node.op in ("call_module", "call_method", "placeholder", "get_attr", "output"):
        return str(node.target)
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or str(target)
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    return f"{module}.{name}" if module and not module.startswith("torch._C") else f"torch.{name}"


def to_cost_graph(gm: torch.fx.GraphModule, calibrate: bool = True) -> CostGraph:
    """The profiled graph as plain data (the ``fxpipe-profile/1`` format, see ``CostGraph.save``).

    ``calibrate``: scale every node's forward (backward) time so that they
    sum to the whole model's measured forward (backward). Nodes timed one by
    one miss what only the whole run pays (the autograd engine walking the
    graph, gradient accumulation, per-call dispatch between nodes), so the
    parts sum to less than the whole and a plan built on them predicts too
    fast a pipeline (docs/results.md, "Predicted against measured"). The factors go to
    ``info["calibration"]``; the node meta on ``gm`` keeps the raw timings.
    """
    meta.require(gm, meta.NodeCost, needed_by="to_cost_graph", made_by="passes.profile.profile")
    nodes: Dict[str, CostNode] = {}
    edges: List[tuple] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        nodes[node.name] = _cost_node(node)
        for user in node.users:
            if user.op != "get_attr":
                edges.append((node.name, user.name))
    info: Dict[str, object] = {}
    if meta.has(gm, meta.ProfileInfo):
        p = meta.get(gm, meta.ProfileInfo)
        info.update(device=p.device, repeats=p.repeats, batch_size=p.batch_size, torch_version=p.torch_version,
                    whole_fwd_s=p.whole_fwd_s, whole_bwd_s=p.whole_bwd_s, clock=p.clock, precision=p.precision)
    if meta.has(gm, meta.CaptureInfo):
        info["capture_method"] = meta.get(gm, meta.CaptureInfo).method
    sizes = {name: p.numel() * p.element_size() for name, p in gm.named_parameters()}
    if calibrate and info.get("whole_fwd_s"):
        nodes, info["calibration"] = _calibrated(nodes, float(info["whole_fwd_s"]), float(info["whole_bwd_s"]))
    graph = CostGraph(nodes=nodes, edges=list(dict.fromkeys(edges)), info=info, param_sizes=sizes)
    graph.check()
    return graph


def _calibrated(nodes: Dict[str, CostNode], whole_fwd_s: float,
                whole_bwd_s: float) -> Tuple[Dict[str, CostNode], Dict[str, float]]:
    """``nodes`` with times scaled to sum to the whole model's, and the two factors."""
    sum_f = sum(n.fwd_s for n in nodes.values())
    sum_b = sum(n.bwd_s for n in nodes.values())
    kf = whole_fwd_s / sum_f if sum_f > 0 and whole_fwd_s > 0 else 1.0
    kb = whole_bwd_s / sum_b if sum_b > 0 and whole_bwd_s > 0 else 1.0
    out = {name: dataclasses.replace(n, fwd_s=n.fwd_s * kf, bwd_s=n.bwd_s * kb) for name, n in nodes.items()}
    return out, {"fwd": kf, "bwd": kb}


def _cost_node(node: torch.fx.Node) -> CostNode:
    path = meta.get(node, meta.ModuleInfo).path if meta.has(node, meta.ModuleInfo) else ""
    if node.op in ("placeholder", "output"):
        out_bytes = meta.get(node, meta.NodeCost).out_bytes if meta.has(node, meta.NodeCost) else 0
        return CostNode(name=node.name, op=node.op, target=str(node.target), fwd_s=0.0, bwd_s=0.0,
                        out_bytes=out_bytes, param_bytes=0, module_path=path, is_input=node.op == "placeholder")
    c = meta.get(node, meta.NodeCost)
    return CostNode(name=node.name, op=node.op, target=_target_name(node), fwd_s=c.fwd_s, bwd_s=c.bwd_s,
                    out_bytes=c.out_bytes, param_bytes=c.param_bytes, module_path=path,
                    params=c.params, peak_mem_bytes=c.peak_mem_bytes)
