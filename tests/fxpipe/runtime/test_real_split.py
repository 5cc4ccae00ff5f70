"""The runtime on a real split (capture -> assign -> split -> save/load): TinyGPT, tied embeddings.

Three ranks: stage 0 (embeddings and the first blocks) on two replicas,
stage 1 (the rest and the tied output projection) on one. So an ALLREDUCE
combines replicas and sums the tied embedding's gradient over both stages.
The weights after three flush steps must equal plain gradient accumulation
on the unsplit model, through ``SplitModel.original_state_dict``.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig, train
from tests.fxpipe.runtime.harness import spawn
from tests.models import TinyGPT

MICRO, CTX, VOCAB, M, STEPS, LR = 2, 8, 64, 4, 3, 0.05


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=16, heads=2, layers=2, ctx=CTX).double()


def _data(g: int) -> Any:
    gen = torch.Generator().manual_seed(50 + g)
    idx = torch.randint(0, VOCAB, (MICRO, CTX + 1), generator=gen)
    return (idx[:, :-1],), idx[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _split(folder: str, dtype: torch.dtype = torch.float64) -> None:
    from passes.capture import capture
    from passes.partition import apply_assignment
    from passes.split import split_stages
    from fxpipe.split_model import SplitModel

    model = _model().to(dtype)
    inputs = _data(0)[0]
    gm = capture(model, inputs)
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    cut = next(i for i, name in enumerate(compute) if "blocks_1" in name)  # stage 1 starts at block 1
    apply_assignment(gm, {name: int(i >= cut) for i, name in enumerate(compute)})
    SplitModel.from_result(split_stages(gm, inputs), gm).save(folder)


def _load(folder: str) -> Any:
    """The saved split in float64 (SplitModel.load currently rebuilds float32 modules; the
    reference below starts from the loaded weights, so both sides start equal)."""
    from fxpipe.split_model import SplitModel

    split = SplitModel.load(folder)
    for stage in split.stages:
        stage.double()
    return split


def _rank(rank: int, folder: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    res = train(rank=rank, layout=Layout.of((2, 1)), split=_load(folder),
                cfg=TrainConfig.from_json(cfg), data=_data, loss_fn=_loss)
    return {"stage": res.stage, "state": res.state, "losses": res.losses}


def test_tinygpt_replicated_and_tied_flush_equals_accumulation(tmp_path) -> None:
    folder = str(tmp_path / "split")
    _split(folder)
    split = _load(folder)
    assert split.tied, "the tied embedding should be held by both stages"
    cfg = TrainConfig(log=False, schedule="1f1b-flush", microbatches=M, steps=STEPS, lr=LR).to_json()
    results: List[Dict[str, Any]] = spawn(_rank, 3, (folder, cfg)).ok()
    by_stage = {r["stage"]: r["state"] for r in reversed(results)}  # replica 0 of each stage
    for r in results:  # replicas hold identical weights
        for k, v in r["state"].items():
            torch.testing.assert_close(v, by_stage[r["stage"]][k], rtol=0, atol=0)
    got = split.original_state_dict([by_stage[0], by_stage[1]])
    model = _model()
    start = split.original_state_dict([st.state_dict() for st in split.stages])
    model.load_state_dict(start)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(M):
            (x,), y = _data(s * M + m)
            (_loss(model(x), y) / M).backward()
        opt.step()
    want = model.state_dict()
    assert set(want) <= set(got)
    for k in want:
        moved = (want[k] - start[k]).norm()
        err = (got[k] - want[k]).norm()
        assert err <= 1e-5 * max(want[k].norm().item(), 1e-12), (k, err.item(), moved.item())
    tied_name = next(iter(split.tied))
    assert (got[tied_name] - start[tied_name]).norm() > 1e-4
