"""A small GPT-style language model: fxpipe's bundled transformer example.

Model-file contract (what ``fxpipe`` reads from this file):

- ``model``: the ``nn.Module`` to train;
- ``example_inputs``: a tuple with ONE microbatch of inputs (token ids);
- ``loss_fn(outputs, targets)`` and ``example_targets`` (targets for that microbatch);
- ``batches()``: an endless stream of ``(inputs, targets)`` microbatches from a
  fixed seed, so every run (and every pipeline rank) sees the same data.

The task is learnable, so a short run shows the loss falling: each sequence
counts up from a random start with a random stride (mod the vocabulary), and
the model predicts the next token.

Size: 4 layers, width 64, 4 heads, context 32, vocabulary 128, microbatch 8:
about 0.2 M parameters, a few milliseconds per step on one CPU core.
"""
from __future__ import annotations

import math
from typing import Iterator, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS, CONTEXT, BATCH = 128, 64, 4, 4, 32, 8


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones_like(att[0, 0], dtype=torch.bool).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, context)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS,
                 layers: int = LAYERS, context: int = CONTEXT) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, context) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embedding
        nn.init.normal_(self.tok.weight, std=0.02)  # small logits at the start, as GPT-2 does
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln_f(self.blocks(x)))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _sample(gen: torch.Generator, batch: int) -> Tuple[Tuple[torch.Tensor], torch.Tensor]:
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    seq = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB
    return (seq[:, :-1].contiguous(),), seq[:, 1:].contiguous()


def batches(batch_size: int = BATCH, seed: int = 0) -> Iterator[Tuple[Tuple[torch.Tensor], torch.Tensor]]:
    """Endless microbatches ``((tokens,), next_tokens)``, the same on every call."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield _sample(gen, batch_size)


torch.manual_seed(0)
model = GPT()
example_inputs, example_targets = _sample(torch.Generator().manual_seed(1234), BATCH)
