"""FSDP2 in practice, chapter 09 (second part): what a training loop adds to ``fully_shard``.

Rank functions, each on chapter 08's MLP sharded layer by layer (``common.sharded.shard_model``)
and each checked against ``reference``, the same computation in one process:

- ``clip``: ``clip_grad_norm_`` on sharded gradients (DTensors) computes the norm of the
  *whole* gradient, across shards;
- ``accumulate``: gradient accumulation over micro-batches, with a reduce-scatter after
  every micro-batch or only after the last (``set_requires_gradient_sync``);
- ``reshard``: ``reshard_after_forward`` True or False, the collectives of a step and the
  weights held between forward and backward;
- ``offload``: ``CPUOffloadPolicy``, and why its default (pinned memory) needs a GPU;
- ``token_mean``: the loss of batches with uneven numbers of valid targets, averaged per
  rank (biased) and per token over all ranks (what one process computes, ``token_reference``);
- ``divide_factor``: the same per-token loss with the reduction's division switched off by
  ``set_gradient_divide_factor(1.0)``, on the root only or on every FSDP module;
- ``forward_prefetch``: ``set_modules_to_forward_prefetch``, the order in which it issues the
  forward all-gathers, and which weights the root keeps after forward by default.

Collectives are counted with ``CommDebugMode``, which sees every collective issued through
``torch.distributed`` while it is active. Rank functions live here because rank processes
import them by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .common.memory import local_bytes
from .common.models import mlp
from .common.sharded import count_collectives, full, local_part, make_model, rank_batch, shard_model
from .runtime.hardware import rank_device
from .runtime.i18n import tr

LAYERS = 3  # Linear layers in make_model(): each is one FSDP unit


def label(key: str) -> str:
    """A mode of ``accumulate`` or ``token_mean`` as the reader sees it."""
    words = {
        "every": tr("sync every micro-batch"),
        "last": tr("sync on the last"),
        "last, unsharded": tr("sync on the last, weights kept"),
        "mean of means": tr("mean of each rank's mean"),
        "per token": tr("mean over all tokens"),
    }
    return words.get(key, key)


def micro_batch(rank: int, world_size: int, index: int):
    """Rank ``rank``'s share of micro-batch ``index`` (32 samples each); fixed across runs."""
    return rank_batch(rank, world_size, step=index)


