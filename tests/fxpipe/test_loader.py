"""load_model: model files, package.module:factory, and the errors a user meets."""
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fxpipe.loader import ModelLoadError, ModelSpec, default_loss, load_model
from fxpipe.runtime.worker import make_data

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("example", ["gpt", "cnn"])
def test_bundled_examples_follow_the_contract(example):
    spec = load_model(str(EXAMPLES / f"{example}.py"))
    assert isinstance(spec, ModelSpec) and isinstance(spec.model, torch.nn.Module)
    assert isinstance(spec.example_inputs, tuple) and spec.has_loss_fn
    loss = spec.loss_fn(spec.model(*spec.example_inputs), spec.example_targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # batches() is reproducible and shaped like the example microbatch (read as the workers read it)
    first = [make_data(spec, 1)(0) for _ in range(2)]
    assert torch.equal(first[0][0][0], first[1][0][0])
    assert first[0][0][0].shape == spec.example_inputs[0].shape
    assert first[0][1].shape == spec.example_targets.shape


def test_callables_single_tensor_and_default_loss(tmp_path):
    path = _write(tmp_path, "m.py", """
        import torch
        from torch import nn
        def model():
            return nn.Linear(4, 2)
        def example_inputs():
            return torch.randn(3, 4)
        leaf_modules = ["x"]
    """)
    spec = load_model(str(path))
    assert isinstance(spec.model, torch.nn.Linear)
    assert len(spec.example_inputs) == 1 and spec.example_inputs[0].shape == (3, 4)
    assert spec.loss_fn is default_loss and not spec.has_loss_fn and spec.leaf_modules == ("x",)
    out = spec.model(*spec.example_inputs)
    assert torch.allclose(spec.loss_fn(out, None), out.mean())
    inputs, targets = make_data(spec, 1)(5)  # without batches() every microbatch is the example
    assert inputs == spec.example_inputs and targets is None


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="model file not found: .*nope.py"):
        load_model(str(tmp_path / "nope.py"))


def test_a_split_folder_given_as_the_model_says_to_pass_it_as_split(tmp_path):
    (tmp_path / "split.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"folder from `fxpipe split`.*--split"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="must be a .py file"):  # any other folder
        load_model(str(tmp_path.parent))


@pytest.mark.parametrize("body, message", [
    ("import torch\nexample_inputs = (torch.randn(2, 2),)\n", "defines no 'model'"),
    ("from torch import nn\nmodel = nn.Linear(2, 2)\n", "defines no 'example_inputs'"),
    ("model = 3\nexample_inputs = ()\n", "'model' must be an nn.Module"),
    ("import torch\nfrom torch import nn\nmodel = nn.Linear(2, 2)\nexample_inputs = {'x': torch.randn(2, 2)}\n", "example_inputs must be a tuple"),
    ("import torch\nfrom torch import nn\nmodel = nn.Linear(2, 2)\nexample_inputs = (torch.randn(2, 2),)\nloss_fn = lambda out, t: out\n", "loss_fn must return a scalar"),
    ("x = (\n", "running the file failed at .*m.py:1"),
])
def test_clear_errors_for_file_mistakes(tmp_path, body, message):
    path = _write(tmp_path, "m.py", body)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path))


def test_rejected_inputs_name_the_module_and_shapes(tmp_path):
    path = _write(tmp_path, "m.py", """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(31, 4)))
        example_inputs = (torch.randn(8, 16),)
    """)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    text = str(info.value)
    assert "module '2.0' (Linear" in text
    assert "(8, 16) torch.float32" in text and "(8, 32) torch.float32" in text


def test_package_module_factory(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _write(pkg, "nets.py", """
        import torch
        from torch import nn
        example_inputs = (torch.randn(5, 3),)
        def small():
            return nn.Linear(3, 2)
        def full():
            return {"model": nn.Linear(3, 1), "example_inputs": (torch.randn(2, 3),), "loss_fn": lambda o, t: o.sum()}
        def pair():
            return nn.Linear(6, 1), torch.randn(4, 6)
        def broken():
            raise RuntimeError("no weights here")
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("userpkg", None)
    sys.modules.pop("userpkg.nets", None)
    small = load_model("userpkg.nets:small")
    assert small.model.out_features == 2 and small.example_inputs[0].shape == (5, 3)
    full = load_model("userpkg.nets:full")
    assert full.model.out_features == 1 and full.example_inputs[0].shape == (2, 3) and full.has_loss_fn
    pair = load_model("userpkg.nets:pair")
    assert pair.model.in_features == 6 and pair.example_inputs[0].shape == (4, 6)
    with pytest.raises(ModelLoadError, match="small2"):
        load_model("userpkg.nets:small2")
    with pytest.raises(ModelLoadError, match="broken\\(\\) failed.*no weights here"):
        load_model("userpkg.nets:broken")
    with pytest.raises(ModelLoadError, match="cannot import 'nopkg.nets'"):
        load_model("nopkg.nets:small")


def test_check_does_not_change_the_model(tmp_path):
    path = _write(tmp_path, "m.py", """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        example_inputs = (torch.randn(6, 4) + 3,)
    """)
    spec = load_model(str(path))
    assert torch.equal(spec.model[1].running_mean, torch.zeros(4))
