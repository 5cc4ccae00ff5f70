"""The same small 1f1b-stash run, again and again: every repeat succeeds and gives the same weights.

A timing-dependent fault (a buffer reused before its send went out, a
message matched to the wrong receive, a rank leaving while its peer still
waits) fails only now and then, so one run proves little. Here an
``nn.TransformerEncoder`` language model (causal mask built in the model, so
a float mask with ``-inf`` crosses the cut) is split for real (capture,
assign, split, save, load) at two cuts, or kept whole on two replicas, and
each is trained twice on two ranks with weight stashing: every run must finish with finite
losses, and the two runs of a cut must end with bit-identical weights and
losses (the arithmetic is the same; only the timing differs). Correctness
of stashing itself is test_equivalence's job.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig, train
from tests.fxpipe.runtime.harness import spawn

VOCAB, DIM, CTX, MICRO, M, STEPS, REPEATS = 32, 16, 8, 2, 4, 4, 2


class EncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(CTX, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        return self.head(self.enc(self.tok(idx) + self.pos(torch.arange(t)), mask=mask, is_causal=True))


def _data(g: int) -> Tuple[Tuple[torch.Tensor], torch.Tensor]:
    idx = torch.randint(0, VOCAB, (MICRO, CTX + 1), generator=torch.Generator().manual_seed(70 + g))
    return (idx[:, :-1],), idx[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _model() -> EncoderLM:
    torch.manual_seed(0)
    return EncoderLM()


def _split(folder: str, cut_before: Optional[str]) -> None:
    """Two stages cut before the first node named ``cut_before...``; ``None``: one stage (data parallelism).

    Capture traces into ``nn.TransformerEncoder``, so its layers are nodes of their own
    (``enc_layers_1_...``) and a cut can fall between them.
    """
    from fxpipe.split_model import SplitModel
    from passes.capture import capture
    from passes.partition import apply_assignment
    from passes.split import split_stages

    inputs = _data(0)[0]
    gm = capture(_model(), inputs)
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    cut = next(i for i, name in enumerate(compute) if name.startswith(cut_before)) if cut_before else len(compute)
    apply_assignment(gm, {name: int(i >= cut) for i, name in enumerate(compute)})
    SplitModel.from_result(split_stages(gm, inputs), gm).save(folder)


def _rank(rank: int, folder: str, replicas: Tuple[int, ...], cfg: Dict[str, Any]) -> Dict[str, Any]:
    from fxpipe.split_model import SplitModel

    res = train(rank=rank, layout=Layout.of(replicas), split=SplitModel.load(folder),
                cfg=TrainConfig.from_json(cfg), data=_data, loss_fn=_loss)
    return {"state": res.state, "losses": res.losses}


# cut before the encoder: the sum of embeddings and the float mask cross; between its two layers;
# before the head: the encoder's output; no cut: one stage on two replicas
@pytest.mark.parametrize("cut_before,replicas", [("enc", (1, 1)), ("enc_layers_1", (1, 1)), ("head", (1, 1)),
                                                 (None, (2,))])
def test_stash_repeats_finish_and_agree(tmp_path, cut_before: Optional[str], replicas: Tuple[int, ...]) -> None:
    folder = str(tmp_path / "split")
    _split(folder, cut_before)
    cfg = TrainConfig(log=False, schedule="1f1b-stash", microbatches=M, steps=STEPS, lr=0.05).to_json()
    runs: List[List[Dict[str, Any]]] = [spawn(_rank, 2, (folder, replicas, cfg), deadline=120.0).ok()
                                        for _ in range(REPEATS)]
    first = runs[0]
    for again in runs[1:]:
        for a, b in zip(first, again):
            for k in a["state"]:
                assert torch.equal(a["state"][k], b["state"][k]), f"cut before {cut_before}: {k} differs between runs"
        assert first[-1]["losses"] == again[-1]["losses"]
    losses = first[-1]["losses"]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
