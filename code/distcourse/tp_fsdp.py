"""FSDP2 with tensor parallelism in practice, chapter 10: the order of the wrappers, the root
module, and gradient clipping, each checked against one process.

1. ``parallelize``: torchtitan's order on a (dp, tp) mesh: tensor parallelism on the plain
   modules (``parallelize_module`` on "tp"), activation checkpointing around each block,
   ``torch.compile`` of each block (optional), then ``fully_shard`` on each block and on the
   root module (on "dp");
2. ``clip_grad_norm``: ``clip_grad_norm_`` for gradients that live on different meshes: one
   norm per mesh, made whole with ``full_tensor()``, then combined (torchtitan does the same),
   by the sum of p-th powers or, for ``norm_type=inf``, by the maximum;
3. ``train`` (rank function, 4 ranks as dp = 2 x tp = 2): a few SGD steps with clipping,
   checked against ``reference`` (one process, the same weights, batches and clipping);
   ``pitfalls`` (rank function): the root module left out of FSDP, and a model whose
   parameters live on two meshes.

SGD, not AdamW: its update is the clipped gradient times the learning rate, so updated
parameters can be compared to rounding (AdamW divides by each gradient's own size, which
magnifies the rounding of tiny gradients).

Builds on: tensor_parallel, meshes

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from .common.models import gpt
from .common.sharded import full
from .meshes import CommVolume
from .runtime.hardware import rank_device
from .tensor_parallel import SIZES, lm_loss, tokens, tp_plan

BATCH = 4  # sequences per step in all: each dp row trains on 2, which its 2 tp ranks share
MAX_NORM = 0.5  # below the gradient norms of the first steps, so clipping really scales them
LR = 0.1
ROOT_PARAMS = ("tok_embeddings.weight", "norm.weight", "norm.bias", "output.weight")  # the root module's own


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (checkpoint_wrapper, torch.compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def parallelize(
    model: nn.Module,
    mesh,
    *,
    sequence_parallel: bool = True,
    checkpoint: bool = True,
    compile_backend: str | None = None,
    root: bool = True,
) -> nn.Module:
    """TP, then activation checkpointing, then compile, then FSDP2: torchtitan's order.

    Each step needs what the previous one left: the TP plan names the plain modules
    (``layers.0.attention.wq``), so it goes first; checkpointing wraps a block whose layers
    already issue their TP collectives, so recomputation repeats them; compile sees the
    checkpointed block; ``fully_shard`` comes last, so its all-gathers and reduce-scatters
    stay outside the compiled and the recomputed region. ``root=False`` leaves out the
    root's ``fully_shard``: the embedding, final norm and output then belong to no FSDP unit.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], tp_plan(model, sequence_parallel=sequence_parallel))
    for i, block in enumerate(model.layers):
        if checkpoint:
            block = checkpoint_wrapper(block)
        if compile_backend is not None:
            block.compile(backend=compile_backend)  # in place: the parameter names stay
        model.layers[i] = block
        fully_shard(block, mesh=mesh["dp"])
    if root:
        fully_shard(model, mesh=mesh["dp"])
    return model


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``clip_grad_norm_`` for gradients on several meshes: the norm of all of them, then clip.

    ``torch.nn.utils.clip_grad_norm_`` stacks the norms of all gradients, which DTensor
    refuses across meshes. Here each mesh's gradients get one norm (a DTensor: its
    ``full_tensor()`` is the all-reduce of the shards' parts), plain tensors another, and the
    per-mesh norms are combined as the norm of the whole: the p-th root of the sum of their
    p-th powers, or their maximum for ``norm_type=inf`` (a sum of maxima is not a maximum).
    """
    norm_type = float(norm_type)
    groups = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = torch.stack([full(nn.utils.get_total_norm([p.grad for p in ps], norm_type)) for ps in groups.values()])
    total = norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum().pow(1.0 / norm_type)
    for ps in groups.values():
        nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def reference(steps: int = 2, max_norm: float = MAX_NORM) -> dict:
    """One process, the whole batch: losses, gradient norms, the first step's gradients before
    and after clipping, and the final parameters."""
    model = gpt(**SIZES)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, grads, clipped = [], [], {}, {}
    for step in range(steps):
        inputs, targets = tokens(step, batch=BATCH)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        clipped = clipped or {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "clipped": clipped, "params": params}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % 2:
        raise ValueError(f"a (dp, tp = 2) mesh needs an even number of ranks, got {world}")
    return init_device_mesh(rank_device().type, (world // 2, 2), mesh_dim_names=("dp", "tp"))


def _forward_backward(model, mesh, step: int, recorder=None) -> torch.Tensor:
    """One forward and backward on this rank's sequences of global batch ``step`` (its dp row's share)."""
    rows, row = mesh.size(0), mesh.get_local_rank("dp")
    part = slice(row * BATCH // rows, (row + 1) * BATCH // rows)
    inputs, targets = (t[part].to(rank_device()) for t in tokens(step, batch=BATCH))
    with recorder if recorder is not None else nullcontext():
        loss = lm_loss(model(inputs), targets)
        loss.backward()
    return loss.detach()


def _per_dimension(recorder: CommVolume, mesh) -> dict:
    """{mesh dimension: {collective: calls}} from what ``recorder`` saw."""
    names = {mesh.get_group(name).group_name: name for name in mesh.mesh_dim_names}
    counts = {}
    for r in recorder.records:
        per_kind = counts.setdefault(names.get(r["group"], "world"), {})
        per_kind[r["kind"]] = per_kind.get(r["kind"], 0) + 1
    return counts


def _meshes(model) -> list:
    """The mesh dimension names of ``model``'s parameters, each set once."""
    return sorted({p.device_mesh.mesh_dim_names for p in model.parameters()})


