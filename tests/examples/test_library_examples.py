"""The two "passes in your compiler" examples run and match eager PyTorch."""
import importlib.util
import pathlib

import pytest
import torch

from passes import meta
from passes.infra import PartitionPass, SplitPass, partition_graph
from tests.models import example

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pass_manager_example_matches_model():
    ex = _load("pass_manager")
    out, ref, split = ex.main(devices=3)
    assert len(split.stages) == 3
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_compile_backend_matches_eager_forward_and_backward():
    ex = _load("compile_backend")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = ex.Net(), torch.randn(8, 24)
    backend = ex.pipeline_backend(devices=2)
    out = torch.compile(model, backend=backend)(x)
    assert len(backend.stages) == 2
    ref = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(out.pow(2).sum(), list(model.parameters()))
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), list(model.parameters()))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_partition_pass_names_missing_profile():
    model, _ = example("MLP")
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(meta.MissingMetadataError, match="partition needs costs: run profile"):
        PartitionPass(2)(gm)
    with pytest.raises(meta.MissingMetadataError, match="partition needs costs: run profile"):
        partition_graph(gm, 2)


def test_split_pass_names_missing_partition():
    model, x = example("MLP")
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(meta.MissingMetadataError, match="split needs stages: run partition"):
        SplitPass(x)(gm)
