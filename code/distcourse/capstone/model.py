"""The model's two uses outside training: its loss on a batch, and text sampled from it.

The GPT itself is the course's (``common/models.py``, chapter 10's): a byte-level vocabulary
of 256, so any text in any language is valid input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.models import gpt
from .config import VOCAB

__all__ = ["VOCAB", "generate", "gpt", "loss_of"]


def loss_of(model, inputs, targets) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def generate(model, prompt: str, length: int, context: int, seed: int = 0, temperature: float = 0.8) -> str:
    """Sample ``length`` bytes after ``prompt``, one at a time, seeing at most ``context`` bytes."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt.encode("utf-8"))
    for _ in range(length):
        logits = model(torch.tensor([tokens[-context:]]))[0, -1].float()
        probabilities = torch.softmax(logits / temperature, dim=-1)
        tokens.append(torch.multinomial(probabilities, 1, generator=generator).item())
    return bytes(tokens).decode("utf-8", errors="replace")
