"""The models the chapters train: one small multilayer perceptron, in a few sizes.

Every chapter needs *a* model, not a particular one: what it demonstrates (gradients
averaged, states sharded, checkpoints resumed) holds for any. One factory keeps them
alike, so a learner who has read it once recognises the model in every chapter.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(
    width: int = 32,
    depth: int = 1,
    *,
    inputs: int = 64,
    outputs: int = 10,
    batchnorm: bool = False,
    dropout: float = 0.0,
    seed: int | None = 0,
) -> nn.Sequential:
    """``depth`` hidden layers of ``width`` units (Linear, [BatchNorm1d], ReLU, [Dropout]), then a Linear.

    The defaults classify 8x8 digits: 64 inputs, 10 classes. The same ``seed`` gives the
    same initial weights in any process, and the caller's random state is left alone;
    ``seed=None`` draws the weights from the caller's generator instead (e.g. after a
    ``torch.manual_seed(rank)`` that wants different weights on every rank).
    """
    if seed is None:
        return _layers(width, depth, inputs, outputs, batchnorm, dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _layers(width, depth, inputs, outputs, batchnorm, dropout)


def _layers(width, depth, inputs, outputs, batchnorm, dropout) -> nn.Sequential:
    layers, size = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width)] + ([nn.BatchNorm1d(width)] if batchnorm else []) + [nn.ReLU()]
        layers += [nn.Dropout(dropout)] if dropout else []
        size = width
    return nn.Sequential(*layers, nn.Linear(size, outputs))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a 4x-wide GELU MLP.

    ``attention="naive"`` writes attention out (scores, mask, softmax, weighted sum), the way
    textbooks do, so that its (s x s) score matrices exist and can be counted; ``"sdpa"``
    calls ``F.scaled_dot_product_attention``, whose fused kernel never stores them.
    """

    def __init__(self, hidden: int, heads: int, attention: str = "naive"):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        if attention not in ("naive", "sdpa"):
            raise ValueError(f"attention must be 'naive' or 'sdpa', got {attention!r}")
        self.heads, self.attention = heads, attention
        self.ln1, self.qkv, self.proj = nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.ln2, self.fc1, self.fc2 = (
            nn.LayerNorm(hidden),
            nn.Linear(hidden, 4 * hidden),
            nn.Linear(4 * hidden, hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / (h // self.heads) ** 0.5
            future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)  # a token sees no later token
            y = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def transformer(
    hidden: int = 64, heads: int = 4, layers: int = 2, *, attention: str = "naive", seed: int | None = 0
) -> nn.Sequential:
    """``layers`` transformer blocks that map (batch, sequence, hidden) to the same shape.

    No embedding and no output head: what the memory chapters count lives in the blocks.
    The same ``seed`` gives the same weights in every process (see ``mlp``).
    """
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        return nn.Sequential(*(Block(hidden, heads, attention) for _ in range(layers)))


# --------------------------------------------------------------------------------------
# A small GPT: the layout that tensor parallelism splits (chapters 10 and 12)
# --------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal self-attention with separate query, key, value and output projections.

    Separate ``wq``, ``wk``, ``wv`` (not one fused ``qkv``) because tensor parallelism splits
    them by output rows: with a fused weight, rank 0's half would hold all queries and half
    the keys. The number of heads is read from the weights (``-1`` in ``view``), so the same
    code runs whole, or on a rank that holds ``heads / tp`` of them.
    """

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.wo = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """The 4x-wide GELU MLP of a transformer block: ``w2(gelu(w1(x)))``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.gelu(self.w1(x)))


class GPTBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attention(norm(x))``, then ``x + feed_forward(norm(x))``."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(hidden), Attention(hidden, heads)
        self.ffn_norm, self.feed_forward = nn.LayerNorm(hidden), FeedForward(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and an output projection to the vocabulary.

    No position embedding: with a causal mask a decoder can infer positions by itself
    (Haviv et al. 2022, "Transformer language models without positional encodings still
    learn positional information"), and it keeps every tensor splittable along the sequence.
    """

    def __init__(self, vocab: int = 256, hidden: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(GPTBlock(hidden, heads) for _ in range(layers))
        self.norm, self.output = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def gpt(seed: int | None = 0, **sizes) -> GPT:
    """A ``GPT`` whose weights depend only on ``seed`` (see ``mlp``); ``sizes`` go to ``GPT``."""
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        return GPT(**sizes)
