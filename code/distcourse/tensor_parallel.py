"""Tensor parallelism in chapter 10: DTensor, Megatron-style layers by hand, then ``parallelize_module``.

1. ``redistribute_costs`` (rank function): a tensor's placements on a mesh, ``Shard``,
   ``Replicate`` and ``Partial``, and the collective that each ``redistribute`` issues,
   counted with ``CommDebugMode`` and checked against ``REDISTRIBUTE_COLLECTIVE``;
2. ``megatron_by_hand`` (rank function): a column-parallel then a row-parallel linear layer
   written with plain ``dist.all_reduce``: one all-reduce in forward, one in backward,
   outputs and gradients checked against the unsharded layers;
3. ``tp_plan`` and ``tp_train`` (rank function): the same idea for a whole GPT through
   ``parallelize_module``, optionally with sequence parallelism and loss parallelism,
   trained a few AdamW steps and compared with ``reference_train`` in one process
   (``tp_variants``: the three variants in one launch);
4. ``context_parallel_defaults`` and ``context_parallel_attention`` (rank function, GPUs
   only): how PyTorch's context parallelism moves keys and values, and a causal attention
   split along the sequence, forward and backward, against full attention; ``cp_dtype`` and
   ``cp_kernels`` decide its dtype and attention kernels from the GPU's profile
   (``runtime.gpus``): bf16 where flash or memory-efficient attention takes it, else fp16.

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .common import numerics
from .common.memory import saved_bytes
from .common.models import gpt
from .common.sharded import count_collectives, full
from .runtime import gpus
from .runtime.hardware import rank_device
from .runtime.i18n import tr

# What each change of placement costs: the collective DTensor issues. On a CPU mesh DTensor does
# not use all-to-all (``shard_dim_alltoall`` in torch/distributed/tensor/_collective_utils.py
# checks ``mesh.device_type == "cpu"``): Shard(0) -> Shard(1) becomes an all-gather followed by a
# local slice, although gloo itself implements all-to-all.
REDISTRIBUTE_COLLECTIVE = {
    ("Shard(0)", "Replicate()"): "all-gather",
    ("Partial()", "Replicate()"): "all-reduce",
    ('Partial("max")', "Replicate()"): "all-reduce",  # the same collective with another reduce op
    ("Partial()", "Shard(0)"): "reduce-scatter",
    ("Replicate()", "Shard(0)"): None,  # every rank already has the data: it keeps its chunk
    ("Shard(0)", "Shard(1)"): "all-to-all",
}
SIZES = {"vocab": 256, "hidden": 64, "heads": 4, "layers": 2}


def _mesh(shape=None, names=None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rank_device().type, shape or (dist.get_world_size(),), mesh_dim_names=names)


# --------------------------------------------------------------------------------------
# 1. DTensor placements and what redistributing costs
# --------------------------------------------------------------------------------------


def _placement(name: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {
        "Shard(0)": Shard(0),
        "Shard(1)": Shard(1),
        "Replicate()": Replicate(),
        "Partial()": Partial(),  # reduce_op="sum", the default
        'Partial("max")': Partial("max"),
    }[name]


def _partial_piece(full: torch.Tensor, source: str, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of a ``Partial`` tensor whose reduction over the ranks is ``full``."""
    if source == 'Partial("max")':
        return full - rank  # rank 0 holds the largest values
    return full / world  # the pieces sum to the full tensor


