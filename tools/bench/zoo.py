"""Sweep: models from a zoo, split into pipeline stages, against the unsplit model.

For each torchvision classification model (random weights, ``num_classes=10``,
training mode, a microbatch of 2 images), ``fxpipe.split`` captures, profiles,
plans and cuts it into ``--devices`` stages; the split runs one forward and
backward (``run_local``) beside a copy of the model, from the same RNG state,
and the table shows how far apart they are: the loss, the largest gradient
difference over the largest gradient (per parameter, the latter at least a
thousandth of the model's largest gradient), and the largest buffer
difference (BatchNorm statistics), plus the capture method, node count and
split time. ``--train SCHEDULES`` also trains each split for 3 steps with
``fxpipe train --split`` under each schedule (two local workers over gloo),
``--save`` included, and shows the exit codes.

``--zoo transformers``: ten decoder and encoder architectures from tiny
configs (4 layers, width 64; GPT-2, Llama, Mistral, Qwen2, Phi3, Gemma,
GPT-NeoX, OPT, BERT, RoBERTa), a microbatch of 2 sequences of 16 tokens,
token cross-entropy on the logits; they capture through ``torch.export``.

    python -m tools.bench.zoo [--zoo torchvision|transformers] [--models resnet18,swin_t] [--devices 2]
                              [--train 1f1b-flush,zb-h1]

Neither zoo is a dependency of fxpipe. transformers installs beside the CPU
build of torch (``pip install transformers``); PyPI's torchvision does not
load with it, so run the torchvision zoo in its own environment
(``pip install torch==2.14.1 torchvision==0.29.1`` then ``pip install -e .``).
A sweep finds what breaks on real models; equality is the measure, not speed.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from tabulate import tabulate

# model -> image size (the aux heads of GoogLeNet and Inception need their full size; the
# transformers their patch and window grids)
TORCHVISION: Dict[str, int] = {
    "alexnet": 64, "convnext_tiny": 64, "densenet121": 64, "efficientnet_b0": 64, "efficientnet_v2_s": 64,
    "googlenet": 224, "inception_v3": 299, "maxvit_t": 224, "mnasnet0_5": 64, "mobilenet_v2": 64,
    "mobilenet_v3_small": 64, "regnet_y_400mf": 64, "resnet18": 64, "resnet50": 64, "resnext50_32x4d": 64,
    "shufflenet_v2_x0_5": 64, "squeezenet1_0": 64, "swin_t": 224, "swin_v2_t": 256, "vgg11_bn": 64,
    "vit_b_16": 224,
}

MODEL_FILE = '''"""{name} from torchvision, random weights, for tools.bench.zoo."""
import torch
import torchvision
from tools.bench.zoo import loss_fn  # noqa: F401 - read by fxpipe

def model():
    torch.manual_seed(0)
    return getattr(torchvision.models, {name!r})(num_classes=10)

example_inputs = (torch.randn(2, 3, {res}, {res}, generator=torch.Generator().manual_seed(1)),)
example_targets = torch.tensor([1, 2])

def batches():
    g = torch.Generator().manual_seed(2)
    while True:
        yield (torch.randn(2, 3, {res}, {res}, generator=g),), torch.randint(0, 10, (2,), generator=g)
'''

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              max_position_embeddings=64)
_GQA = dict(_SMALL, num_key_value_heads=2)
# model -> (transformers class, its config's keyword arguments): 4 layers, width 64, vocabulary 256
TRANSFORMERS: Dict[str, tuple] = {
    "gpt2": ("GPT2LMHeadModel", dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4, bos_token_id=0,
                                     eos_token_id=0)),
    "llama": ("LlamaForCausalLM", _GQA), "mistral": ("MistralForCausalLM", _GQA),
    "qwen2": ("Qwen2ForCausalLM", _GQA), "phi3": ("Phi3ForCausalLM", dict(_GQA, pad_token_id=0)),
    "gemma": ("GemmaForCausalLM", dict(_GQA, head_dim=16)),
    "gpt_neox": ("GPTNeoXForCausalLM", _SMALL),
    "opt": ("OPTForCausalLM", dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                                   num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64)),
    "bert": ("BertForMaskedLM", _SMALL), "roberta": ("RobertaForMaskedLM", dict(_SMALL, max_position_embeddings=66)),
}

HF_MODEL_FILE = '''"""{name} from transformers (tiny config, random weights), for tools.bench.zoo."""
import torch
import transformers
from tools.bench.zoo import lm_loss as loss_fn  # noqa: F401 - read by fxpipe

def model():
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model({name!r}, **{config!r})
    config.use_cache = False  # training: no generation cache (a graph cannot carry it)
    return getattr(transformers, {cls!r})(config)

example_inputs = (torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)),)
example_targets = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))

def batches():
    g = torch.Generator().manual_seed(2)
    while True:
        yield (torch.randint(0, 256, (2, 16), generator=g),), torch.randint(0, 256, (2, 16), generator=g)
'''


def model_file(zoo: str, name: str) -> str:
    """The model file (``fxpipe train MODEL``) of ``name`` in ``zoo``."""
    if zoo == "torchvision":
        return MODEL_FILE.format(name=name, res=TORCHVISION[name])
    cls, config = TRANSFORMERS[name]
    return HF_MODEL_FILE.format(name=name, cls=cls, config=config)


def loss_fn(out, y):
    """Cross-entropy; with aux heads (GoogLeNet, Inception in training mode) 0.3 of each added."""
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return F.cross_entropy(out[0], y) + sum(0.3 * F.cross_entropy(o, y) for o in out[1:] if o is not None)
    return F.cross_entropy(out, y)


def lm_loss(out, y):
    """Token cross-entropy on a transformers model's logits."""
    logits = out["logits"] if isinstance(out, dict) else out[0]
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _rel(a: Optional[torch.Tensor], b: Optional[torch.Tensor], floor: float) -> float:
    """max |a - b| over max |b|, that at least ``floor``: a gradient that is zero in exact arithmetic (an
    attention key bias: softmax cancels it) is float noise on both sides, whose ratio means nothing."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return (a - b).abs().max().item() / max(b.abs().max().item(), floor, 1e-30)


def check(zoo: str, name: str, devices: int, folder: str) -> Dict[str, object]:
    """Split ``name`` and compare one forward and backward with the model's; save the split to ``folder``."""
    import fxpipe

    text = model_file(zoo, name)
    ns: Dict[str, object] = {}
    row: Dict[str, object] = {"model": name}
    start = time.perf_counter()
    try:
        exec(text, ns)  # noqa: S102 - our own template
        model = ns["model"]()  # type: ignore[operator]
        model.train()
        reference = copy.deepcopy(model)
        x, y, loss_fn = ns["example_inputs"], ns["example_targets"], ns["loss_fn"]
        sm = fxpipe.split(model, x, devices=devices, time_limit=5, progress=False)
    except Exception as exc:  # noqa: BLE001 - a row per model
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return row
    row["split s"] = round(time.perf_counter() - start, 1)
    row["capture"] = sm.profile.info.get("capture_method", "")
    row["nodes"] = len(sm.profile.nodes)
    row["stages"] = sm.num_stages
    torch.manual_seed(5)
    ref_loss = loss_fn(reference(*x), y)
    ref_loss.backward()
    torch.manual_seed(5)
    loss = loss_fn(fxpipe.run_local(sm, *x), y)
    loss.backward()
    ref_params, ref_bufs = dict(reference.named_parameters()), dict(reference.named_buffers())
    row["loss ÷ model's"] = round(loss.item() / ref_loss.item(), 9)
    floor = 1e-3 * max((q.grad.abs().max().item() for q in reference.parameters() if q.grad is not None),
                       default=0.0)  # a thousandth of the model's largest gradient
    row["grad diff"] = max((_rel(p.grad, ref_params[n].grad, floor) for j in range(sm.num_stages)
                            for n, p in sm.stage_parameters(j).items()), default=0.0)
    try:
        state = sm.original_state_dict([s.state_dict() for s in sm.stages])
        row["buffer diff"] = max(((state[n] - b).abs().max().item() for n, b in ref_bufs.items()
                                  if b.is_floating_point() and n in state), default=0.0)  # persistent ones
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"state_dict: {str(exc)[:160]}"
    sm.save(folder)
    with open(os.path.join(folder, "model.py"), "w") as f:
        f.write(text)
    return row


