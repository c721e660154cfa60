"""Models whose tensors are split across ranks (FSDP2, DTensor): helpers written once.

Chapter 08 introduces them; chapters 09 and 10 build on them:

- ``local_part`` and ``full``: the piece of a tensor this rank stores, and the whole tensor;
- ``count_collectives``: what ``CommDebugMode`` counted, under plain names;
- ``make_model``, ``rank_batch`` and ``shard_model``: chapter 08's MLP, this rank's share of
  a fixed global batch, and FSDP2 applied layer by layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.hardware import rank_device
from .models import mlp


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from its shards (a collective), else the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def count_collectives(comm_mode) -> dict:
    """``CommDebugMode``'s counts under plain names (all-gather, reduce-scatter, all-reduce,
    all-to-all), whether the collective came through ``torch.distributed`` or DTensor."""
    plain = {"all_gather": "all-gather", "allgather": "all-gather", "reduce_scatter": "reduce-scatter"}
    plain |= {
        "all_reduce": "all-reduce",
        "allreduce": "all-reduce",
        "all_to_all": "all-to-all",
        "alltoall": "all-to-all",
    }
    out = {}
    for op, n in comm_mode.get_comm_counts().items():
        name = next((p for key, p in plain.items() if key in str(op)), str(op))
        out[name] = out.get(name, 0) + n
    return out


def make_model(hidden: int = 256) -> nn.Module:
    """An MLP for 8x8 digit images; every weight's first dimension is even, so 2 ranks split it exactly."""
    return mlp(width=hidden, depth=2, seed=0)  # the same initial weights in every rank and in the reference


def rank_batch(rank: int, world_size: int, step: int = 0, batch_size: int = 32):
    """This rank's part of global batch ``step``: a fixed random tensor shared by all runs."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch_size * world_size, 64, generator=generator)
    y = torch.randint(0, 10, (batch_size * world_size,), generator=generator)
    part = slice(rank * batch_size, (rank + 1) * batch_size)
    return x[part], y[part]


def shard_model(model: nn.Module, mp_policy=None, **options) -> nn.Module:
    """FSDP2: shard every Linear as its own unit, then the root (which owns what is left).

    Per-layer units are what keeps memory low during the forward pass: only the layer
    that is computing is gathered whole, then its full weights are freed again.
    ``mp_policy``: a ``MixedPrecisionPolicy`` for every unit (chapter 09); None keeps fp32.
    ``options`` go to every ``fully_shard`` call (chapter 09: ``reshard_after_forward``,
    ``offload_policy``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    policy = ({"mp_policy": mp_policy} if mp_policy is not None else {}) | options
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model
