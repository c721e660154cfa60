"""Sharded training of chapter 08: who holds which bytes under DDP, ZeRO-1 and FSDP2.

Three parts, each readable on its own:

1. the arithmetic: ``zero_bytes`` (the ZeRO stage formulas, in ``common/memory.py`` because
   chapters 09-10 use them too) and ``placement`` (what stays on the GPU and what moves to
   CPU memory when states are offloaded);
2. measuring: ``measure_memory`` wraps the same model several ways on every rank (DDP and
   DDP + ``ZeroRedundancyOptimizer``, each with and without ``gradient_as_bucket_view``,
   FSDP2 ``fully_shard``), takes one Adam step and counts the bytes each rank really holds:
   the local shards and DDP's gradient buckets, not a formula; ``zero1_split`` shows how
   ``ZeroRedundancyOptimizer`` divides any list of parameter shapes, without allocating them;
   ``watch_unsharding`` and ``root_after_forward`` show what a layer holds around its forward;
3. correctness: ``fsdp_train`` trains with FSDP2 and gathers the full weights, to be
   compared with ``reference_train``, the same training in one process.

The MLP, its batches and ``shard_model`` (FSDP2 layer by layer) are in ``common/sharded.py``.
Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

# The ZeRO formulas and the sharded MLP are shared with chapters 09-10 (common/), and
# taught here: the notebook reads them as sharding.zero_bytes, sharding.make_model...
from .common.memory import FP32_ADAM as FP32_ADAM
from .common.memory import MIXED_ADAM, local_bytes, zero_bytes
from .common.memory import PARTS as PARTS
from .common.sharded import local_part, make_model, rank_batch, shard_model
from .common.training import wrap_ddp
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr


def placement(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    bytes_per_param: dict = MIXED_ADAM,
) -> dict:
    """Persistent model-state bytes per GPU, and per machine in CPU memory, with offloading.

    offload_optimizer (DeepSpeed ZeRO-Offload): the optimizer states live in CPU memory and
        the optimizer step runs there, so the gradients it consumes go there too.
    offload_params (ZeRO-Infinity, FSDP2's ``CPUOffloadPolicy``; needs stage 3): the
        parameter shards live in CPU memory too; a layer's weights visit the GPU only while
        it computes, which this count of *persistent* bytes leaves out.
    ``world_size`` GPUs on one machine. Activations, buffers and fragmentation come on top.
    """
    if offload_params and stage != 3:
        raise ValueError(tr("offloading parameters needs them sharded: ZeRO stage 3"))
    per_rank = zero_bytes(num_params, world_size, stage, bytes_per_param)
    on_cpu = set()
    if offload_optimizer:
        on_cpu |= {"optimizer", "grads"}
    if offload_params:
        on_cpu |= {"params"}
    gpu = sum(v for part, v in per_rank.items() if part not in on_cpu)
    cpu = sum(v for part, v in per_rank.items() if part in on_cpu) * world_size  # all ranks share the host
    return {"gpu": gpu, "cpu": cpu}


# --------------------------------------------------------------------------------------
# 2. Measuring what each rank holds
# --------------------------------------------------------------------------------------


def storage_bytes(tensors) -> int:
    """Bytes of the memory blocks behind those elements, each block counted once.

    Differs from ``local_bytes`` where FSDP pads a shard so that every rank's block has
    the same size, or keeps several gradients in one block.
    """
    blocks = {}
    for t in tensors:
        storage = local_part(t).untyped_storage()
        blocks[storage.data_ptr()] = storage.nbytes()
    return sum(blocks.values())


def record_buckets(ddp) -> dict:
    """Keep every gradient bucket ``ddp`` all-reduces (index -> flat buffer), to count its memory.

    A communication hook receives each bucket; this one keeps a reference to the bucket's
    buffer, which DDP's reducer holds anyway, then all-reduces it as DDP does without a hook
    (torch's ``allreduce_hook`` is there for that: "DDP results is expected to be same as the
    case where no hook was registered", ddp_comm_hooks/default_hooks.py).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buckets = {}

    def keep_then_all_reduce(state, bucket):
        buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, keep_then_all_reduce)  # None: the default process group
    return buckets


def bucket_bytes(buckets, grads) -> int:
    """Bytes of the bucket blocks that hold no gradient: a second copy of the gradients.

    With ``gradient_as_bucket_view=True`` every ``p.grad`` is a view into a bucket, so the
    buckets are the gradients' own memory and add nothing.
    """
    grad_blocks = {local_part(g).untyped_storage().data_ptr() for g in grads}
    blocks = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in buckets}
    return sum(nbytes for ptr, nbytes in blocks.items() if ptr not in grad_blocks)


