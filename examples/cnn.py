"""A small ResNet-style CNN: fxpipe's bundled convolutional example.

Same model-file contract as ``examples/gpt.py`` (``model``, ``example_inputs``,
``loss_fn``, ``example_targets``, ``batches()``). Residual blocks give skip
connections, so values cross more than one stage boundary when split.
GroupNorm instead of BatchNorm: its result does not depend on how a
minibatch is cut into microbatches, so pipelined training can be compared
exactly with single-process training.

The task is learnable: each of the 10 classes is a fixed random 3x32x32
pattern, and an image is its class pattern plus noise.
"""
from __future__ import annotations

from typing import Iterator, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES, SIZE, BATCH = 10, 32, 8


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(4, cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.GroupNorm(4, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: Tuple[int, ...] = (16, 32, 64), classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.GroupNorm(4, widths[0]), nn.ReLU())
        layers = []
        cin = widths[0]
        for i, w in enumerate(widths):
            layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


_PATTERNS = torch.randn(CLASSES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(99))


def _sample(gen: torch.Generator, batch: int) -> Tuple[Tuple[torch.Tensor], torch.Tensor]:
    labels = torch.randint(0, CLASSES, (batch,), generator=gen)
    images = _PATTERNS[labels] + 0.8 * torch.randn(batch, 3, SIZE, SIZE, generator=gen)
    return (images,), labels


def batches(batch_size: int = BATCH, seed: int = 0) -> Iterator[Tuple[Tuple[torch.Tensor], torch.Tensor]]:
    """Endless microbatches ``((images,), labels)``, the same on every call."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield _sample(gen, batch_size)


torch.manual_seed(0)
model = ResNet()
example_inputs, example_targets = _sample(torch.Generator().manual_seed(1234), BATCH)
