import pytest
import torch

from passes import meta
from tests.models import example


def test_records_live_under_one_namespace():
    model, _ = example("MLP")
    gm = torch.fx.symbolic_trace(model)
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    meta.put(node, meta.StageAssign(2))
    assert meta.get(node, meta.StageAssign).stage == 2
    assert set(node.meta) >= {"fxpipe"} and list(node.meta["fxpipe"]) == ["stage"]
    assert meta.get(node, meta.NodeCost, None) is None
    with pytest.raises(KeyError):
        meta.get(node, meta.NodeCost)


def test_require_names_missing_nodes_and_pass():
    model, _ = example("MLP")
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(meta.MissingMetadataError, match="partition needs 'cost': run profile first"):
        meta.require(gm, meta.NodeCost, needed_by="partition", made_by="profile")


def test_tensor_meta_bytes():
    assert meta.TensorMeta((2, 3), "torch.float64").nbytes == 48
    vm = meta.ValueMeta((meta.TensorMeta((2,), "torch.float32"), 3, {"k": meta.TensorMeta((1,), "torch.int64")}))
    assert [t.nbytes for t in vm.tensors()] == [8, 8]
