"""The model on its mesh: torchtitan's ``parallelize`` for the course's GPT, and its precision.

``build_model`` applies, in torchtitan's order, tensor parallelism on the plain modules (with
``--tp``), activation checkpointing around each block (``--activation-checkpointing``), then
FSDP2 on each block and on the root (on the ``dp`` mesh dimension). Every one of them is a flag.

Builds on: tensor_parallel (chapter 10's ``tp_plan``)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..common.models import gpt
from ..tensor_parallel import tp_plan
from .config import VOCAB


def build_model(args, device: torch.device, world_size: int):
    """The GPT, parallelised for ``world_size`` ranks; returns (model, data-parallel size, its rank)."""
    model = gpt(args.seed, vocab=VOCAB, hidden=args.hidden, heads=args.heads, layers=args.layers).to(device)
    if not dist.is_initialized():
        if args.tp > 1:
            raise ValueError(f"--tp {args.tp} needs {args.tp} or more ranks: start the script with torchrun")
        return checkpoint_blocks(model) if args.activation_checkpointing else model, 1, 0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if world_size % args.tp or args.heads % args.tp:
        raise ValueError(f"--tp {args.tp} must divide the world size ({world_size}) and --heads ({args.heads})")
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    # torchtitan's order: tensor parallelism on the plain modules (the plan names them), then
    # activation checkpointing around each block, then FSDP2 around the checkpointed blocks.
    if args.tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(model))
    if args.activation_checkpointing:
        model = checkpoint_blocks(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])  # one all-gather per block, freed after use
    fully_shard(model, mesh=mesh["dp"])  # embedding, final norm and output
    return model, mesh["dp"].size(), mesh["dp"].get_local_rank()


def checkpoint_blocks(model):
    """Activation checkpointing per block (torchtitan's ``checkpoint_wrapper``): backward keeps
    only each block's input and runs the block's forward again to get the rest."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
    return model


def autocast(device: torch.device, precision: str):
    """bf16 autocast where it pays: on GPUs, whose matrix units run bf16 faster than fp32. On a
    CPU the conversions to and from bf16 often cost more than they save (chapter 12, part 2,
    measures the ratio on the machine it runs on)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"), precision