def _all_to_all_columns(local: torch.Tensor, world: int) -> torch.Tensor:
    """Shard(0) -> Shard(1) with the backend's own all-to-all: column block j goes to rank j."""
    send = torch.cat([c.contiguous() for c in local.chunk(world, dim=1)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)  # rank i's rows of this rank's columns, in rank order
    return received


def redistribute_costs(pairs: list | None = None, rows: int = 4, cols: int = 6) -> list[dict]:
    """Rank function: each change of placement in ``pairs`` (default: ``REDISTRIBUTE_COLLECTIVE``), counted.

    A ``Partial()`` tensor is made from local pieces that *sum* to the full tensor (each rank
    holds full / world_size), as a row-parallel layer's outputs do before their all-reduce;
    a ``Partial("max")`` one from pieces whose element-wise maximum is the full tensor. For
    Shard(0) -> Shard(1), "backend all-to-all" says whether ``dist.all_to_all_single`` of the
    process group (gloo on CPUs) gives each rank the same piece as DTensor did.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh, world = _mesh(), dist.get_world_size()
    device = rank_device()
    full = torch.arange(rows * cols, dtype=torch.float32, device=device).reshape(rows, cols)
    report = []
    for source, target in pairs or REDISTRIBUTE_COLLECTIVE:
        expected = REDISTRIBUTE_COLLECTIVE.get((source, target))
        if source.startswith("Partial"):
            piece = _partial_piece(full, source, dist.get_rank(), world)
            tensor = DTensor.from_local(piece, mesh, [_placement(source)], run_check=False)
        else:
            tensor = distribute_tensor(full, mesh, [_placement(source)])
        with CommDebugMode() as comm:
            moved = tensor.redistribute(mesh, [_placement(target)])
        report.append(
            {
                "from": source,
                "to": target,
                "collectives": count_collectives(comm),
                "expected": expected,
                "local shape before": tuple(tensor.to_local().shape),
                "local shape after": tuple(moved.to_local().shape),
                # moving data is exact, and so is summing whole numbers split over 2 or 4 ranks
                "same values": torch.equal(moved.full_tensor(), full),
                "backend all-to-all": torch.equal(_all_to_all_columns(tensor.to_local(), world), moved.to_local())
                if (source, target) == ("Shard(0)", "Shard(1)")
                else None,
            }
        )
    return report


# --------------------------------------------------------------------------------------
# 2. Megatron-style tensor parallelism by hand
# --------------------------------------------------------------------------------------


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input gradient over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # each rank has the gradient of its half of the hidden units
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the ranks; identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def megatron_mlp(x, w1_rows, w2_cols):
    """y = gelu(x W1ᵀ) W2ᵀ with W1 split by output rows and W2 by input columns.

    Each rank computes its slice of the hidden units from the whole input (no
    communication: ``gelu`` is element-wise), multiplies by its columns of W2, and the
    partial outputs are summed: one all-reduce in forward, one (in f) in backward.
    """
    x = _CopyToParallel.apply(x)
    return _ReduceFromParallel.apply(F.gelu(x @ w1_rows.T) @ w2_cols.T)


def megatron_by_hand(hidden: int = 64, tokens: int = 32) -> dict:
    """Rank function: the two-layer MLP, split by hand over the ranks, against the whole one.

    Returns collectives per phase, the output, input gradient and this rank's weight
    gradients next to the same from the unsharded computation (``split`` and ``unsplit``),
    their largest gaps, and the local weight shapes.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    generator = torch.Generator().manual_seed(0)  # the same full weights and input on every rank
    w1 = (torch.randn(4 * hidden, hidden, generator=generator) / hidden**0.5).to(device)
    w2 = (torch.randn(hidden, 4 * hidden, generator=generator) / (4 * hidden) ** 0.5).to(device)
    x = torch.randn(tokens, hidden, generator=generator).to(device)  # nccl reduces GPU tensors only
    part = slice(rank * 4 * hidden // world, (rank + 1) * 4 * hidden // world)
    w1_rows = w1[part].clone().requires_grad_()  # column-parallel: output features split
    w2_cols = w2[:, part].clone().requires_grad_()  # row-parallel: input features split
    x_local = x.clone().requires_grad_()
    with CommDebugMode() as forward:
        y = megatron_mlp(x_local, w1_rows, w2_cols)
    with CommDebugMode() as backward:
        y.square().sum().backward()
    # the reference: the whole MLP in this process
    w1_full, w2_full, x_full = (t.clone().requires_grad_() for t in (w1, w2, x))
    y_full = F.gelu(x_full @ w1_full.T) @ w2_full.T
    y_full.square().sum().backward()
    split = {"output": y.detach(), "input grad": x_local.grad, "weight grads": [w1_rows.grad, w2_cols.grad]}
    unsplit = {
        "output": y_full.detach(),
        "input grad": x_full.grad,
        "weight grads": [w1_full.grad[part], w2_full.grad[:, part]],
    }
    return {
        "forward": count_collectives(forward),
        "backward": count_collectives(backward),
        "split": split,  # what the ranks computed, and the same quantities from the whole MLP
        "unsplit": unsplit,
        "output gap": (y - y_full).abs().max().item(),
        "input grad gap": (x_local.grad - x_full.grad).abs().max().item(),
        "weight grad gap": max(
            (w1_rows.grad - w1_full.grad[part]).abs().max().item(),
            (w2_cols.grad - w2_full.grad[:, part]).abs().max().item(),
        ),
        "w1 local": tuple(w1_rows.shape),
        "w2 local": tuple(w2_cols.shape),
    }


# --------------------------------------------------------------------------------------
# 3. parallelize_module: a whole GPT, with sequence and loss parallelism
# --------------------------------------------------------------------------------------


def tp_plan(model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
    """The ``parallelize_module`` plan for ``common.models.GPT`` (the layout torchtitan uses).

    Per block: wq, wk, wv and w1 column-parallel, wo and w2 row-parallel. With sequence
    parallelism the activations between those regions are split along the sequence
    (``Shard(1)``), the norms run on their share of tokens, and each region starts with an
    all-gather and ends with a reduce-scatter instead of an all-reduce. With loss parallelism
    the logits stay split over the vocabulary and ``loss_parallel()`` computes cross-entropy
    on them without gathering.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # the layout between TP regions
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        block = f"layers.{i}"
        plan |= {
            # one gather of the block's input for wq, wk and wv together, not one each
            f"{block}.attention": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            f"{block}.attention.wq": ColwiseParallel(),
            f"{block}.attention.wk": ColwiseParallel(),
            f"{block}.attention.wv": ColwiseParallel(),
            f"{block}.attention.wo": RowwiseParallel(output_layouts=between),
            f"{block}.feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            f"{block}.feed_forward.w1": ColwiseParallel(),
            f"{block}.feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan |= {f"{block}.attention_norm": SequenceParallel(), f"{block}.ffn_norm": SequenceParallel()}
    return plan


def tokens(step: int, batch: int = 4, seq: int = 32, vocab: int = SIZES["vocab"]):
    generator = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]  # predict each next token


def lm_loss(logits, targets):
    """Next-token cross-entropy of a language model: logits (batch, seq, vocab), targets (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_terms(batch: int = 4, seq: int = 32, sizes: dict = SIZES) -> int:
    """The additions chained into one loss of ``gpt(**sizes)``: ``terms`` for ``common.numerics``.

    Per block: two LayerNorms (a mean and a variance over h each), wq, wk, wv, wo and w1 (h
    each), the attention scores (over a head, h / heads), the softmax and the weighted values
    (over the sequence), w2 (4h). Then the final LayerNorm, the output layer (h), the
    cross-entropy (over the vocabulary) and its mean over the batch's tokens.
    """
    h = sizes["hidden"]
    block = 2 * 2 * h + 5 * h + h // sizes["heads"] + 2 * seq + 4 * h
    return sizes["layers"] * block + 2 * h + h + sizes["vocab"] + batch * seq


def activation_bytes_one_process() -> int:
    """Activation bytes the whole GPT keeps for backward in one process, for the first batch."""
    model = gpt(**SIZES)
    return saved_bytes(lambda: model(tokens(0)[0]), list(model.parameters()))[0]


def reference_train(steps: int = 3, batch: int = 4) -> dict:
    """One process: the GPT trained ``steps`` AdamW steps on ``batch`` sequences per step, the
    tokens ``tp_train`` (batch 4) and ``meshes.mesh_train`` (the global batch) train on."""
    model = gpt(**SIZES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        inputs, targets = tokens(step, batch=batch)
        loss = lm_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def tp_train(sequence_parallel: bool = False, loss_parallel: bool = False, steps: int = 3) -> dict:
    """Rank function: the GPT with every layer split over all ranks, trained as ``reference_train``.

    Every rank sees the same tokens (tensor parallelism splits the model, not the batch).
    Returns the losses, the full parameters at the end (gathered from their shards), the
    collectives of the first step's forward and backward, and the activation bytes this
    rank keeps for backward (saved-tensor hooks, chapter 09).
    """
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context
    from torch.distributed.tensor.parallel import parallelize_module

    device = rank_device()
    model = gpt(**SIZES).to(device)
    parallelize_module(model, _mesh(), tp_plan(model, sequence_parallel, loss_parallel))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, comms, kept = [], {}, None
    parallel_loss = loss_parallel_context if loss_parallel else nullcontext
    for step in range(steps):
        inputs, targets = (t.to(device) for t in tokens(step))
        counting = CommDebugMode if step == 0 else nullcontext  # count the first step only: the mode is slow
        with counting() as forward:
            if step == 0:
                kept, logits = saved_bytes(lambda: model(inputs), list(model.parameters()))
            else:
                logits = model(inputs)
            with parallel_loss():
                loss = lm_loss(logits, targets)
        with counting() as backward, parallel_loss():
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        if step == 0:
            comms = {"forward": count_collectives(forward), "backward": count_collectives(backward)}
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    params = {n: full(p).detach().cpu() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "collectives": comms, "activation bytes": kept}


TP_VARIANTS = {
    "TP": {},
    "TP + SP": {"sequence_parallel": True},
    "TP + SP + loss parallel": {"sequence_parallel": True, "loss_parallel": True},
}


def tp_variants(steps: int = 3) -> dict:
    """Rank function: ``tp_train`` for each of ``TP_VARIANTS`` in turn, in one process group
    (one launch instead of three: starting ranks costs more than training this model)."""
    return {name: tp_train(steps=steps, **options) for name, options in TP_VARIANTS.items()}


# --------------------------------------------------------------------------------------
# 4. Context parallelism (GPUs only)
# --------------------------------------------------------------------------------------


def context_parallel_defaults() -> dict:
    """How ``context_parallel`` moves keys and values unless told otherwise (torch's own settings).

    "rotate method": "allgather" (each rank all-gathers K and V once, after its first block)
    or "alltoall" (K/V blocks passed to the next rank, ring attention proper), chosen with
    ``set_rotate_method``; "load balancing": causal attention's sequence dealt out head and
    tail (rank r gets chunks r and 2t-1-r), so early and late tokens, cheap and expensive
    rows of the causal mask, are shared evenly. Read from
    ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``.
    """
    from torch.distributed.tensor.experimental._attention import _cp_options, _RotateMethod

    methods = {_RotateMethod.ALL_GATHER: "allgather", _RotateMethod.ALL_TO_ALL: "alltoall"}
    return {"rotate method": methods[_cp_options.rotate_method], "load balancing": _cp_options.enable_load_balance}


# The attention kernels context parallelism has sharding rules for, in the order it is shown them.
CP_KERNELS = ("flash", "efficient")
CP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cp_kernels(profile: gpus.GpuProfile | None, dtype: str) -> tuple[str, ...]:
    """The CP-capable attention kernels that take ``dtype`` ("bf16", "fp16") on this GPU."""
    usable = gpus.sdpa_kernels(profile, CP_DTYPES[dtype]) if profile is not None else frozenset()
    return tuple(k for k in CP_KERNELS if k in usable)


def cp_dtype(profile: gpus.GpuProfile | None) -> str | None:
    """The dtype of the CP demo on this GPU: bf16 where a CP kernel takes it (sm >= 80), else fp16
    (memory-efficient attention takes fp16 below sm80, not bf16), None without one (a CPU)."""
    for dtype in CP_DTYPES:
        if cp_kernels(profile, dtype):
            return dtype
    return None


def describe_cp(profile: gpus.GpuProfile | None, dtype: str | None) -> str:
    """One sentence, before the run: what the CP cell will do on this GPU."""
    if dtype is None:
        return tr("No CUDA attention kernel for context parallelism here: the run is skipped.")
    return tr("{gpu}: context parallelism runs in {dtype} with the {kernels} attention kernel(s).").format(
        gpu=profile.key, dtype=dtype, kernels=", ".join(cp_kernels(profile, dtype))
    )


def context_parallel_attention(seq: int = 4096, heads: int = 8, head_dim: int = 64, dtype: str = "bf16") -> dict:
    """Rank function, GPUs only: causal attention with the sequence split over the ranks, forward and backward.

    ``context_parallel`` shards q, k, v and the output gradient along the sequence (in place,
    restored on exit; load-balanced, see ``context_parallel_defaults``). Each rank keeps its
    queries and gets the keys and values it needs by the default rotate method; backward
    passes the key/value gradients on with an all-to-all. The outputs and the gradients of q,
    k and v are gathered back (``context_parallel_unshard`` also undoes the load balancing)
    and compared with full attention computed on every rank: "gaps" are relative gaps
    (``common.numerics.relative_gap``; the tensors are too large to send back). There is no
    CPU version: its sharding rules exist only for the CUDA flash and memory-efficient
    attention kernels. ``dtype`` ("bf16" or "fp16", see ``cp_dtype``) picks the kernels that
    take it on this GPU (``cp_kernels``); a GPU without one is refused before any work.
    """
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = rank_device()
    if device.type != "cuda":
        raise RuntimeError("context parallelism needs CUDA attention kernels; this rank runs on the CPU")
    kernels = cp_kernels(gpus.current(device), dtype)
    if not kernels:
        raise RuntimeError(f"no attention kernel for context parallelism takes {dtype} on this GPU")
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    mesh = _mesh()
    generator = torch.Generator(device=device).manual_seed(0)  # the same q, k, v and dout on every rank
    q, k, v, dout = (
        torch.randn(2, heads, seq, head_dim, device=device, dtype=CP_DTYPES[dtype], generator=generator)
        for _ in range(4)
    )
    with sdpa_kernel([backends[k] for k in kernels]):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        full_out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        full_out.backward(dout)
        buffers = [t.clone() for t in (q, k, v, dout)]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
            local = buffers[0].shape[2]
            mine = [t.detach().requires_grad_() for t in buffers[:3]]  # this rank's shards as leaves
            out = F.scaled_dot_product_attention(*mine, is_causal=True)
            out.backward(buffers[3])
            split = context_parallel_unshard(mesh, [out.detach()] + [t.grad for t in mine], [2, 2, 2, 2])
    whole = [full_out.detach()] + [t.grad for t in leaves]
    names = ("output", "dq", "dk", "dv")
    gaps = {n: numerics.relative_gap(a.float(), b.float()) for n, a, b in zip(names, split, whole)}
    return {"sequence": seq, "local sequence": local, "gaps": gaps, "dtype": dtype, "kernels": kernels}
