"""Small models shared by the tests: each one exercises a shape of graph.

``MLP`` (a chain), ``SkipCNN`` (skips over several layers) and ``TinyGPT``
(attention, tied embedding) are the benchmarks' models (``tools/bench/models.py``);
the others are here:

- ``MultiIO``: two inputs, two outputs (a tuple), a value that is not a tensor
  (the batch size) used downstream.
- ``ControlFlow``: data-dependent ``if`` inside a submodule; symbolic tracing
  needs that submodule declared a leaf.
- ``TiedLM``: one embedding table under three module names (two lookups and
  the tied output head); ``Reused``: one module called three times.
- ``PosNet``: makes a tensor on its input's device, which ``torch.export``
  writes into the graph as a constant (the capture device).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

from tools.bench import models as bench
from tools.bench.models import MLP, SkipCNN, TinyGPT

__all__ = ["ALL", "ControlFlow", "EncoderLM", "Gate", "MLP", "MultiIO", "PosNet", "Reused", "Seq2Seq", "SkipCNN",
           "TiedLM", "TinyGPT", "example"]


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
    if name in bench.ALL:
        return bench.example(name)
    torch.manual_seed(0)
    if name == "MultiIO":
        return MultiIO(), (torch.randn(6, 8), torch.randn(6, 4))
    if name == "ControlFlow":
        return ControlFlow(), (torch.randn(5, 12),)
    raise KeyError(name)


ALL = bench.ALL + ("MultiIO", "ControlFlow")


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


class PosNet(nn.Module):
    """Adds a position ramp made on the input's device, 6 features in, 3 out (``torch.export`` records
    ``device=`` of the ramp as a constant of the graph, the device it was captured on)."""

    def __init__(self, hidden: int = 12) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, hidden), nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ramp = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)
        return self.b(torch.tanh(self.a(x + 0.1 * ramp)))


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
