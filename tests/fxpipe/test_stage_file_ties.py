"""Stage files keep ties: a weight shared in the model is one tensor in every loaded stage.

``TiedLM`` holds one embedding table under three module names. Whatever the
cut, the loaded split's gradient of that table (summed over the stages holding
it, as training does) must equal the unsplit model's, in float64; a stage
file imported on its own (its ``build()``) must hold one ``Parameter``; the
weights file stores the table once.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from passes.capture import capture
from passes.partition import apply_assignment
from passes.split import split_stages
from tests.models import TiedLM

VOCAB = 16


def _inputs() -> Any:
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, VOCAB, (2, 7), generator=gen)
    return (idx[:, :-1],), idx[:, 1:]


def _saved(folder: Path, cuts: List[int], method: str = "fx") -> fxpipe.SplitModel:
    torch.manual_seed(0)
    model = TiedLM(VOCAB).double()
    inputs = _inputs()[0]
    gm = capture(model, inputs, method=method)
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
               and not n.name.startswith("_guards")]
    apply_assignment(gm, {n: sum(i >= c for c in cuts) for i, n in enumerate(compute)})
    sm = fxpipe.SplitModel.from_result(split_stages(gm, inputs), gm)
    sm.save(folder)
    return sm


def _grads(sm: fxpipe.SplitModel) -> Dict[str, torch.Tensor]:
    """Gradients under the original names; every name of one original tensor must be one object.

    In one process ``load`` makes the stages holding a tied parameter share it,
    so its ``.grad`` holds every use (training sums separate copies instead).
    """
    (x,), y = _inputs()
    F.cross_entropy(fxpipe.run_local(sm, x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    objects: Dict[str, torch.Tensor] = {}
    for j, stage in enumerate(sm.stages):
        for local, p in stage.named_parameters(remove_duplicate=False):
            name = sm.param_names[j][local]
            assert objects.setdefault(name, p) is p, f"stage {j}: {local} is a copy of {name}"
    return {name: p.grad for name, p in objects.items()}


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("cuts", [[], [5], [3, 8]], ids=["1-stage", "2-stages", "3-stages"])
def test_loaded_split_gradients_equal_the_model(tmp_path: Path, cuts: List[int], method: str) -> None:
    _saved(tmp_path, cuts, method)
    loaded = fxpipe.SplitModel.load(tmp_path)
    torch.manual_seed(0)
    model = TiedLM(VOCAB).double()
    (x,), y = _inputs()
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    got = _grads(loaded)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_stage_file_alone_holds_one_parameter(tmp_path: Path) -> None:
    _saved(tmp_path, [])
    source = (tmp_path / "stage_0.py").read_text()
    assert "_tie(self, 'head.weight', 'tok.weight')" in source and "_tie(self, 'prev.weight', 'tok.weight')" in source
    spec = importlib.util.spec_from_file_location("stage_0_alone", tmp_path / "stage_0.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stage = module.build()
    assert stage.tok.weight is stage.prev.weight is stage.head.weight
    assert len(list(stage.parameters())) == 5 and stage.tok.weight.dtype == torch.float64
    state = torch.load(tmp_path / "stage_0.pt", weights_only=False)["state"]
    assert "tok.weight" in state and "prev.weight" not in state and "head.weight" not in state


def test_folder_without_tie_lines_is_retied_on_load(tmp_path: Path) -> None:
    """Folders written before stage files tied names (every name saved, no ``_tie``) load tied too."""
    sm = _saved(tmp_path, [])
    path = tmp_path / "stage_0.py"
    path.write_text("\n".join(line for line in path.read_text().splitlines() if "_tie(self" not in line))
    blob = torch.load(tmp_path / "stage_0.pt", weights_only=False)
    blob["state"] = {k: v.detach().clone() for k, v in sm.stages[0].state_dict(keep_vars=True).items()}
    torch.save(blob, tmp_path / "stage_0.pt")
    stage = fxpipe.SplitModel.load(tmp_path).stages[0]
    assert stage.tok.weight is stage.prev.weight is stage.head.weight
