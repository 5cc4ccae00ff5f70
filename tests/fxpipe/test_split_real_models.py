"""Models written by others, tried as a new user would: fxpipe.split + run_local
give the original outputs and gradients (HF transformers from tiny configs,
random weights, no downloads; a torchvision-style ResNet with in-place ReLU and
``out += identity``)."""
import copy
import textwrap

import pytest
import torch
import torch.nn as nn

import fxpipe
from tests.splitting import check_equivalent, split_model_of, stage_grads


def _hf_model(name: str):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=100, use_cache=False)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common)
        return tf.GPT2LMHeadModel(cfg)
    if name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            **common)
        return tf.BertForMaskedLM(cfg)
    if name == "gemma":  # casts every norm weight in the forward
        cfg = tf.GemmaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, intermediate_size=64, max_position_embeddings=32, **common)
        return tf.GemmaForCausalLM(cfg)
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=32, **common)
    return tf.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gemma"])
def test_hf_transformers_split_equals_original(name):
    model = _hf_model(name)
    model.train()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    sm = fxpipe.split(model, (ids,), devices=3, replication="none", time_limit=5, progress=False)
    assert sm.num_stages == 3
    if name in ("gpt2", "bert", "gemma"):
        assert len(sm.tied) == 1, sm.tied  # input embedding tied to the LM head, nothing else
    check_equivalent(_Logits(ref), lambda x: fxpipe.run_local(sm, x).logits,
                     lambda: {"m." + k: v for k, v in stage_grads(sm).items()}, (ids,))


def test_hf_model_with_its_generation_cache_on_splits_from_python(capsys):
    """HF models come with ``use_cache=True``; ``fxpipe.split`` turns it off for capture (a cache object
    cannot cross stages) and sets it back on the caller's model."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=100,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    assert model.config.use_cache is True
    model.train()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    sm = fxpipe.split(model, (ids,), devices=2, replication="none", time_limit=5, progress=False)
    assert "use_cache = False while capturing" in capsys.readouterr().err
    assert model.config.use_cache is True
    check_equivalent(_Logits(ref), lambda x: fxpipe.run_local(sm, x).logits,
                     lambda: {"m." + k: v for k, v in stage_grads(sm).items()}, (ids,))


class _Logits(nn.Module):
    """The HF model's logits, so the shared checker sees one tensor."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(ids).logits


def test_hf_model_file_through_the_cli(tmp_path, capsys):
    pytest.importorskip("transformers")
    from fxpipe.cli import main

    model_file = tmp_path / "tiny_gpt2.py"
    model_file.write_text(textwrap.dedent("""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=100,
                                           bos_token_id=0, eos_token_id=0))
        example_inputs = (torch.randint(0, 100, (2, 16)),)
    """))
    out = tmp_path / "out"
    assert main(["split", str(model_file), "--devices", "2", "--replication", "none", "--time-limit", "5",
                 "-o", str(out)]) == 0
    assert (out / "stage_1.py").exists() and (out / "report.md").exists()
    loaded = fxpipe.SplitModel.load(out)
    assert loaded.num_stages == 2 and "transformer.wte.weight" in loaded.tied


class BasicBlock(nn.Module):
    """torchvision's ResNet block, as users write it: in-place ReLU, ``out += identity``."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class MiniResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layers = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


@pytest.mark.parametrize("method, stages", [("fx", 3), ("fx", 4), ("export", 3)])
def test_torchvision_style_resnet_with_inplace_relu(method, stages):
    torch.manual_seed(0)
    model, inputs = MiniResNet(), (torch.randn(4, 3, 16, 16),)
    sm, _ = split_model_of(model, inputs, method, stages)
    check_equivalent(model, lambda *x: fxpipe.run_local(sm, *x), lambda: stage_grads(sm), inputs)


def test_gemma_with_a_norm_weight_cast_a_stage_before_its_norm():
    """The planner may run a weight-only chain (Gemma's ``1 + weight.float()``) in a stage before its
    reader's (``segment_plan.silent_moves``): the cast value is sent on, the weight's gradient comes
    back to the stage that holds it, and the split still equals the model."""
    from fxpipe.split_model import SplitModel
    from passes.capture import capture
    from passes.partition import apply_assignment
    from passes.split import split_stages

    model = _hf_model("gemma")
    model.train()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    gm = capture(model, (ids,), method="export")
    names = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    second = next(i for i, n in enumerate(names) if n.startswith("model_layers_1_"))
    stage = {n: int(i >= second) for i, n in enumerate(names)}
    moved = [n for n in names if n.startswith("model_layers_1_post_attention_layernorm_")
             and n.endswith(("_to_1", "_add_1"))]
    assert len(moved) == 2, names  # the weight's cast and the + 1
    stage.update({n: 0 for n in moved})
    apply_assignment(gm, stage)
    sm = SplitModel.from_result(split_stages(gm, (ids,)), gm)
    assert sm.num_stages == 2
    assert "model.layers.1.post_attention_layernorm.weight" in sm.stage_parameters(0)
    check_equivalent(_Logits(ref), lambda x: fxpipe.run_local(sm, x).logits,
                     lambda: {"m." + k: v for k, v in stage_grads(sm).items()}, (ids,))