def _grads(model) -> dict:
    return {plain_name(n): full(p.grad).detach().cpu() for n, p in model.named_parameters()}


def train(steps: int = 2, max_norm: float = MAX_NORM, checkpoint: bool = True, compile_backend=None, mesh=None) -> dict:
    """Rank function: ``parallelize``'s recipe trained ``steps`` SGD steps with gradient clipping.

    Returns the global losses, the total gradient norms (``clip_grad_norm_`` on DTensors, all
    on the (dp, tp) mesh), the first step's full gradients and collectives per mesh
    dimension, and the full parameters at the end, for comparison with ``reference``.
    ``mesh``: a (dp, tp) mesh already made (``practice`` makes one for both of its parts).
    """
    mesh = mesh or _mesh()
    model = parallelize(gpt(**SIZES).to(rank_device()), mesh, checkpoint=checkpoint, compile_backend=compile_backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, grads, collectives = [], [], {}, {}
    for step in range(steps):
        recorder = CommVolume() if step == 0 else None
        loss = _forward_backward(model, mesh, step, recorder)
        if step == 0:
            grads, collectives = _grads(model), _per_dimension(recorder, mesh)
        norms.append(full(nn.utils.clip_grad_norm_(model.parameters(), max_norm)).item())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss)  # the tp peers of a row hold equal losses: the mean over all ranks is the batch's
        losses.append(loss.item() / dist.get_world_size())
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "collectives": collectives,
        "meshes": _meshes(model),
        "params": {plain_name(n): full(p).detach().cpu() for n, p in model.named_parameters()},
    }


def _torch_clip_error(model, max_norm: float) -> str | None:
    """What ``torch.nn.utils.clip_grad_norm_`` says about ``model``'s gradients: None if it clips them."""
    try:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def variants(max_norm: float = MAX_NORM, mesh=None) -> dict:
    """Rank function: one forward and backward each of three variants of ``parallelize``.

    "no root": the recipe without ``fully_shard`` on the root module. The embedding, final
    norm and output stay TP-only DTensors on the "tp" mesh, and nothing reduces their
    gradients across "dp"; returned with this rank's dp index and what ``clip_grad_norm_``
    says about the two meshes.
    "no checkpointing": the recipe without activation checkpointing: its collectives per
    mesh dimension, to compare with ``train``'s.
    "two meshes": TP without sequence parallelism, so the norms are not in the TP plan and
    FSDP puts them on the 1-D "dp" mesh while the rest lives on (dp, tp): ``clip_grad_norm_``
    refuses, ``clip_grad_norm`` (one norm per mesh) clips; its norm and the clipped
    gradients are returned.
    """
    mesh = mesh or _mesh()
    build = lambda **options: parallelize(gpt(**SIZES).to(rank_device()), mesh, **options)  # noqa: E731
    no_root = build(root=False)
    _forward_backward(no_root, mesh, 0)
    plain = build(checkpoint=False)
    recorder = CommVolume()
    _forward_backward(plain, mesh, 0, recorder)
    two = build(sequence_parallel=False, checkpoint=False)
    _forward_backward(two, mesh, 0)
    error = _torch_clip_error(two, max_norm)
    return {
        "no root": {
            "dp": mesh.get_local_rank("dp"),
            "grads": {n: g for n, g in _grads(no_root).items() if n in ROOT_PARAMS},
            "meshes": _meshes(no_root),
            "clip error": _torch_clip_error(no_root, max_norm),
        },
        "no checkpointing": {"collectives": _per_dimension(recorder, mesh)},
        "two meshes": {
            "meshes": _meshes(two),
            "clip error": error,
            "norm": clip_grad_norm(two.parameters(), max_norm).item(),
            "clipped grads": _grads(two),
        },
    }


def practice(steps: int = 2, max_norm: float = MAX_NORM) -> dict:
    """Rank function: ``train`` and ``variants`` in one launch (starting 4 ranks costs more than this model's steps)."""
    mesh = _mesh()  # one mesh for both parts: collectives are told apart by their process groups
    return {"train": train(steps, max_norm, mesh=mesh)} | variants(max_norm, mesh=mesh)
