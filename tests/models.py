"""Small models shared by the tests: each one exercises a shape of graph.

- ``MLP``: a chain.
- ``SkipCNN``: convolutions with skip connections that jump over several
  layers, so a value crosses more than one stage boundary.
- ``TinyGPT``: embedding, causal mask, layernorm, attention, and an output
  projection tied to the input embedding (one parameter used at both ends).
- ``MultiIO``: two inputs, two outputs (a tuple), a value that is not a tensor
  (the batch size) used downstream.
- ``ControlFlow``: data-dependent ``if`` inside a submodule; symbolic tracing
  needs that submodule declared a leaf.
- ``TiedLM``: one embedding table under three module names (two lookups and
  the tied output head); ``Reused``: one module called three times.
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


class MultiIO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(4, 16)
        self.mix = nn.Linear(16, 16)
        self.out1 = nn.Linear(16, 3)
        self.out2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        n = x.size(0)
        h = torch.tanh(self.a(x)) + torch.tanh(self.b(y))
        h = torch.tanh(self.mix(h))
        flat = h.reshape(n, -1)  # a Python int (n) crosses into a later op
        return self.out1(flat), self.out2(h) * 0.5


class Gate(nn.Module):
    """Data-dependent control flow: symbolic tracing cannot see through it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return torch.tanh(self.lin(x))
        return torch.sigmoid(self.lin(x))


class ControlFlow(nn.Module):
    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.gate = Gate(dim)
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(torch.tanh(self.inp(x))))


def example(name: str) -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    """A seeded model and a matching example minibatch, by class name."""
    torch.manual_seed(0)
    if name == "MLP":
        return MLP(), (torch.randn(8, 16),)
    if name == "SkipCNN":
        return SkipCNN(), (torch.randn(4, 3, 12, 12),)
    if name == "TinyGPT":
        return TinyGPT(), (torch.randint(0, 64, (4, 16)),)
    if name == "MultiIO":
        return MultiIO(), (torch.randn(6, 8), torch.randn(6, 4))
    if name == "ControlFlow":
        return ControlFlow(), (torch.randn(5, 12),)
    raise KeyError(name)


ALL = ("MLP", "SkipCNN", "TinyGPT", "MultiIO", "ControlFlow")


class TiedLM(nn.Module):
    """A tiny language model whose embedding table has three users under three names.

    ``tok`` looks the tokens up, ``prev`` (the same table) looks up the previous
    token mid-network, and the output projection ``head`` is tied to it as in
    GPT. The split can put any two of the users in one stage and the third in
    another: a tie inside a stage and across stages at once.
    """

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.prev = nn.Embedding(vocab, dim)
        self.prev.weight = self.tok.weight
        self.l1 = nn.Linear(dim, dim)
        self.l2 = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(self.tok(idx)))
        h = torch.tanh(self.l2(h + self.prev(idx.roll(1, dims=1))))
        return self.head(h)


class Reused(nn.Module):
    """One ``Linear`` called three times (a module used more than once), around two others."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(6, dim)
        self.shared = nn.Linear(dim, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        h = torch.tanh(self.mid(torch.tanh(self.shared(h))))
        return self.out(torch.tanh(self.shared(h)))


class EncoderLM(nn.Module):
    """A language model on ``nn.TransformerEncoder``: fx keeps torch.nn modules whole, so the
    capture must trace into the encoder (and its layers and attention) for the layers to be
    split across stages. Causal mask built in forward, passed with the ``is_causal`` hint."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1), device=idx.device)
        return self.head(self.enc(self.tok(idx), mask=mask, is_causal=True))


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (encoder and decoder, pre-norm) with padding and causal masks."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.src_tok = nn.Embedding(vocab, dim)
        self.tgt_tok = nn.Embedding(vocab, dim)
        self.core = nn.Transformer(dim, heads, layers, layers, 2 * dim, dropout=0.0, batch_first=True,
                                   norm_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        pad = src == 0  # token 0 is padding
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.core(self.src_tok(src), self.tgt_tok(tgt), tgt_mask=causal, src_key_padding_mask=pad,
                      memory_key_padding_mask=pad)
        return self.head(h)
