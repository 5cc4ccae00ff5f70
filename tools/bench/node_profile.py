"""Benchmark: do the per-node times add up to the whole model? On both capture methods.

For each model (the bundled examples, the benchmark models of ``models.py``, and with
``--transformers`` tiny HF models from configs), capture with symbolic tracing
and with ``torch.export``, profile, and print the sum of the per-node
forward / backward times divided by the whole model's forward / backward
measured the same way (1.00 = the parts add up exactly), plus node counts and
how long capture and profiling took.

    python -m tools.bench.node_profile [--repeats 5] [--threads 1] [--transformers]

Ratios, not absolute times: other processes on the machine change both sides.
"""
from __future__ import annotations

import argparse
import runpy
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
from tabulate import tabulate

from passes import meta
from passes.capture import CaptureError, capture
from passes.profile import profile, to_cost_graph
from tools.bench.models import example

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
Factory = Callable[[], Tuple[torch.nn.Module, Tuple]]


def _example(name: str) -> Factory:
    def make() -> Tuple[torch.nn.Module, Tuple]:
        ns = runpy.run_path(str(EXAMPLES / f"{name}.py"))
        return ns["model"], ns["example_inputs"]
    return make


def _hf(name: str) -> Factory:
    def make() -> Tuple[torch.nn.Module, Tuple]:
        import transformers as T
        torch.manual_seed(0)
        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                     max_position_embeddings=64, vocab_size=512)
        model = {
            "hf-gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2)),
            "hf-bert": lambda: T.BertForMaskedLM(T.BertConfig(**small)),
            "hf-llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=1)),
        }[name]()
        model.config.use_cache = False
        return model, (torch.randint(0, 512, (8, 32)),)
    return make


def models(with_transformers: bool) -> Dict[str, Factory]:
    found: Dict[str, Factory] = {"examples/gpt": _example("gpt"), "examples/cnn": _example("cnn")}
    for name in ("TinyGPT", "SkipCNN", "MLP"):
        found[f"models/{name}"] = partial(example, name)
    if with_transformers:
        for name in ("hf-gpt2", "hf-bert", "hf-llama"):
            found[name] = _hf(name)
    return found


def measure(make: Factory, method: str, repeats: int) -> List:
    model, inputs = make()
    t0 = time.perf_counter()
    try:
        gm = capture(model, inputs, method=method)
    except CaptureError:
        return [method, "fails", "-", "-", "-", "-"]
    t1 = time.perf_counter()
    profile(gm, inputs, repeats=repeats)
    t2 = time.perf_counter()
    info = meta.get(gm, meta.ProfileInfo)
    graph = to_cost_graph(gm, calibrate=False)
    fwd = sum(n.fwd_s for n in graph.nodes.values()) / info.whole_fwd_s
    bwd = sum(n.bwd_s for n in graph.nodes.values()) / info.whole_bwd_s
    return [method, len(graph.nodes), f"{fwd:.2f}", f"{bwd:.2f}",
            f"{info.whole_fwd_s * 1e3:.2f} / {info.whole_bwd_s * 1e3:.2f}", f"{t1 - t0:.1f} / {t2 - t1:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: thread CPU time clock)")
    parser.add_argument("--transformers", action="store_true", help="add tiny HF GPT-2, BERT, Llama")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, make in models(args.transformers).items():
        for method in ("fx", "export"):
            rows.append([name] + measure(make, method, args.repeats))
    headers = ["model", "capture", "nodes", "Σ node fwd / whole", "Σ node bwd / whole",
               "whole fwd / bwd ms", "capture / profile s"]
    print(tabulate(rows, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
