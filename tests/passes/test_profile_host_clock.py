"""profile_timing: nodes that launch no kernel are timed on the host clock where the device clock is CUDA
events (an event pair around a shape read measures the pair's own floor, not the read)."""
import math
import operator
import runpy
from pathlib import Path

import torch
import torch.fx

from passes.capture import capture
from passes.profile_timing import Clock, clock_for, launches_no_kernel, time_node

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class ShapeArithmetic(torch.nn.Module):
    """The shape arithmetic of an attention layer, and the data reads that must stay on the device clock."""

    def forward(self, x):
        b, t, c = x.shape
        heads = c // 4
        scale = 1.0 / math.sqrt(heads)
        y = x.view(b, t, 4, heads) * scale
        n = x.size(-1) + x.dim()
        return y.sum() * x[0, 0, 0].item() + n


def _recorded(gm, *inputs):
    """Every node's value from one run (what ``passes.profile`` records before timing)."""
    env = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            env[n] = super().run_node(n)
            return env[n]

    Recorder(gm).run(*inputs)
    return env


def _by_kind(gm, env):
    host = {n.name for n in gm.graph.nodes if launches_no_kernel(n, env)}
    device = {n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")} - host
    return host, device


def test_shape_reads_run_on_the_host_and_data_reads_do_not():
    gm = torch.fx.symbolic_trace(ShapeArithmetic())
    env = _recorded(gm, torch.randn(2, 3, 8))
    host, device = _by_kind(gm, env)
    targets = {n.name: n.target for n in gm.graph.nodes}
    kinds = {targets[n] for n in host}
    assert {getattr, operator.getitem, operator.floordiv, math.sqrt, "size", "dim", operator.add} <= kinds
    # x.view, the multiplication, item, sum: each runs a kernel or reads a tensor's data
    assert {"view", "item", "sum", operator.mul} <= {targets[n] for n in device}
    assert not any(targets[n] == "item" for n in host)


def test_export_metadata_reads_run_on_the_host():
    """``aten.sym_size`` (what export makes of ``x.shape[i]`` under dynamic shapes) reads a header;
    ``x[i] = y`` returns nothing but writes a tensor's data, so it stays on the device clock."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    size = g.call_function(torch.ops.aten.sym_size.int, (x, 1))
    half = g.call_function(operator.floordiv, (size, 2))
    out = g.call_function(torch.ops.aten.narrow.default, (x, 1, 0, half))
    g.call_function(operator.setitem, (x, 0, 0.0))
    g.output(out)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    env = _recorded(gm, torch.randn(3, 8))
    host, device = _by_kind(gm, env)
    assert host == {"sym_size_int", "floordiv"} and device == {"narrow_default", "setitem"}


def test_gpt_example_shape_reads_are_the_host_nodes():
    """On examples/gpt.py the host nodes are its shape reads: values that hold no tensor, among them
    ``getattr(x, 'shape')``."""
    ns = runpy.run_path(str(EXAMPLES / "gpt.py"))
    inputs = ns["example_inputs"]
    gm = capture(ns["model"], inputs)
    env = _recorded(gm, *inputs)
    host, _ = _by_kind(gm, env)
    assert host and all(not isinstance(env[n], torch.Tensor) for n in gm.graph.nodes if n.name in host)
    assert any(n.target is getattr for n in gm.graph.nodes if n.name in host)


def test_cuda_clock_hands_host_nodes_to_the_host_clock():
    """A CUDA clock (built here without a GPU: building it touches no device) gives a shape read its host
    clock, which times without CUDA events, and keeps itself for a node that runs a kernel; the CPU
    clock is its own host clock. ``time_node`` on a shape read with the CUDA clock therefore runs on
    a machine without CUDA and measures a small positive time."""
    gm = torch.fx.symbolic_trace(ShapeArithmetic())
    env = _recorded(gm, torch.randn(2, 3, 8))
    nodes = {n.name: n for n in gm.graph.nodes}
    cuda, cpu = Clock(torch.device("cuda")), Clock(torch.device("cpu"))
    read = nodes["getattr_1"]
    assert launches_no_kernel(read, env)
    host = clock_for(read, env, cuda)
    assert host is not cuda and not host.cuda and host.name == "wall time"
    assert clock_for(nodes["view"], env, cuda) is cuda
    assert clock_for(read, env, cpu) is cpu and cpu.host() is cpu
    timed = time_node(gm, read, env, cuda, repeats=5, warmup=1)
    assert 0.0 < timed.fwd_s < 1e-3 and timed.bwd_s == 0.0 and timed.peak_mem_bytes is None
    assert "host clock" in cuda.name
