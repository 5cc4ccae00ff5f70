"""Models the benchmarks measure, each a shape of graph; the tests use them too.

- ``MLP``: a chain.
- ``SkipCNN``: convolutions with skip connections that jump over several
  layers, so a value crosses more than one stage boundary.
- ``TinyGPT``: embedding, causal mask, layernorm, attention, and an output
  projection tied to the input embedding (one parameter used at both ends).
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dims: Tuple[int, ...] = (16, 32, 32, 32, 32, 8)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class SkipCNN(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(6))
        self.norm = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        skip = x
        for i, conv in enumerate(self.convs):
            x = torch.tanh(conv(x))
            if i == 4:
                x = x + skip  # jumps over five convolutions
        x = self.norm(x)
        x = x.mean(dim=(2, 3))
        return self.head(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = 1.0 / math.sqrt(dim // heads)
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale
        mask = torch.ones_like(att[0, 0], dtype=torch.bool).triu(diagonal=1)  # causal
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 4, ctx: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ctx) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight  # tied input/output embedding

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def example(name: str) -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    """A seeded model and a matching example minibatch, by class name."""
    torch.manual_seed(0)
    if name == "MLP":
        return MLP(), (torch.randn(8, 16),)
    if name == "SkipCNN":
        return SkipCNN(), (torch.randn(4, 3, 12, 12),)
    if name == "TinyGPT":
        return TinyGPT(), (torch.randint(0, 64, (4, 16)),)
    raise KeyError(name)


ALL = ("MLP", "SkipCNN", "TinyGPT")
