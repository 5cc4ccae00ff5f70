"""What the split needs to know about values: their shapes, and in-place writes.

``record_values`` runs the graph once on the example inputs with
``passes.values.ValueRecorder`` (the profiler's recorder too), which writes
``meta.ValueMeta`` on every node and finds which node wrote into which storage.
Running the graph instead of reading op schemas: symbolic_trace graphs call
modules and methods whose aliasing no schema describes.

Without example inputs, shapes come from what capture left on the nodes
(``ValueMeta``, export's fake ``val``, or ``tensor_meta``) and no write analysis
is done.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from passes import meta
from passes.capture_check import restore_buffers, save_buffers
from passes.errors import FxpipeError
from passes.values import ValueRecorder, ValueRun, node_failed, value_spec


class ShapePropError(FxpipeError):
    """The graph failed on the example inputs, or a node has no shape record."""


def record_values(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> ValueRun:
    """Run ``gm`` on ``example_inputs``; write ``ValueMeta`` on every node."""
    recorder = ValueRecorder(gm, lambda n, exc: ShapePropError(node_failed("split", n, exc)))
    saved = save_buffers(gm)  # BatchNorm running stats: this run must not change the model
    try:
        with torch.enable_grad():
            recorder.run(*example_inputs)
    finally:
        restore_buffers(saved)
    return recorder.run_info


def ensure_value_meta(gm: torch.fx.GraphModule) -> None:
    """Fill ``ValueMeta`` from capture's records; name the first node without any."""
    for n in gm.graph.nodes:
        if n.op == "output" or meta.has(n, meta.ValueMeta):
            continue
        if "val" in n.meta:
            meta.put(n, meta.ValueMeta(value_spec(n.meta["val"])))  # fake tensors read like real ones
        elif "tensor_meta" in n.meta and hasattr(n.meta["tensor_meta"], "shape"):
            tm = n.meta["tensor_meta"]
            meta.put(n, meta.ValueMeta(meta.TensorMeta(tuple(tm.shape), str(tm.dtype), bool(tm.requires_grad))))
        elif n.op not in ("get_attr", "placeholder") and n.users:
            raise ShapePropError(f"split: node '{n.name}' has no shape record: pass example_inputs to "
                                 "split_stages(...) (or run passes.profile first)")