def reference(world_size: int, micro_batches: int = 1, max_norm: float | None = None) -> dict:
    """One process: gradients of the mean loss over every rank's samples, optionally clipped."""
    model = make_model()
    for i in range(micro_batches):
        x = torch.cat([micro_batch(r, world_size, i)[0] for r in range(world_size)])
        y = torch.cat([micro_batch(r, world_size, i)[1] for r in range(world_size)])
        (F.cross_entropy(model(x), y) / micro_batches).backward()
    norm = None
    if max_norm is not None:
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    return {"norm": norm, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def clip(max_norm: float = 0.5) -> dict:
    """Rank function: one backward, then ``clip_grad_norm_`` on the sharded gradients.

    Each rank holds a shard of every gradient; the norm must be the whole gradient's.
    ``clip_grad_norm_`` on DTensors computes each shard's sum of squares, all-reduces it,
    and returns a DTensor; every rank then scales its shard by the same factor.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    device = rank_device()
    model = shard_model(make_model().to(device))
    x, y = micro_batch(dist.get_rank(), dist.get_world_size(), 0)
    F.cross_entropy(model(x.to(device)), y.to(device)).backward()
    with CommDebugMode() as comm:
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return {
        "norm type": type(norm).__name__,
        "norm": full(norm).item(),
        "collectives": count_collectives(comm),
        "grads": {n: full(p.grad).cpu() for n, p in model.named_parameters()},
    }


def accumulate(
    sync: str = "every", micro_batches: int = 4, layers: int = LAYERS, reshard_after_forward: bool = True
) -> dict:
    """Rank function: accumulate gradients over ``micro_batches``, then compare.

    sync="every": FSDP2's default, a reduce-scatter after each micro-batch; each rank adds
        the reduced shards, so it only ever holds sharded gradients.
    sync="last": ``set_requires_gradient_sync(False)`` until the last micro-batch; no
        reduce-scatter until then, but each rank keeps full-size (unsharded) gradients.
    sync="last, unsharded": also ``set_reshard_after_backward(False)`` until the last
        micro-batch, so the weights stay gathered and the next forward needs no all-gather;
        the full-size gradients are then plain ``p.grad`` tensors one can see.
    ``layers``: Linear layers of the MLP (each one FSDP unit); 3 is ``make_model()``.
    Returns the collectives of each micro-batch, what ``p.grad`` of the first layer was
    after each, and the full gradients at the end.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    modes = ("every", "last", "last, unsharded")
    if sync not in modes:
        raise ValueError(f"sync must be one of {modes}, got {sync!r}")
    device = rank_device()
    model = mlp(width=256, depth=layers - 1, seed=0).to(device)  # layers=3: make_model()
    model = shard_model(model, reshard_after_forward=reshard_after_forward)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_micro_batch, first_grad = [], []
    for i in range(micro_batches):
        last = i == micro_batches - 1
        model.set_requires_gradient_sync(sync == "every" or last)
        model.set_reshard_after_backward(sync != "last, unsharded" or last)
        x, y = micro_batch(rank, world, i)
        with CommDebugMode() as comm:
            (F.cross_entropy(model(x.to(device)), y.to(device)) / micro_batches).backward()
        per_micro_batch.append(count_collectives(comm))
        grad = model[0].weight.grad  # None while FSDP2 keeps the accumulated gradient itself
        first_grad.append(None if grad is None else (type(grad).__name__, tuple(local_part(grad).shape)))
    return {
        "collectives": per_micro_batch,
        "first layer grad": first_grad,
        "grads": {n: full(p.grad).cpu() for n, p in model.named_parameters()},
    }


IGNORE = -100  # the target value F.cross_entropy leaves out (its ignore_index): padding


def valid_tokens(rank: int, index: int) -> int:
    """How many of the 32 targets of rank ``rank``'s micro-batch ``index`` count; the rest are padding.

    Uneven on purpose, as the tokens of variable-length sequences are: 32 and 32 on even
    ranks, 8 and 16 on odd ones.
    """
    return 32 if rank % 2 == 0 else 8 * (index + 1)


def padded_batch(rank: int, world_size: int, index: int):
    """``micro_batch`` with the targets after the first ``valid_tokens`` set to ``IGNORE``."""
    x, y = micro_batch(rank, world_size, index)
    y = y.clone()
    y[valid_tokens(rank, index) :] = IGNORE
    return x, y


def token_reference(world_size: int, micro_batches: int = 2) -> dict:
    """One process: the mean loss over every valid target of every rank and micro-batch, and its gradients."""
    model = make_model()
    batches = [padded_batch(r, world_size, i) for i in range(micro_batches) for r in range(world_size)]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)  # the mean over the valid targets only
    loss.backward()
    return {
        "loss": loss.item(),
        "tokens": int((y != IGNORE).sum()),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def token_mean(micro_batches: int = 2) -> dict:
    """Rank function: a step over uneven micro-batches, its loss averaged two ways.

    "mean of means": each rank takes the mean over its own valid targets per micro-batch, as
        ``F.cross_entropy`` does by default; FSDP2 then averages the gradients over the ranks.
    "per token": each rank sums its losses and divides by the valid targets of *all* ranks
        and micro-batches (one all-reduce of a count before the step), times the world size,
        because FSDP2 (and DDP) divide the summed gradients by it.
    Both on copies of the same sharded model; returns their losses and full gradients.
    """
    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    batches = [padded_batch(rank, world, i) for i in range(micro_batches)]
    count = torch.tensor(float(sum(int((y != IGNORE).sum()) for _, y in batches)), device=device)
    dist.all_reduce(count)  # every rank's valid targets: the denominator of the per-token mean
    models = {name: shard_model(make_model().to(device)) for name in ("mean of means", "per token")}
    losses = torch.zeros(2, device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        mean = F.cross_entropy(models["mean of means"](x), y, ignore_index=IGNORE) / micro_batches
        mean.backward()
        total = F.cross_entropy(models["per token"](x), y, ignore_index=IGNORE, reduction="sum") / count
        (total * world).backward()  # undoes the division by the world size in the gradient reduction
        losses += torch.stack([mean.detach() / world, total.detach()])
    dist.all_reduce(losses)
    grads = {name: {n: full(p.grad).cpu() for n, p in model.named_parameters()} for name, model in models.items()}
    return {"tokens": int(count.item()), "losses": dict(zip(models, losses.tolist(), strict=True)), "grads": grads}


def measure_collectives(cases: list[dict]) -> list[dict]:
    """Rank function: the collectives of one accumulation step for each case, summed.

    Each case holds ``accumulate``'s arguments (``layers``, ``micro_batches``, ``sync``,
    ``reshard_after_forward``); the result is ``{"all-gather": n, "reduce-scatter": m}``.
    """
    totals = []
    for case in cases:
        total = {"all-gather": 0, "reduce-scatter": 0}
        for counts in accumulate(**case)["collectives"]:
            for name, n in counts.items():
                total[name] = total.get(name, 0) + n
        totals.append(total)
    return totals


def reshard(reshard_after_forward: bool = True) -> dict:
    """Rank function: the collectives of forward and backward, and what is held in between.

    True (the default): after a unit's forward, its gathered weights are freed; backward
        gathers them again. Fewer bytes held, one more all-gather per unit.
    False: the gathered weights stay until that unit's backward; no all-gather in backward.
    Returns collectives per phase and the bytes of weights this rank holds after forward.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    device = rank_device()
    model = shard_model(make_model().to(device), reshard_after_forward=reshard_after_forward)
    x, y = micro_batch(dist.get_rank(), dist.get_world_size(), 0)
    with CommDebugMode() as forward:
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
    linears = [m for m in model if isinstance(m, nn.Linear)]
    held = local_bytes(p for m in linears for p in m.parameters())  # a DTensor counts its shard only
    gathered = sum(not hasattr(m.weight, "to_local") for m in linears)
    with CommDebugMode() as backward:
        loss.backward()
    return {
        "forward": count_collectives(forward),
        "backward": count_collectives(backward),
        "bytes held after forward": held,
        "layers still gathered": gathered,
        "full model bytes": sum(p.numel() * p.element_size() for p in make_model().parameters()),
    }


def offload(pin_memory: bool = False, steps: int = 3) -> dict:
    """Rank function: FSDP2 with ``CPUOffloadPolicy``; where the shards live, and the losses.

    The shards, their gradients and the optimizer step stay in CPU memory; each unit's
    weights are copied to the GPU to compute. Pinned (page-locked) memory lets those copies
    run asynchronously, but pinning asks the accelerator's driver: on a machine without one
    it fails, and the error is returned as text. Where a GPU is present pinning works even
    for ranks that compute on the CPU (more ranks than GPUs run on gloo).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    device = rank_device()
    try:
        model = shard_model(make_model().to(device), offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
    except Exception as error:  # reported, not raised: the chapter shows the message
        return {"error": f"{type(error).__name__}: {error}"}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for i in range(steps):
        x, y = micro_batch(rank, world, i)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    weight = model[0].weight
    return {
        "error": None,
        "shard device": str(weight.to_local().device),
        "grad device": str(weight.grad.to_local().device),
        "compute device": str(device),
        "losses": losses,
    }


def shard_with_root_head(model: nn.Sequential) -> nn.Sequential:
    """FSDP2 on an MLP as on a transformer: every hidden Linear is its own unit, and the root
    owns what is left, here the last Linear (a transformer's root owns embedding and head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    for layer in list(model)[:-1]:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def divide_factor(micro_batches: int = 2) -> dict:
    """Rank function: the per-token loss with FSDP2's division by the world size switched off.

    Each rank divides its summed loss by the valid targets of all ranks, as ``token_mean``
    does, but does not multiply by the world size: ``set_gradient_divide_factor(1.0)`` makes
    the reduce-scatter sum instead of average. The setting is per FSDP module (it sets only
    that module's own parameter group), so two copies are trained: "root only" calls it on the
    root, "every module" on every FSDP module, as torchtitan does. The root owns the last
    Linear (``shard_with_root_head``). Returns each copy's full gradients.
    """
    from torch.distributed.fsdp import FSDPModule

    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    batches = [padded_batch(rank, world, i) for i in range(micro_batches)]
    count = torch.tensor(float(sum(int((y != IGNORE).sum()) for _, y in batches)), device=device)
    dist.all_reduce(count)
    models = {name: shard_with_root_head(make_model().to(device)) for name in ("root only", "every module")}
    models["root only"].set_gradient_divide_factor(1.0)
    for model in models.values():
        for module in model.modules():
            if isinstance(module, FSDPModule) and model is models["every module"]:
                module.set_gradient_divide_factor(1.0)
            if isinstance(module, FSDPModule) and dist.get_backend() == "gloo":
                # a custom factor makes FSDP2 reduce with ReduceOp.PREMUL_SUM, which gloo lacks:
                # a plain sum, then the division, gives the same result
                module.set_force_sum_reduction_for_comms(True)
    for x, y in batches:
        for model in models.values():
            loss = F.cross_entropy(model(x.to(device)), y.to(device), ignore_index=IGNORE, reduction="sum")
            (loss / count).backward()  # no "* world": the reduction no longer divides (where it is set)
    head = f"{len(models['root only']) - 1}."  # the last Linear's parameter names start so
    root_owns = [n for n, _ in models["root only"].named_parameters() if n.startswith(head)]
    grads = {name: {n: full(p.grad).cpu() for n, p in model.named_parameters()} for name, model in models.items()}
    return {"grads": grads, "root owns": root_owns}


def forward_prefetch(prefetch: tuple = (0, 1, 2), depth: int = 3) -> dict:
    """Rank function: when the forward all-gathers are issued, with explicit forward prefetch.

    An MLP of ``depth + 1`` Linear units (root without parameters). For each ``n`` in
    ``prefetch``, the first unit is told ``set_modules_to_forward_prefetch`` of the next ``n``
    units; a hook that runs after FSDP2's own pre-forward hook reads how many all-gathers have
    been issued when each unit starts computing. Also: after a forward with FSDP2's default
    ``reshard_after_forward=None``, which Linears of ``shard_with_root_head`` are still gathered.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    x, y = micro_batch(rank, world, 0)
    x, y = x.to(device), y.to(device)
    issued, losses = {}, {}
    for n in prefetch:
        model = shard_model(mlp(width=256, depth=depth, seed=0).to(device))
        linears = [m for m in model if isinstance(m, nn.Linear)]
        if n:
            linears[0].set_modules_to_forward_prefetch(linears[1 : 1 + n])
        seen = []
        with CommDebugMode() as comm:
            for layer in linears:  # registered after fully_shard: runs after FSDP2's pre-forward hook
                layer.register_forward_pre_hook(lambda *_: seen.append(count_collectives(comm).get("all-gather", 0)))
            loss = F.cross_entropy(model(x), y)
        issued[n], losses[n] = seen, loss.item()
    model = shard_with_root_head(make_model().to(device))
    F.cross_entropy(model(x), y)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    gathered = [not hasattr(m.weight, "to_local") for m in linears]  # a plain tensor: the full weight is held
    return {"issued": issued, "losses": losses, "gathered after forward": gathered}