def memory_report(model: nn.Module, optimizer, buckets=()) -> dict:
    """What this rank holds right after ``optimizer.step()``, by part, in bytes.

    ``buckets``: DDP's gradient buckets (``record_buckets``), counted where they are extra memory.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = optimizer.optim.state if hasattr(optimizer, "optim") else optimizer.state  # ZeroRedundancyOptimizer
    moments = [s[k] for s in state.values() for k in ("exp_avg", "exp_avg_sq")]
    steps = [s["step"] for s in state.values()]  # one scalar step counter per parameter tensor
    return {
        "params": local_bytes(params),
        "grads": local_bytes(grads),
        "optimizer": local_bytes(moments),
        "buckets": bucket_bytes(buckets, grads),
        "step_counters": local_bytes(steps),
        "params_storage": storage_bytes(params),
        "grads_storage": storage_bytes(grads),
        "numel": {name: local_part(p).numel() for name, p in model.named_parameters()},
    }


def _one_step(model, optimizer, device) -> None:
    x, y = rank_batch(dist.get_rank(), dist.get_world_size())
    nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
    optimizer.step()  # no zero_grad: the gradients should still be there to be counted


STRATEGIES = ("ddp", "ddp_view", "zero1", "zero1_view", "fsdp")


def measure_memory(strategies=STRATEGIES) -> dict:
    """Rank function: for each strategy, one Adam step on a fresh model, then count bytes.

    ``ddp`` and ``zero1`` (DDP + ``ZeroRedundancyOptimizer``) use DDP's defaults; ``ddp_view``
    and ``zero1_view`` the same with ``gradient_as_bucket_view=True``.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    device = rank_device()
    report = {}
    for strategy in strategies:
        model = make_model().to(device)
        buckets = {}
        if strategy in ("ddp", "ddp_view", "zero1", "zero1_view"):
            wrapped = wrap_ddp(model, device, gradient_as_bucket_view=strategy.endswith("_view"))
            buckets = record_buckets(wrapped)
            if strategy.startswith("zero1"):  # DDP for the gradients, optimizer state sharded: ZeRO stage 1
                optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
            else:
                optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
        elif strategy == "fsdp":
            wrapped = shard_model(model)
            optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
        else:
            raise ValueError(tr("unknown strategy {strategy}").format(strategy=repr(strategy)))
        _one_step(wrapped, optimizer, device)
        report[strategy] = memory_report(model, optimizer, buckets.values())
        r = report[strategy]
        print(
            tr("{strategy}: weights {params} B  gradients {grads} B  optimizer {optimizer} B").format(
                strategy=f"{strategy:10s}",
                params=f"{number(r['params']):>7}",
                grads=f"{number(r['grads']):>7}",
                optimizer=f"{number(r['optimizer']):>7}",
            )
        )
    return report


