"""``quant demo --model gpt``: a small decoder-only transformer on a character corpus.

The corpus is generated in-process from a fixed grammar (no download): sentences about a few
animals doing a few things, so a small model learns it in minutes and a gap between recipes
shows. The model is built from plain ``torch.nn`` layers and quantized with
:func:`quant_recipes.convert`, as a user would quantize a model they already have; its output
head stays in high precision (convert's default rule).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn

#: (layers, d_model, heads, sequence length, batch) per device type.
SIZES = {"cpu": (2, 128, 4, 32, 8), "cuda": (12, 2048, 16, 512, 8)}

_SUBJECTS = ["the fox", "a dog", "the old cat", "my owl", "a small bird", "the horse"]
_VERBS = ["jumps over", "runs past", "looks at", "sleeps near", "sings to", "follows"]
_OBJECTS = ["the fence", "a red barn", "the river", "two sheep", "the moon", "a tall tree"]
_ENDS = [".", " today.", " at night.", " again.", " in the rain."]


def corpus(chars: int, seed: int = 0) -> str:
    """At least ``chars`` characters of generated sentences (the same text for a seed)."""
    rng = random.Random(seed)
    parts, n = [], 0
    while n < chars:
        s = (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
             f"{rng.choice(_ENDS)} ")
        parts.append(s)
        n += len(s)
    return "".join(parts)


class Block(nn.Module):
    """Pre-norm attention and MLP with residuals; causal attention through SDPA."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, layers: int, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln(x))


class GPTTask:
    """Next-character prediction: batches of ``(ids, targets)``, cross-entropy, a held-out
    tenth of the corpus for the validation loss."""

    name = "gpt"
    loss_label = "cross-entropy"

    def __init__(self, device: torch.device, seed: int, batch: int | None = None) -> None:
        layers, d, heads, seq, default_batch = SIZES["cuda" if device.type == "cuda" else "cpu"]
        self.shape = (layers, d, heads, seq)
        self.batch = batch or default_batch
        text = corpus(200_000, seed)
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        cut = len(ids) * 9 // 10
        self.train_ids, self.val_ids = ids[:cut], ids[cut:]
        self.device, self.seed = device, seed
        self.tokens_per_step = self.batch * seq

    def model(self, dtype: torch.dtype) -> nn.Module:
        layers, d, heads, seq = self.shape
        return GPT(len(self.vocab), layers, d, heads, seq).to(self.device, dtype)

    def _sample(self, ids: torch.Tensor, gen: torch.Generator):
        seq = self.shape[3]
        start = torch.randint(0, len(ids) - seq - 1, (self.batch,), generator=gen)
        rows = torch.stack([ids[s:s + seq + 1] for s in start.tolist()]).to(self.device)
        return rows[:, :-1], rows[:, 1:]

    def batches(self, steps: int):
        gen = torch.Generator().manual_seed(self.seed + 2)
        for _ in range(steps):
            yield self._sample(self.train_ids, gen)

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, 1), target.flatten())

    @torch.no_grad()
    def validate(self, forward) -> float:
        """Mean loss of ``forward`` over 4 fixed held-out batches."""
        gen = torch.Generator().manual_seed(self.seed + 3)
        losses = [self.loss(forward(x), y).item()
                  for x, y in (self._sample(self.val_ids, gen) for _ in range(4))]
        return sum(losses) / len(losses) if all(map(math.isfinite, losses)) else float("nan")