def train(folder: str, schedule: str, devices: int) -> str:
    """Exit code of a 3-step ``fxpipe train --split`` of the saved split (``--recompute all`` with zb-h1)."""
    cmd = [sys.executable, "-m", "fxpipe", "train", os.path.join(folder, "model.py"), "--split", folder,
           "--devices", str(devices), "--steps", "3", "--schedule", schedule, "--timeout", "120",
           "--save", os.path.join(folder, f"{schedule}.pt")]
    if schedule == "zb-h1":
        cmd += ["--recompute", "all"]
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        return f"rc {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:120]}"
    return "ok"


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zoo", choices=("torchvision", "transformers"), default="torchvision")
    ap.add_argument("--models", default="", help="comma-separated names (default: every model of the zoo)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--train", default="", help="schedules to train each split under, comma-separated")
    args = ap.parse_args(argv)
    try:
        importlib.import_module(args.zoo)
    except Exception as exc:  # noqa: BLE001 - ImportError, or torchvision built for another torch
        sys.exit(f"zoo: {args.zoo} does not load ({exc}); see this module's docstring for the install")
    known = TORCHVISION if args.zoo == "torchvision" else TRANSFORMERS
    names = [n for n in args.models.split(",") if n] or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"zoo: unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
    schedules = [s for s in args.train.split(",") if s]
    rows = []
    with tempfile.TemporaryDirectory(prefix="fxpipe-zoo-") as tmp:
        for i, name in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
            folder = os.path.join(tmp, name)
            row = check(args.zoo, name, args.devices, folder)
            for s in schedules:
                row[s] = train(folder, s, args.devices) if "error" not in row else ""
            rows.append(row)
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
