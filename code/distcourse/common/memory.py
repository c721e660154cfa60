"""Bytes of model states and activations: the formulas, and the counts to check them with.

- ``zero_bytes``: the model states (weights, gradients, Adam's states) one rank holds under
  each ZeRO stage (chapter 08), in bytes per parameter ``MIXED_ADAM`` or ``FP32_ADAM``
  (``LAYOUTS`` names them after the frameworks that use them, chapter 09);
- ``local_bytes``: the bytes of tensors this rank really holds (a DTensor: its shard only);
- ``saved_bytes``: the bytes autograd keeps for backward, counted with hooks (chapter 09);
- ``block_formula``: the same number for one transformer block, predicted from the shapes.

Chapters 08, 09 and 10 all count memory with these, so they are written once, here.
"""

from __future__ import annotations

import torch

from .sharded import local_part

# Bytes per parameter for Adam. Mixed precision as in the ZeRO paper, DeepSpeed and Megatron:
# 16-bit weights and gradients for the forward and backward pass, and in the optimizer an
# fp32 master copy of the weights plus Adam's two moments (4 + 4 + 4). Plain fp32: the
# weights are their own master copy. PyTorch's own mixed precision (autocast, FSDP2's
# MixedPrecisionPolicy) keeps fp32 weights and gradients, so it holds FP32_ADAM too: the
# 16-bit copies exist only while a layer computes. Both sum to 16 bytes, but they shard
# differently: ZeRO stages 1 and 2 leave different amounts on each rank.
MIXED_ADAM = {"params": 2, "grads": 2, "optimizer": 12}
FP32_ADAM = {"params": 4, "grads": 4, "optimizer": 8}
LAYOUTS = {"pytorch": FP32_ADAM, "master weights": MIXED_ADAM}
PARTS = ("params", "grads", "optimizer")


def zero_bytes(num_params: int, world_size: int, stage: int, bytes_per_param: dict = MIXED_ADAM) -> dict:
    """Bytes of model states one rank holds under ZeRO ``stage`` (0 = plain DDP).

    Stage 1 shards the optimizer state over the ranks, stage 2 also the gradients,
    stage 3 (FSDP) also the parameters; what is not sharded is a full copy per rank.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    sharded_from = {"optimizer": 1, "grads": 2, "params": 3}  # the first stage that shards each part
    out = {}
    for part in PARTS:
        total = num_params * bytes_per_param[part]
        out[part] = total / world_size if stage >= sharded_from[part] else total
    return out


def local_bytes(tensors) -> int:
    """Bytes of the elements this rank holds (its shard of a sharded tensor)."""
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)


def saved_bytes(fn, parameters=()) -> tuple[int, object]:
    """Run ``fn()`` and return (bytes autograd saved for backward, fn's result).

    Parameters are left out (they exist anyway); so is anything saved twice: the bytes
    are those of the distinct memory blocks behind the saved tensors. For a DTensor, the
    block behind this rank's local part.
    """
    mine = {ptr for p in parameters for ptr, _ in _storages(p)}
    blocks = {}

    def pack(t):
        for ptr, nbytes in _storages(t):
            if ptr not in mine:
                blocks[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return sum(blocks.values()), result


def _storages(t: torch.Tensor):
    """(data pointer, bytes) of the memory behind ``t``.

    A tensor subclass that wraps others (a DTensor, chapter 10: the shard this rank keeps;
    the pending result of a functional collective) owns no memory itself: its inner tensors do.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [block for x in inner if isinstance(x, torch.Tensor) for block in _storages(x)]
    storage = t.untyped_storage()
    return [(storage.data_ptr(), storage.nbytes())]


def block_formula(batch: int, seq: int, hidden: int, heads: int, attention: str = "naive", bytes_: int = 4) -> int:
    """Bytes one ``common.models.Block`` saves for backward, from the shapes alone.

    With b = batch, s = sequence, h = hidden, a = heads, in elements of ``bytes_`` bytes:

    - 16 b·s·h: the inputs of both LayerNorms, qkv, proj, fc1 (h each), fc2 and GELU (4h each),
      and the query, key and value that attention keeps (3h, as copies or as one qkv block);
    - 4 b·s: each LayerNorm's mean and 1/std per token (kept in fp32);
    - naive attention: the softmax output a·b·s², plus the boolean causal mask (s² bytes);
    - fused attention (sdpa): one log-sum-exp per head and token, a·b·s; no s x s matrix.
    """
    per_token = 16 * hidden * bytes_ + 4 * 4
    total = batch * seq * per_token
    if attention == "naive":
        return total + heads * batch * seq * seq * bytes_ + seq * seq
    if attention == "sdpa":
        return total + heads * batch * seq * 4
    raise ValueError(f"attention must be 'naive' or 'sdpa', got {attention!r}")
