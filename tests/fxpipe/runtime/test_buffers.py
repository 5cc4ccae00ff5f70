"""Buffers a forward writes (BatchNorm statistics) train as in the unsplit model.

A real split (fx capture or export -> split -> stage files) of a model with a
BatchNorm layer in each stage, float64, two ranks: after three steps of
``1f1b-flush`` or ``zb-h1`` with ``--recompute all`` every parameter AND buffer
(running mean, running variance, batch count) equals plain gradient
accumulation on the unsplit model. Without ``recompute.Buffers`` every
recompute updated the statistics again. A stage file of an exported graph
keeps the in-place update of the batch count (loading it once ran the update
while re-tracing and left the buffer out of the stage).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn

from fxpipe import run_local
from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig, train
from fxpipe.runtime.recompute import Buffers, recomputed
from passes import comm
from tests.fxpipe.runtime import cases
from tests.fxpipe.runtime.harness import spawn

MICRO, M, STEPS, LR = 8, 4, 3, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data(g: int) -> Any:
    gen = torch.Generator().manual_seed(300 + g)
    x = torch.randn(MICRO, 6, generator=gen, dtype=torch.float64)
    return (x,), torch.randn(MICRO, 3, generator=gen, dtype=torch.float64)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _split(folder: str, method: str) -> None:
    from fxpipe.split_model import SplitModel
    from passes.capture import capture
    from passes.partition import apply_assignment
    from passes.split import split_stages

    model = _model()
    inputs = _data(0)[0]
    gm = capture(model, inputs, method=method)
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    # the Sequential's layer 3 (a Linear) starts stage 1: ``_3`` traced, ``_3_linear`` exported
    cut = next(i for i, name in enumerate(compute) if name == "_3" or name.startswith("_3_"))
    apply_assignment(gm, {name: int(i >= cut) for i, name in enumerate(compute)})
    SplitModel.from_result(split_stages(gm, inputs), gm).save(folder)


def _load(folder: str) -> Any:
    from fxpipe.split_model import SplitModel

    split = SplitModel.load(folder)
    for stage in split.stages:
        stage.double()
    return split


def _rank(rank: int, folder: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    res = train(rank=rank, layout=Layout.of((1, 1)), split=_load(folder), cfg=TrainConfig.from_json(cfg),
                data=_data, loss_fn=_loss)
    return {"stage": res.stage, "state": res.state}


@pytest.mark.parametrize("method,schedule", [("fx", "1f1b-flush"), ("fx", "zb-h1"), ("export", "1f1b-flush")])
def test_recomputing_stages_update_batchnorm_statistics_once(tmp_path, method: str, schedule: str) -> None:
    folder = str(tmp_path / "split")
    _split(folder, method)
    split = _load(folder)
    cfg = TrainConfig(log=False, schedule=schedule, microbatches=M, steps=STEPS, optimizer="sgd", lr=LR,
                      recompute="all").to_json()
    results: List[Dict[str, Any]] = spawn(_rank, 2, (folder, cfg)).ok()
    got = split.original_state_dict([r["state"] for r in sorted(results, key=lambda r: r["stage"])])
    model = _model()
    start = split.original_state_dict([st.state_dict() for st in split.stages])
    model.load_state_dict(start)
    want = cases.accumulate_model(model, _data, _loss, STEPS, M, "sgd", LR)
    assert want["1.num_batches_tracked"].item() == STEPS * M
    assert set(want) == set(got)
    for k in want:
        assert (want[k] - start[k]).abs().max() > 0, k  # every weight and statistic moved
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12, msg=k)


def test_buffers_found_on_the_first_forward_and_put_back_after_each_recompute() -> None:
    torch.manual_seed(0)
    plain = _model()
    again = copy.deepcopy(plain)
    xs = [_data(g)[0][0] for g in range(3)]
    for x in xs:
        plain(x).sum().backward()
    guard = Buffers(again)
    outs = [recomputed(again, [x], comm.MailboxTransport(), guard) for x in xs]
    names = {id(b): n for n, b in again.named_buffers()}
    assert sorted(names[id(b)] for b in guard.written) == sorted(names.values())  # both layers' three buffers
    for out in outs:
        out.sum().backward()  # each backward runs the forward again
    for k, v in again.state_dict().items():
        assert torch.equal(v, plain.state_dict()[k]), k


def test_exported_stage_file_keeps_its_in_place_buffer_update(tmp_path) -> None:
    folder = str(tmp_path / "split")
    _split(folder, "export")
    split = _load(folder)
    counts = {k: v for st in split.stages for k, v in st.state_dict().items() if k.endswith("num_batches_tracked")}
    assert sorted(counts) == ["1.num_batches_tracked", "4.num_batches_tracked"]
    assert all(v.item() == 0 for v in counts.values())  # loading ran nothing
    model = _model()
    model.load_state_dict(split.original_state_dict([st.state_dict() for st in split.stages]))
    x = _data(0)[0][0]
    torch.testing.assert_close(run_local(split, x), model(x), rtol=0, atol=1e-12)
    got = split.original_state_dict([st.state_dict() for st in split.stages])
    for k, v in model.state_dict().items():  # the batch counts at 1, the running statistics moved alike
        assert torch.equal(got[k], v), k
