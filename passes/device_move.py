"""Move a captured graph to another device, the constants in its code included.

``torch.export`` specialises a graph to the device it was captured on: a
``torch.arange(n, device=x.device)`` in the model becomes
``aten.arange(n, device=cpu)`` in the graph, and so do ``.to`` casts and
``_assert_tensor_metadata`` checks. ``module.to("cuda")`` moves the
parameters but not those constants, so the first such node feeds a CPU
tensor to a CUDA kernel and fails. (Symbolic tracing keeps ``x.device`` as
a node and has no such constants.) ``to_device`` moves both: every
``torch.device`` constant in a node's arguments that names the device the
graph's parameters were on is rewritten to the target. A constant naming
another device (a model that deliberately keeps a tensor on the CPU while it
runs on a GPU) is left as the model wrote it.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.fx
import torch.nn as nn

__all__ = ["to_device", "home_device"]


def home_device(module: nn.Module) -> Optional[torch.device]:
    """The one device ``module``'s parameters and buffers are on; None if it has none or several."""
    devices = {t.device for t in list(module.parameters()) + list(module.buffers())}
    return devices.pop() if len(devices) == 1 else None


def to_device(module: nn.Module, device: Union[str, torch.device],
              home: Optional[torch.device] = None) -> nn.Module:
    """``module.to(device)``, and in every GraphModule inside it each device constant equal to ``home``
    (default: where its parameters are now) rewritten to ``device``. Returns ``module``.

    A module with no parameters and no ``home`` has nothing to say where it was captured: its constants
    stay (pass ``home`` to move them).
    """
    target = torch.device(device)
    home = home if home is not None else home_device(module)
    module.to(target)
    if home is None or _same(home, target):
        return module
    for gm in module.modules():
        if isinstance(gm, torch.fx.GraphModule) and _retarget(gm.graph, home, target):
            gm.recompile()
    return module


def _same(a: torch.device, b: torch.device) -> bool:
    """Equal devices, "cuda" and "cuda:0" alike (on the current device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _retarget(graph: torch.fx.Graph, home: torch.device, target: torch.device) -> int:
    """Rewrite the device constants of ``graph`` equal to ``home`` to ``target``; how many nodes changed."""
    changed = 0
    hit = False

    def swap(arg: Any) -> Any:
        nonlocal hit
        if isinstance(arg, torch.device) and _same(arg, home):
            hit = True
            return target
        return arg

    for node in graph.nodes:
        hit = False
        args = torch.fx.node.map_aggregate(node.args, swap)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
        if hit:
            node.args, node.kwargs = args, kwargs
            changed += 1
    return changed
