"""The split pass: the cut graphs, their comm nodes, and what they own.

Equivalence with the unsplit model is checked here through ``run_local`` (the
reference executor); ``tests/fxpipe/test_local.py`` covers more models and the
saved files.
"""
import pytest
import torch
import torch.nn as nn

from fxpipe.local import run_local
from passes import comm, meta
from passes.split import SplitError, split_stages
from tests.models import example
from tests.splitting import (assign_by_name, assign_even, capture, check_equivalent, compute_nodes,
                             split_model_of, stage_grads)


class InPlace(nn.Module):
    """``h`` is read by another stage, then overwritten in place by its own stage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = torch.tanh(h)
        h.mul_(2)
        return self.out(h) + y


class TupleCross(nn.Module):
    """A tuple of tensors (``chunk``) and a Python float cross a boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.lin(x).chunk(2, dim=1)
        scale = x.shape[1] ** 0.5
        return self.out(torch.cat([parts[0] * scale, torch.tanh(parts[1])], dim=1))


def _split(model, inputs, k, method="fx", assign=assign_even):
    sm, gm = split_model_of(model, inputs, method, k, assign)
    return sm, gm


def test_stage_code_shows_comm_calls_with_shapes():
    model, inputs = example("MLP")
    sm, _ = _split(model, inputs, 2)
    code0, code1 = sm.stages[0].code, sm.stages[1].code
    assert "passes_comm_send(" in code0 and "passes_comm_recv(" not in code0
    assert "passes_comm_recv(" in code1 and "shape = (8, 32)" in code1 and "dtype = torch.float32" in code1
    recvs = [n for n in sm.stages[1].graph.nodes if n.target is comm.recv]
    info = meta.get(recvs[0], meta.CommInfo)
    assert (info.direction, info.src_stage, info.dst_stage) == ("recv", 0, 1)
    assert info.value.spec.shape == (8, 32)
    assert [e.tag for e in sm.comm] == [info.tag]


def test_each_stage_owns_exactly_the_parameters_it_uses():
    model, inputs = example("MLP")
    sm, _ = _split(model, inputs, 3)
    seen = []
    for j, st in enumerate(sm.stages):
        used = {n.target for n in st.graph.nodes if n.op == "call_module"}
        names = set(sm.param_names[j].values())
        assert names == {f"{m}.{p}" for m in used for p in ("weight", "bias")}
        seen += list(names)
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tied_embedding_is_held_by_first_and_last_stage(method):
    model, inputs = example("TinyGPT")
    sm, _ = _split(model, inputs, 3, method)
    assert sm.tied == {"tok.weight": [0, 2]}
    check_equivalent(model, lambda *x: run_local(sm, *x), lambda: stage_grads(sm), inputs)


def test_skip_is_sent_directly_to_each_consumer_stage():
    model, inputs = example("SkipCNN")
    sm, _ = _split(model, inputs, 4)
    assert any(b - a >= 2 for a, b in sm.links), sm.links
    tags = [e.tag for e in sm.comm]
    assert len(tags) == len(set(tags))
    check_equivalent(model, lambda *x: run_local(sm, *x), lambda: stage_grads(sm), inputs)


def test_non_tensor_value_crosses_as_a_value():
    model, inputs = example("MultiIO")
    sm, _ = _split(model, inputs, 2, assign=lambda gm, k: assign_by_name(
        gm, {n.name: (0 if n.name in ("size", "a", "tanh") else 1) for n in compute_nodes(gm)}))
    plain = [e for e in sm.comm if not e.value.is_tensor]
    assert [e.value.spec for e in plain] == [6]
    assert "passes_comm_recv('size:0->1', 0)" in sm.stages[1].code
    check_equivalent(model, lambda *x: run_local(sm, *x), lambda: stage_grads(sm), inputs)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tuple_and_float_cross_leaf_by_leaf(method):
    torch.manual_seed(0)
    model, inputs = TupleCross(), (torch.randn(5, 8),)
    first = {"lin", "linear", "chunk", "getattr_1", "getitem", "pow_1"}  # fx: the float is made in stage 0
    sm, _ = _split(model, inputs, 2, method, lambda gm, k: assign_by_name(
        gm, {n.name: (0 if n.name in first and (method == "fx" or n.name != "getitem") else 1)
             for n in compute_nodes(gm)}))
    specs = [e.value.spec for e in sm.comm]
    assert sum(isinstance(s, meta.TensorMeta) for s in specs) == 2  # the two chunks, one tag each
    if method == "fx":
        assert 8 ** 0.5 in specs
    check_equivalent(model, lambda *x: run_local(sm, *x), lambda: stage_grads(sm), inputs)


def test_value_overwritten_after_send_keeps_what_the_consumer_read():
    torch.manual_seed(0)
    model, inputs = InPlace(), (torch.randn(4, 6),)
    order = {"lin": 0, "tanh": 1, "mul_": 0, "out": 1, "add": 1}
    sm, _ = _split(model, inputs, 2, assign=lambda gm, k: assign_by_name(gm, order))
    code0 = sm.stages[0].code
    assert "torch.clone(lin)" in code0 and code0.index("torch.clone(lin)") < code0.index(".mul_(")
    assert sorted(e.tag for e in sm.comm) == ["lin:0->1", "lin@v0:0->1"]
    check_equivalent(model, lambda *x: run_local(sm, *x), lambda: stage_grads(sm), inputs)


def test_write_into_a_value_another_stage_reads_is_rejected():
    torch.manual_seed(0)
    model, inputs = InPlace(), (torch.randn(4, 6),)
    gm = capture(model, inputs, "fx")
    assign_by_name(gm, {"lin": 0, "tanh": 2, "mul_": 1, "out": 2, "add": 2})
    with pytest.raises(SplitError, match=r"in-place op 'mul_' \(stage 1\) writes into 'lin'"):
        split_stages(gm, inputs)


def test_assignment_errors_name_the_node():
    model, inputs = example("MLP")
    gm = capture(model, inputs, "fx")
    nodes = compute_nodes(gm)
    with pytest.raises(SplitError, match=rf"no stage assignment \({nodes[0].name}"):
        split_stages(gm, inputs)
    assign_even(gm, 2)
    meta.put(nodes[0], meta.StageAssign(1))
    meta.put(nodes[1], meta.StageAssign(0))
    with pytest.raises(SplitError, match=rf"'{nodes[1].name}' \(stage 0\) uses '{nodes[0].name}' from later stage 1"):
        split_stages(gm, inputs)
    assign_even(gm, 2)
    meta.put(nodes[-1], meta.StageAssign(3))
    with pytest.raises(SplitError, match="stage 2 has no node"):
        split_stages(gm, inputs)


def test_shapes_from_export_without_example_inputs():
    model, inputs = example("MLP")
    gm = capture(model, inputs, "export")
    assign_even(gm, 2)
    result = split_stages(gm)
    assert result.comm[0].value.spec.shape == (8, 32)


class NamedCross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        best = self.lin(x).max(dim=1)
        return best.values * 2


def test_namedtuple_crossing_is_a_clear_error():
    torch.manual_seed(0)
    model, inputs = NamedCross(), (torch.randn(3, 6),)
    gm = capture(model, inputs, "fx")
    assign_by_name(gm, {"lin": 0, "max_1": 0}, default=1)
    with pytest.raises(SplitError, match=r"'max_1' \(max, holding tensors\) would cross from stage 0 to stage 1 "
                                         r"\(getattr_1\).*put getattr_1 in stage 0"):
        split_stages(gm, inputs)
