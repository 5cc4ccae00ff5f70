"""Profiling under autocast: the recorded values (and so the bytes a cut carries) are the low-precision ones."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from passes import meta
from passes.capture import capture
from passes.profile import ProfileError, profile


def _gm() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return capture(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(2, 8),))


def _linear_out(gm: torch.fx.GraphModule) -> meta.TensorMeta:
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) == "0")
    return meta.get(node, meta.ValueMeta).spec


def test_bf16_profile_records_bf16_values_and_half_the_bytes() -> None:
    plain, low = _gm(), _gm()
    profile(plain, (torch.randn(2, 8),), repeats=1, warmup=0)
    profile(low, (torch.randn(2, 8),), repeats=1, warmup=0, autocast_dtype=torch.bfloat16)
    assert _linear_out(plain).dtype == "torch.float32" and _linear_out(low).dtype == "torch.bfloat16"
    node = next(n for n in low.graph.nodes if n.op == "call_module" and str(n.target) == "0")
    plain_node = next(n for n in plain.graph.nodes if n.op == "call_module" and str(n.target) == "0")
    assert meta.get(node, meta.NodeCost).out_bytes * 2 == meta.get(plain_node, meta.NodeCost).out_bytes
    assert all(p.dtype == torch.float32 for p in low.parameters())  # weights are never cast


def test_other_autocast_dtype_is_refused() -> None:
    with pytest.raises(ProfileError, match="autocast dtype"):
        profile(_gm(), (torch.randn(2, 8),), repeats=1, warmup=0, autocast_dtype=torch.float64)
