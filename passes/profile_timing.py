"""Timing one graph node in isolation: forward and measured backward.

A node is run on fresh copies of the inputs it saw in the recorded run:
inputs that required grad there become new autograd leaves here, so the
backward we time is exactly this node's share of the model's backward (the
gradient of its outputs with respect to its tensor inputs and its parameters),
never a multiple of forward. In-place nodes (``nn.ReLU(inplace=True)``,
``x.add_``, ``aten.relu_``) get cloned inputs so the recorded values stay
intact and autograd does not reject an in-place write into a leaf.

Clocks: on CUDA, CUDA events around the call after warm-up (the GPU runs
asynchronously, a host clock would time the launch), except for nodes that
launch no kernel (``launches_no_kernel``: shape reads, integer arithmetic on
sizes), which run on the host alone: an event pair around them measures the
pair's own floor (4.6-8.3 us per shape read on an H100, against 0.3-0.8 us of
Python on a CPU), so they get the host clock (``Clock.host``). On CPU, a monotonic
clock: the CPU time of the calling thread (``time.thread_time``) when torch
runs one intra-op thread, else wall time (``time.perf_counter``). Why thread
time: on a machine shared with other jobs, wall time counts the time the
scheduler gave to others, and it hurts long calls more than short ones (the
whole model more than one node), while thread time stays what a quiet machine
measures (numbers in the README, ``fxpipe profile``). With several threads, thread time would miss the work of the others, so wall
time it is. The median of ``repeats`` is kept.

Each ``torch.autograd.grad`` call has a fixed cost (starting the engine) that
a node does not pay inside the model's one backward pass; summed over a few
hundred small nodes it is as large as the model's whole backward.
``grad_call_overhead`` measures that cost once, on a one-element
multiplication, and it is subtracted from every node's backward, keeping at
least a tenth of the raw measurement (the estimate is itself noisy, and a node
with parameters does have a backward).
"""
from __future__ import annotations

import operator
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree


@dataclass
class Timing:
    fwd_s: float
    bwd_s: float
    peak_mem_bytes: Optional[int]


class Clock:
    """Times a callable on one device; returns (seconds, result)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.cpu_time = not self.cuda and torch.get_num_threads() == 1
        self.name = "cuda events" if self.cuda else ("thread CPU time" if self.cpu_time else "wall time")
        if self.cuda:
            self.name += " (host clock for nodes that launch no kernel)"

    def host(self) -> "Clock":
        """The host-side clock for work that never reaches the device (``launches_no_kernel``)."""
        if not self.cuda:
            return self
        host = Clock(torch.device("cpu"))
        host.cpu_time, host.name = False, "wall time"  # the process may run several threads on a GPU host
        return host

    def __call__(self, fn: Callable[[], Any]) -> Tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3, out
        now = time.thread_time if self.cpu_time else time.perf_counter
        t0 = now()
        out = fn()
        return now() - t0, out


# reads of a tensor's metadata: answered from the tensor's header on the host, never by a kernel
TENSOR_METADATA = frozenset({"shape", "dtype", "device", "ndim", "layout", "is_cuda", "requires_grad",
                             "is_sparse", "is_quantized", "is_leaf"})
METADATA_METHODS = frozenset({"size", "dim", "numel", "nelement", "stride", "element_size", "get_device",
                              "is_contiguous", "storage_offset", "is_floating_point", "is_complex"})


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value))


def launches_no_kernel(node: torch.fx.Node, env: Dict[torch.fx.Node, Any]) -> bool:
    """Whether ``node`` runs on the host alone: its result holds no tensor, and it reads no tensor's
    data (it takes no tensor, or reads only a tensor's metadata: ``x.shape``, ``x.size(1)``,
    export's ``aten.sym_size``). Such nodes (a transformer's shape arithmetic) cost a few hundred
    nanoseconds of Python; ``x.item()``, ``x.tolist()`` and ``x[i] = y`` read or write a tensor's
    data, so they are not among them."""
    if node.op not in ("call_function", "call_method") or _holds_tensor(env.get(node)):
        return False
    inputs = [env[n] for n in node.all_input_nodes]
    if not any(_holds_tensor(v) for v in inputs):
        return node.target is not operator.setitem
    if node.op == "call_method":
        return str(node.target) in METADATA_METHODS
    if node.target is getattr:
        return len(node.args) >= 2 and node.args[1] in TENSOR_METADATA
    name = getattr(node.target, "name", None)
    return callable(name) and str(name()).startswith("aten::sym_")  # aten.sym_size.int, sym_numel, sym_stride


def clock_for(node: torch.fx.Node, env: Dict[torch.fx.Node, Any], clock: Clock) -> Clock:
    """``clock``, or its host clock where ``node`` launches no kernel (see the module docstring)."""
    return clock.host() if clock.cuda and launches_no_kernel(node, env) else clock


def node_callable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable[..., Any]:
    """What running ``node`` means, as a plain function of its evaluated args."""
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_function":
        return node.target  # type: ignore[return-value]
    if node.op == "call_method":
        name = str(node.target)
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    raise ValueError(f"node {node.name} ({node.op}) is not a computation")


def is_inplace(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).endswith("__")
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    name = getattr(node.target, "__name__", "")
    if node.target is operator.setitem or (name.endswith("_") and not name.endswith("__")):
        return True  # torch.relu_, x[i] = y
    return bool(node.kwargs.get("inplace", False))


def module_params(gm: torch.fx.GraphModule, node: torch.fx.Node) -> List[torch.Tensor]:
    if node.op != "call_module":
        return []
    return [p for p in gm.get_submodule(str(node.target)).parameters() if p.requires_grad]


def _fresh(value: Any, clone: bool, leaves: List[torch.Tensor]) -> Any:
    """A copy of a recorded value, detached from the recorded autograd graph."""

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, nn.Parameter):
            leaves.append(x) if x.requires_grad else None
            return x
        if x.requires_grad:
            leaf = x.detach().clone() if clone else x.detach()
            leaf.requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone() if clone else leaf  # in-place writes need a non-leaf
        return x.detach().clone() if clone else x.detach()

    return pytree.tree_map(one, value)


def grad_outputs_of(out: Any) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The differentiable outputs of a node and a gradient (of ones) for each."""
    outs = [
        t for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]
    return outs, [torch.ones_like(t) for t in outs]


