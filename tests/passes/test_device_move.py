"""passes.device_move: an export graph's device constants move with its parameters.

CPU-only checks of the rewrite ("meta" stands in for a GPU: moving there
needs no hardware). That a moved graph really runs on a GPU, where a stale
``device=cpu`` constant fails the first kernel, is in tests/fxpipe/test_cuda.py.
"""
from __future__ import annotations

from typing import List

import torch
import torch.fx
import torch.nn as nn

from passes.capture import capture
from passes.device_move import home_device, to_device
from tests.models import PosNet


def _devices(gm: torch.fx.GraphModule) -> List[torch.device]:
    return [v for n in gm.graph.nodes for v in list(n.args) + list(n.kwargs.values())
            if isinstance(v, torch.device)]


def _exported() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return capture(PosNet(), (torch.randn(4, 6),), method="export")


def test_export_graph_names_its_capture_device_and_to_device_moves_it() -> None:
    gm = _exported()
    assert _devices(gm) and all(d.type == "cpu" for d in _devices(gm))  # what the pass exists for
    to_device(gm, "meta")
    assert home_device(gm) == torch.device("meta")
    assert _devices(gm) and all(d.type == "meta" for d in _devices(gm))
    assert "meta" in gm.code  # recompiled: the generated forward uses the new constants
    assert gm(torch.randn(4, 6, device="meta")).device.type == "meta"


def test_moving_to_where_it_is_changes_nothing() -> None:
    gm = _exported()
    x = torch.randn(4, 6)
    want, code = gm(x), gm.code
    to_device(gm, "cpu")
    assert gm.code == code
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)


def test_plain_module_to_leaves_the_constants_behind() -> None:
    """Why ``to_device`` exists: ``nn.Module.to`` moves parameters, not the graph's code."""
    gm = _exported()
    gm.to("meta")
    assert all(d.type == "cpu" for d in _devices(gm))


def test_a_constant_naming_another_device_stays_as_written() -> None:
    """Only constants naming the parameters' device move; a model may keep some work elsewhere on purpose."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    here = g.call_function(torch.zeros, (2,), {"device": torch.device("cpu")})
    there = g.call_function(torch.zeros, (2,), {"device": torch.device("cuda", 1)})  # never run
    g.output((g.call_function(torch.add, (x, here)), there, g.get_attr("w")))
    holder = nn.Module()
    holder.w = nn.Parameter(torch.zeros(1))
    gm = torch.fx.GraphModule(holder, g)
    to_device(gm, "meta")
    assert here.kwargs["device"] == torch.device("meta")
    assert there.kwargs["device"] == torch.device("cuda", 1)


def test_without_parameters_constants_move_only_when_the_home_is_given() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ramp = g.call_function(torch.arange, (6,), {"device": torch.device("cpu")})
    g.output(g.call_function(torch.add, (x, ramp)))
    gm = torch.fx.GraphModule(nn.Module(), g)
    assert home_device(gm) is None
    to_device(gm, "meta")
    assert ramp.kwargs["device"] == torch.device("cpu")
    to_device(gm, "meta", home=torch.device("cpu"))
    assert ramp.kwargs["device"] == torch.device("meta")