def zero1_split(shapes, world_size: int) -> list:
    """Parameters per rank when ``ZeroRedundancyOptimizer`` shards Adam over ``world_size`` ranks.

    Its own partitioning runs on parameters of these ``shapes`` on the meta device (shapes, no
    memory) under ``pretend_ranks`` (one process pretending to be rank 0 of ``world_size``): it
    sorts whole tensors by size and gives each to the rank with the fewest elements so far.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from .common.distributed import pretend_ranks

    with pretend_ranks(world_size):
        params = [nn.Parameter(torch.empty(shape, device="meta")) for shape in shapes]
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam)
        # The partition it keeps for all ranks (a private method: no public one returns it).
        partition = optimizer._partition_parameters()
        return [sum(p.numel() for group in groups for p in group["params"]) for groups in partition]


def watch_unsharding() -> list:
    """Rank function: the first layer's weight before, while and after the layer computes."""
    model = shard_model(make_model().to(rank_device()))

    def look(when):
        weight = model[0].weight
        return when, type(weight).__name__, tuple(local_part(weight).shape)

    seen = [look(tr("before forward"))]
    # A pre-hook registered after fully_shard runs after FSDP's own pre-hook, which all-gathers.
    model[0].register_forward_pre_hook(lambda module, inputs: seen.append(look(tr("while computing"))))
    x, _ = rank_batch(dist.get_rank(), dist.get_world_size())
    model(x.to(rank_device()))
    seen.append(look(tr("after forward")))
    return seen


def root_after_forward(reshard_after_forward=None) -> dict:
    """Rank function: what the first layer (a unit of its own) and the last (the root's) hold after forward.

    ``None`` passes nothing: FSDP2's default, which reshards every unit but the root.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model().to(rank_device())
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    options = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    fully_shard(model[0], mesh=mesh, **options)  # one inner unit...
    fully_shard(model, mesh=mesh, **options)  # ...and the root, which owns every other layer's weights
    x, _ = rank_batch(dist.get_rank(), dist.get_world_size())
    model(x.to(rank_device()))

    def held(weight):
        return type(weight).__name__, tuple(local_part(weight).shape)

    return {"unit": held(model[0].weight), "root": held(model[-1].weight)}


# --------------------------------------------------------------------------------------
# 3. Sharded training equals unsharded training
# --------------------------------------------------------------------------------------


def fsdp_train(steps: int = 3, lr: float = 1e-3) -> dict:
    """Rank function: ``steps`` Adam steps with FSDP2; returns the full weights (gathered)."""
    device = rank_device()
    model = shard_model(make_model().to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = rank_batch(dist.get_rank(), dist.get_world_size(), step)
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()  # reduce-scatter: each rank receives the averaged gradient of its shard
        optimizer.step()  # Adam updates the local shard only
        optimizer.zero_grad()
        losses.append(loss.item())
    # full_tensor() all-gathers the shards: a collective, so every rank calls it.
    full = {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()}
    return {"losses": losses, "weights": full}


def reference_train(world_size: int = 2, steps: int = 3, lr: float = 1e-3) -> dict:
    """The same training in this process: the same initial weights, each step the whole global batch."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        parts = [rank_batch(r, world_size, step) for r in range(world_size)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def padded_numel(shape, world_size: int) -> int:
    """Elements of one rank's FSDP2 block for a tensor of ``shape``: dim 0 rounded up to a multiple of N."""
    rows = math.ceil(shape[0] / world_size)
    return rows * math.prod(shape[1:])


def ring_traffic(num_params: int, world_size: int, stage: int, zero_redundancy_optimizer: bool = False) -> float:
    """Elements each rank sends per training step with ring collectives (chapter 03's cost).

    A ring reduce-scatter or all-gather of the whole model sends (N-1)/N of it per rank;
    an all-reduce is one of each. DDP all-reduces the gradients. Stages 1 and 2 split that
    all-reduce into its halves: reduce-scatter the gradients, all-gather the updated
    weights. Stage 3 all-gathers the weights twice (forward and backward), because it
    freed them in between, and reduce-scatters the gradients: three halves instead of two.

    ``zero_redundancy_optimizer``: stage 1 as PyTorch's ``ZeroRedundancyOptimizer`` does it
    under DDP: DDP still all-reduces every gradient (two halves), then each rank broadcasts
    the parameters it updated (on a ring a broadcast of M elements costs (N-1)/N of M per
    rank on average, so all of them add up to one more half): 1.5x DDP.
    """
    half = (world_size - 1) / world_size * num_params
    if zero_redundancy_optimizer:
        if stage != 1:
            text = tr("ZeroRedundancyOptimizer shards the optimizer state only: stage 1, not {stage}")
            raise ValueError(text.format(stage=stage))
        return 3 * half
    return 3 * half if stage == 3 else 2 * half
