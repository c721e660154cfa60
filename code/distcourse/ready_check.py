"""A first DistributedDataParallel step, used to check that a machine is ready."""

import torch
import torch.distributed as dist
from torch import nn

from .common.models import mlp
from .common.training import wrap_ddp
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr


def ddp_step(seed: int = 0, batch_size: int = 8):
    """One training step of a tiny model under DDP; every rank sees different data.

    Returns what the notebook checks: each rank's loss (different) and its
    parameters after the step (identical, because DDP averaged the gradients).
    """
    rank, device = dist.get_rank(), rank_device()
    model = mlp(width=16, inputs=8, outputs=1, seed=seed)  # same weights everywhere (DDP also broadcasts rank 0's)
    ddp = wrap_ddp(model, device)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(1000 + rank)  # a different shard of data per rank
    x = torch.randn(batch_size, 8, generator=generator).to(device)
    y = torch.randn(batch_size, 1, generator=generator).to(device)
    loss = nn.functional.mse_loss(ddp(x), y)
    loss.backward()  # DDP all-reduces (averages) the gradients during backward
    optimizer.step()
    text = tr("rank {rank}/{world} on {device} ({backend}): loss {loss}")
    print(
        text.format(
            rank=rank,
            world=dist.get_world_size(),
            device=device,
            backend=dist.get_backend(),
            loss=number(loss.item(), 4),
        )
    )
    return {"loss": loss.item(), "params": [p.detach().cpu() for p in model.parameters()]}
