"""The pieces of a data-parallel training loop that every chapter writes the same way."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..runtime.hardware import rank_device


def wrap_ddp(model: nn.Module, device: torch.device | None = None, **ddp_kwargs) -> DDP:
    """Move ``model`` to ``device`` (default: this rank's) and wrap it; DDP broadcasts rank 0's weights.

    On a GPU, ``device_ids`` names the one GPU this rank drives; on the CPU it must be None.
    """
    device = rank_device() if device is None else torch.device(device)
    model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)


def global_mean(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (a collective): e.g. the loss of the global batch.

    Each rank's loss is the mean over its own share; with equal shares, the mean of those
    means is the mean over the whole batch, the number a single process would print.
    """
    total = value.detach().clone()
    dist.all_reduce(total)  # the sum over ranks...
    return (total / dist.get_world_size()).item()  # ...divided by their number


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x, y, loss_fn=F.cross_entropy) -> torch.Tensor:
    """One optimizer step on a batch; under DDP, backward also averages the gradients.

    Returns the loss, detached.
    """
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def average_gradients(model: nn.Module) -> None:
    """Average every gradient over the ranks with one all-reduce of one flat buffer: DDP's
    arithmetic by hand, all gradients in a single bucket."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    for g, average in zip(grads, (flat / dist.get_world_size()).split([g.numel() for g in grads]), strict=True):
        g.copy_(average.view_as(g))
