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
from ..runtime import gpus
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
        # sequence parallelism: the norms too run on the (dp, tp) mesh, on their share of tokens,
        # so every parameter lives on one mesh and clipping sees one set of gradients
        parallelize_module(model, mesh["tp"], tp_plan(model, sequence_parallel=True))
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


def profile_of(device: torch.device):
    """The GPU profile of ``device`` (``runtime.gpus``), None on a CPU; asks CUDA only on a GPU."""
    return gpus.current(device) if device.type == "cuda" else None


def choose_precision(requested: str, profile) -> str:
    """``--precision auto``: what the device's profile says it computes fast
    (``gpus.training_precision``): bf16 with bf16 tensor cores (sm >= 80), fp16 with a gradient
    scaler on a GPU without them (T4, V100: they can store bf16, by emulation, but not multiply
    it fast), fp32 on a CPU, where conversions to and from 16 bits often cost more than they save."""
    return gpus.training_precision(profile) if requested == "auto" else requested


def autocast(device: torch.device, precision: str):
    """The autocast context for ``precision`` ("auto" is decided from the device's profile),
    and the precision decided."""
    precision = choose_precision(precision, profile_of(device))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32"), precision