def time_node(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    env: Dict[torch.fx.Node, Any],
    clock: Clock,
    repeats: int,
    warmup: int,
    grad_overhead_s: float = 0.0,
) -> Timing:
    """Median forward and backward time of ``node`` on its recorded inputs (on ``clock``, or on its host
    clock where the node launches no kernel: ``clock_for``)."""
    fn = node_callable(gm, node)
    params = module_params(gm, node)
    clock = clock_for(node, env, clock)
    try:
        return _time_node(fn, node, env, clock, repeats, warmup, grad_overhead_s, params, is_inplace(gm, node))
    except RuntimeError as exc:
        if "in-place" not in str(exc) and "inplace" not in str(exc):
            raise
        # an in-place write no rule above recognised: run it on copies
        return _time_node(fn, node, env, clock, repeats, warmup, grad_overhead_s, params, True)


def _time_node(fn: Callable[..., Any], node: torch.fx.Node, env: Dict[torch.fx.Node, Any], clock: Clock,
               repeats: int, warmup: int, grad_overhead_s: float, params: List[torch.Tensor], clone: bool) -> Timing:
    def prepare() -> Tuple[Callable[[], Any], List[torch.Tensor]]:
        leaves: List[torch.Tensor] = []
        fresh = {n: _fresh(env[n], clone, leaves) for n in node.all_input_nodes}
        args = torch.fx.node.map_arg(node.args, lambda n: fresh[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: fresh[n])
        return (lambda: fn(*args, **kwargs)), leaves + params

    return measure(clock, prepare, repeats, warmup, grad_overhead_s)


def grad_call_overhead(clock: Clock, repeats: int = 25) -> float:
    """Median time of ``autograd.grad`` through one scalar multiplication."""
    device = torch.device("cuda") if clock.cuda else torch.device("cpu")
    x = torch.ones(1, device=device, requires_grad=True)
    g = torch.ones(1, device=device)
    times = []
    for _ in range(repeats + 3):
        y = x * 1.0
        t, _ = clock(lambda: torch.autograd.grad(y, [x], [g]))
        times.append(t)
    return statistics.median(times[3:])


def measure(
    clock: Clock,
    prepare: Callable[[], Tuple[Callable[[], Any], List[torch.Tensor]]],
    repeats: int,
    warmup: int,
    grad_overhead_s: float = 0.0,
) -> Timing:
    """Median time of a forward call and of the gradient of its outputs.

    ``prepare`` returns, fresh for each repetition, the forward call and the
    tensors to differentiate with respect to (untimed). On CUDA the peak memory
    above what was allocated before is taken on the first measured repetition.
    """
    fwd: List[float] = []
    bwd: List[float] = []
    peak: Optional[int] = None
    for rep in range(warmup + repeats):
        call, wrt = prepare()
        wrt = _unique(wrt)
        measure_mem = clock.cuda and rep == warmup
        if measure_mem:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        f_s, out = clock(call)
        if measure_mem:
            peak = max(torch.cuda.max_memory_allocated() - base, 0)
        outs, grads = grad_outputs_of(out)
        b_s = 0.0
        if outs and wrt:
            b_s, _ = clock(lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True))
            b_s = max(b_s - grad_overhead_s, 0.1 * b_s)
        if rep >= warmup:
            fwd.append(f_s)
            bwd.append(b_s)
        del out, outs, grads
    return Timing(statistics.median(fwd), statistics.median(bwd), peak)


def _unique(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    seen = set()
    out = []
    for t in tensors:
        if id(t) not in seen and t.requires_grad:
            seen.add(id(t))
            out.append(t)
    return out
