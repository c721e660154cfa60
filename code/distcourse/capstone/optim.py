"""The optimizer and what a real job wraps around it: weight-decay groups, a learning-rate
schedule, gradient clipping, and the gradient scaler of fp16.

torchtitan's ``optimizer`` and ``lr_scheduler`` components, in small:

- ``param_groups``: AdamW's weight decay on the **matrices of linear layers** only. Decay
  pulls a weight towards zero; for a matrix that multiplies activations that limits how large
  the layer's outputs can get (GPT-2, nanoGPT and torchtitan's recipes decay these). Norm
  weights and biases (1-D) are scales and shifts, not features: decaying them only fights the
  normalisation. The embedding is a table that a batch reads a few rows of: decay would shrink
  every row each step while only the rows of bytes in the batch get gradient, so rare bytes
  fade (Megatron and many GPT recipes leave it out too).
- ``schedule``: linear warm-up for ``--warmup`` steps, then cosine decay to 10 % of ``--lr`` at
  ``--steps``. AdamW's first steps divide by second moments estimated from one or two
  gradients; a small learning rate while those estimates settle avoids a blow-up at the start.
- ``clip``: clipping of the whole model's gradient 2-norm to ``--max-norm``. Under FSDP2 the
  gradients are DTensor shards; with ``--tp`` every parameter lives on the (dp, tp) mesh
  (sequence parallelism puts the norms there too), and chapter 10's ``clip_grad_norm``
  combines the norms of any meshes a model has.
- ``scaler``: fp16's ``GradScaler`` (``ShardedGradScaler`` under FSDP2, which agrees on
  overflows across ranks): fp16 has 5 exponent bits, so small gradients underflow to zero
  unless the loss is multiplied up first and the gradients divided back before the step.

Builds on: tp_fsdp (chapter 10's ``clip_grad_norm``)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..tp_fsdp import clip_grad_norm

FLOOR = 0.1  # the cosine ends at this fraction of --lr, not at 0: the last steps still learn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two groups: the linear layers' weights decay, everything else does not."""
    decay = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    chosen = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def decayed_names(model: nn.Module, weight_decay: float = 0.1) -> set[str]:
    """The names of the parameters ``param_groups`` decays (for a reader, and the tests)."""
    chosen = {id(p) for p in param_groups(model, weight_decay)[0]["params"]}
    return {name for name, p in model.named_parameters() if id(p) in chosen}


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """The learning rate at ``step``, as a fraction of ``--lr``: warm-up, then cosine."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step + 1 - warmup) / max(1, steps - warmup)  # the last step trains at FLOOR x --lr
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: nn.Module, args):
    """AdamW over ``param_groups`` and its schedule, a ``LambdaLR`` stepped once per step."""
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args.warmup, args.steps))
    return optimizer, scheduler


def clip(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip the gradients to a total 2-norm of ``max_norm`` (0 or None: measure only);
    returns the norm before clipping, the same on every rank."""
    return clip_grad_norm(list(model.parameters()), max_norm or math.inf)


def grad_scaler(device: torch.device, precision: str):
    """fp16's loss scaler; for bf16 and fp32 a disabled one (its calls then do nothing)."""
    if precision == "fp16" and dist.is_initialized():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
