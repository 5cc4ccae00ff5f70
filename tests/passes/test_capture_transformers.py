"""Real third-party models, as a new user brings them: HF transformers from tiny configs.

Random weights from a config (no downloads). Symbolic tracing cannot capture
current transformers models; the export path must, and profiling must work on
the ATen-level graph it gives. Skipped when transformers is not installed
(CI does not install it).
"""
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fxpipe.cli import main  # noqa: E402
from fxpipe.loader import load_model  # noqa: E402
from passes import meta  # noqa: E402
from passes.capture import capture  # noqa: E402
from passes.profile import profile, to_cost_graph  # noqa: E402
from tests.passes.test_profile import one_thread  # noqa: E402,F401 - autouse fixture

CONFIGS = {
    "gpt2": "T.GPT2LMHeadModel(T.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2))",
    "bert": "T.BertForMaskedLM(T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, "
            "intermediate_size=64, max_position_embeddings=32))",
    "llama": "T.LlamaForCausalLM(T.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, "
             "num_key_value_heads=1, intermediate_size=64, max_position_embeddings=32))",
    "gemma": "T.GemmaForCausalLM(T.GemmaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, "
             "num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=32))",
}


def _model_file(tmp_path, name):
    path = tmp_path / f"{name}_tiny.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        import transformers as T
        torch.manual_seed(0)
        model = {CONFIGS[name]}
        example_inputs = (torch.randint(0, 100, (2, 16)),)
        example_targets = torch.randint(0, 100, (2, 16))
        def loss_fn(outputs, targets):
            return torch.nn.functional.cross_entropy(outputs.logits.reshape(-1, 100), targets.reshape(-1))
    """))
    return path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_capture_through_export_and_profile(tmp_path, name):
    spec = load_model(str(_model_file(tmp_path, name)))  # turns the generation cache off
    gm = capture(spec.model, spec.example_inputs)  # checked against the model inside
    info = meta.get(gm, meta.CaptureInfo)
    assert info.method == "export" and info.fx_error  # symbolic tracing fails, export captures
    profile(gm, spec.example_inputs, repeats=1, warmup=0)
    graph = to_cost_graph(gm)
    unique = {id(p): p for p in spec.model.parameters()}
    assert graph.total_param_bytes() == sum(p.numel() * p.element_size() for p in unique.values())
    with_params = [n for n in graph.nodes.values() if n.params]
    assert with_params and all(n.bwd_s > 0 for n in with_params)
    assert any(n.module_path.endswith("attn") or "attention" in n.module_path for n in graph.nodes.values())
    readers = {}
    for node in graph.nodes.values():
        for p in node.params:
            readers[p] = readers.get(p, 0) + 1
    shared = {p for p, count in readers.items() if count > 1}
    assert all("embed" in p or p.endswith("wte.weight") for p in shared), shared  # only the tied input embedding
    out = gm(*spec.example_inputs)
    assert spec.loss_fn(out, spec.example_targets).dim() == 0  # the HF output type survives capture


def test_cli_profiles_a_transformers_model_file(tmp_path, capsys):
    code = main(["profile", str(_model_file(tmp_path, "gpt2")), "--repeats", "1", "--warmup", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "capture: export" in captured.out and "use_cache = False" in captured.err
