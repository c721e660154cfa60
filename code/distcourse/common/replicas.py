"""Data-parallel replicas: this rank's share of a batch, and comparing what the replicas hold.

Chapters 02 and 04 check the same things again and again: that every replica ends a step
with the same parameters, and how far two lists of tensors are apart.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from ..runtime.hardware import rank_device


def params_of(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters, detached, on the CPU (to compare models across devices)."""
    return [p.detach().cpu() for p in model.parameters()]


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    """The model's gradients, copied to the CPU (the next backward would add to them)."""
    return [p.grad.detach().cpu().clone() for p in model.parameters()]


def max_gap(a, b) -> float:
    """Largest absolute difference between two lists of tensors of the same shapes."""
    return max((p.cpu() - q.cpu()).abs().max().item() for p, q in zip(a, b))


def my_share(x: torch.Tensor, y: torch.Tensor):
    """This rank's samples of a batch, as a ``DistributedSampler`` without shuffling deals
    them: rank r gets samples r, r + W, r + 2W, ..."""
    index = list(DistributedSampler(range(len(x)), shuffle=False))
    return x[index].to(rank_device()), y[index].to(rank_device()), index
