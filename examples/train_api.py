"""Pipeline-parallel training from your own script: ``python examples/train_api.py``.

A small MLP learns a fixed random teacher network on 2 local workers (two
pipeline stages, 1F1B with a flush), then the trained weights are back in
``model``. What the workers need travels by name, so the model class, the
data function and the loss are defined at module level, and the training
call sits under ``if __name__ == "__main__":`` (each worker runs this file to
find them). Options: ``--steps N``, ``--float64``, ``--save FILE.pt``.
"""
from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe

FEATURES, HIDDEN, OUT, MICRO, MICROBATCHES = 16, 64, 4, 8, 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                    nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def batches(dtype: torch.dtype = torch.float32) -> Iterator[Tuple[Tuple[torch.Tensor], torch.Tensor]]:
    """One step of MICROBATCHES microbatches at a time; seeded, so every rank reads the same data."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(FEATURES, OUT, generator=g, dtype=dtype)
    for _ in range(100):
        x = torch.randn(MICRO * MICROBATCHES, FEATURES, generator=g, dtype=dtype)
        yield (x,), torch.tanh(x @ teacher)


def batches64() -> Iterator[Tuple[Tuple[torch.Tensor], torch.Tensor]]:
    return batches(torch.float64)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs, targets)


def make_model(dtype: torch.dtype = torch.float32) -> MLP:
    torch.manual_seed(0)
    return MLP().to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    dtype = torch.float64 if args.float64 else torch.float32
    model = make_model(dtype)
    example = next(batches(dtype))[0][0][:MICRO]  # one microbatch: each item of batches() is a whole step
    out = fxpipe.train(model, batches64 if args.float64 else batches, loss_fn=loss_fn, example_inputs=(example,),
                       devices=2, microbatches=MICROBATCHES, steps=args.steps, schedule="1f1b-flush",
                       optimizer="sgd", lr=0.2, save=args.save, replication="none", time_limit=5, threads=1)
    print(f"stages: {out.plan.num_stages}; loss per step: " + " ".join(f"{x:.4f}" for x in out.losses))
    print(f"loss {out.losses[0]:.4f} -> {out.losses[-1]:.4f}; the trained weights are in model "
          f"(layers.0.weight sum {model.layers[0].weight.sum().item():.4f})")


if __name__ == "__main__":
    main()
