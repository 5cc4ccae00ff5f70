"""A language model on nn.TransformerEncoder splits layer by layer (issue 13, item 1).

fx kept ``nn.TransformerEncoder`` as one node, so four devices got one stage.
Now the capture traces into it: on four stages the layers spread over at least
three, and the split model equals the original in float64 (outputs, input
gradients and every parameter gradient within 1e-10 relative).
"""
import copy

import pytest
import torch

import fxpipe
from tests.models import EncoderLM, Seq2Seq
from tests.splitting import check_equivalent, stage_grads

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


def _layer_stages(sm, prefix):
    """Which stages hold parameters of each layer ``prefix.<i>``."""
    found = {}
    for j in range(sm.num_stages):
        for name in sm.stage_parameters(j):
            if name.startswith(prefix):
                found.setdefault(int(name[len(prefix):].split(".")[0]), set()).add(j)
    return found


def test_encoder_lm_layers_land_on_different_stages_and_split_equals_model():
    torch.manual_seed(0)
    model = EncoderLM().double()
    inputs = (torch.randint(0, 64, (4, 16)),)
    ref = copy.deepcopy(model)
    sm = fxpipe.split(model, inputs, devices=4, replication="none", time_limit=5, progress=False)
    assert sm.num_stages == 4
    layers = _layer_stages(sm, "enc.layers.")
    assert sorted(layers) == [0, 1, 2, 3]
    assert len(set().union(*layers.values())) >= 3, layers
    check_equivalent(ref, lambda *x: fxpipe.run_local(sm, *x), lambda: stage_grads(sm), inputs, tol=1e-10)


def test_seq2seq_transformer_splits_and_equals_model():
    torch.manual_seed(0)
    model = Seq2Seq().double()
    inputs = (torch.tensor([[3, 4, 5, 6, 0, 0]] * 4), torch.randint(1, 32, (4, 7)))
    ref = copy.deepcopy(model)
    sm = fxpipe.split(model, inputs, devices=3, replication="none", time_limit=5, progress=False)
    assert sm.num_stages == 3
    encoder, decoder = _layer_stages(sm, "core.encoder.layers."), _layer_stages(sm, "core.decoder.layers.")
    assert len(set().union(*encoder.values(), *decoder.values())) >= 2
    check_equivalent(ref, lambda *x: fxpipe.run_local(sm, *x), lambda: stage_grads(sm), inputs, tol=1e-10)
