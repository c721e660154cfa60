"""Device meshes in chapter 10: tensor parallelism inside, FSDP2 across, HSDP, and what each sends.

1. ``CommVolume``: a dispatch mode that records every collective a rank issues, through
   ``torch.distributed`` or DTensor alike, with its process group and its bytes;
2. ``mesh_train`` (rank function, 4 ranks): the chapter's GPT trained three ways on the same
   global batch, ``fsdp`` (1-D, 4 ranks), ``tp+fsdp`` (a (dp, tp) mesh: TP on "tp", FSDP2
   on "dp") and ``hsdp`` (a (replicate, shard) mesh); each compared with one process
   (``mesh_train_all``: the three in one launch);
3. ``volume``: the bytes per rank and step of each layout from formulas, for any model size,
   ``step_time`` and ``memory_per_gpu``, and ``choose``: a layout for a model, a GPU and a
   cluster, derived from those formulas and chapter 08-09's memory formulas (or, when no
   layout fits, a sentence saying so).

The GPT's sizes, plan, batches, loss and one-process reference come from chapter 10's first part.
Builds on: tensor_parallel

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .common.models import gpt
from .common.sharded import full
from .runtime.hardware import rank_device
from .runtime.i18n import tr
from .tensor_parallel import SIZES, lm_loss, reference_train, tokens, tp_plan

LAYOUTS = ("fsdp", "tp+fsdp", "hsdp")
GLOBAL_BATCH = 8


# --------------------------------------------------------------------------------------
# 1. Counting bytes
# --------------------------------------------------------------------------------------


class CommVolume(TorchDispatchMode):
    """Records (collective, process group name, group size, bytes sent by this rank).

    Bytes are those a ring algorithm sends per rank: an all-gather or a reduce-scatter of a
    full tensor of B bytes over n ranks sends (n-1)/n · B, an all-reduce twice that.
    Written as a dispatch mode because ``CommDebugMode`` counts collectives but not bytes;
    both FSDP2's ``torch.distributed`` calls and DTensor's functional collectives pass here.
    """

    KINDS = {
        "_allgather_base_": "all-gather",
        "all_gather_into_tensor": "all-gather",
        "_reduce_scatter_base_": "reduce-scatter",
        "reduce_scatter_tensor": "reduce-scatter",
        "allreduce_": "all-reduce",
        "all_reduce": "all-reduce",
    }

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func.__name__.split(".")[0]
        kind = self.KINDS.get(name) if namespace in ("c10d", "_c10d_functional") else None
        if kind is not None:
            self.records.append(self._describe(kind, namespace, args))
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _describe(kind, namespace, args):
        from torch.distributed.distributed_c10d import _resolve_process_group

        if namespace == "_c10d_functional":
            tensor, group = args[0], _resolve_process_group(args[-1])
            full = tensor.numel() * tensor.element_size()
            if kind == "all-gather":
                full *= group.size()  # the input is this rank's piece
        else:  # c10d ops: (output, input, group, ...) or ([tensors], group, ...)
            if kind == "all-reduce":
                tensor, group = args[0][0], args[1]
            else:
                tensor, group = (args[0] if kind == "all-gather" else args[1]), args[2]
            full = tensor.numel() * tensor.element_size()
            group = dist.ProcessGroup.unbox(group)  # the dispatcher passes a TorchScript handle
        n = group.size()
        sent = full * (n - 1) / n * (2 if kind == "all-reduce" else 1)
        return {"kind": kind, "group": group.group_name, "size": n, "bytes": sent}


# --------------------------------------------------------------------------------------
# 2. Three layouts on four ranks
# --------------------------------------------------------------------------------------


def _mesh_for(layout: str):
    from torch.distributed.device_mesh import init_device_mesh

    device_type, world = rank_device().type, dist.get_world_size()
    if layout == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    if world % 2:
        raise ValueError(f"layout {layout!r} needs an even number of ranks, got {world}")
    names = ("dp", "tp") if layout == "tp+fsdp" else ("replicate", "shard")
    return init_device_mesh(device_type, (world // 2, 2), mesh_dim_names=names)


def mesh_train(layout: str = "tp+fsdp", steps: int = 3) -> dict:
    """Rank function: train the GPT ``steps`` AdamW steps on ``GLOBAL_BATCH`` sequences.

    fsdp: every rank its share of the batch, parameters sharded over all ranks.
    tp+fsdp: each block split over the 2 ranks of a "tp" row (sequence parallel), which see
        the same sequences; those halves sharded again by FSDP2 over "dp".
    hsdp: parameters sharded over "shard" (2 ranks) and replicated over "replicate";
        gradients reduce-scattered within a shard group, then all-reduced across groups.
    Returns the global losses, the full parameters at the end, and the first step's
    collectives with their bytes, per mesh dimension.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    device = rank_device()
    mesh = _mesh_for(layout)
    model = gpt(**SIZES).to(device)
    if layout == "tp+fsdp":
        parallelize_module(model, mesh["tp"], tp_plan(model, sequence_parallel=True))
        data_mesh = mesh["dp"]
    else:
        data_mesh = mesh  # 1-D: FSDP; 2-D (replicate, shard): HSDP
    for block in model.layers:
        fully_shard(block, mesh=data_mesh)
    fully_shard(model, mesh=data_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # which part of the global batch is this rank's: its index along the data dimensions
    shares = mesh.size(0) if layout == "tp+fsdp" else dist.get_world_size()
    index = mesh.get_local_rank("dp") if layout == "tp+fsdp" else dist.get_rank()
    part = slice(index * GLOBAL_BATCH // shares, (index + 1) * GLOBAL_BATCH // shares)
    groups = {mesh.get_group(name).group_name: name for name in mesh.mesh_dim_names}
    losses, traffic = [], {}
    for step in range(steps):
        inputs, targets = (t[part].to(device) for t in tokens(step, batch=GLOBAL_BATCH))
        recorder = CommVolume()
        with recorder if step == 0 else nullcontext():
            loss = lm_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        if step == 0:
            for r in recorder.records:
                key = (groups.get(r["group"], "world"), r["kind"])
                calls, sent = traffic.get(key, (0, 0.0))
                traffic[key] = (calls + 1, sent + r["bytes"])
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())  # tp peers hold equal losses: the mean is the batch's
    params = {n: full(p).detach().cpu() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "traffic": traffic}


def mesh_train_all(steps: int = 3) -> dict:
    """Rank function: ``mesh_train`` for each of ``LAYOUTS`` in turn, {layout: result}, in one
    launch (starting 4 ranks costs more than training this model)."""
    return {layout: mesh_train(layout, steps) for layout in LAYOUTS}


def reference(steps: int = 3) -> dict:
    """One process, the whole global batch: what every layout must reproduce."""
    return reference_train(steps, batch=GLOBAL_BATCH)


# --------------------------------------------------------------------------------------
# 3. Formulas: bytes per GPU and step for any model, and a layout for a cluster
# --------------------------------------------------------------------------------------

# Published link speeds, per GPU and direction, in bytes per second (see the chapter for sources).
LINK_SPEEDS = {"nvlink": 450e9, "pcie": 64e9, "infiniband": 50e9}  # NVLink 4: 900 GB/s both ways per GPU


def links() -> dict:
    """``LINK_SPEEDS`` under names in the reader's language: {name: bytes per second}."""
    names = {
        "nvlink": tr("NVLink 4 (H100 SXM, inside a node)"),
        "pcie": tr("PCIe 5.0 x16"),
        "infiniband": tr("InfiniBand NDR, one 400 Gb/s port per GPU (between nodes)"),
    }
    return {names[key]: speed for key, speed in LINK_SPEEDS.items()}


def tp_collectives_per_layer(recompute: bool = False) -> int:
    """TP collectives per layer and step with sequence parallelism: an all-gather and a
    reduce-scatter around attention and around the MLP, in forward and again in backward: 8.

    ``recompute``: full activation checkpointing with torch's (non-reentrant) checkpoint. Backward
    reruns the block's forward, but stops after the last tensor backward needs; nothing needs
    the block's final reduce-scatter, so 3 more, not 4 (chapter 10 counts them): 11.
    """
    return 11 if recompute else 8


def volume(
    layout: str,
    *,
    params: float,
    layers: int,
    hidden: int,
    tokens: int,
    gpus_per_node: int,
    nodes: int,
    pbytes: int = 2,
    abytes: int = 2,
    recompute: bool = False,
) -> dict:
    """Bytes each GPU sends per training step, inside its node and to other nodes (ring algorithms).

    params: parameters of the model; tokens: tokens of one micro-batch that a GPU (or, with
    TP, its TP group) processes; pbytes / abytes: bytes per parameter / activation value
    communicated (2 for bf16). Each term is (n-1)/n of the bytes of the collective's full tensor.
    ddp:     all-reduce of the gradients over all GPUs: 2 (N-1)/N · P.
    fsdp:    all-gather in forward, again in backward, reduce-scatter of gradients: 3 (N-1)/N · P.
    hsdp:    FSDP inside each node (3 (g-1)/g · P), then an all-reduce of each gradient shard
             across nodes (2 (m-1)/m · P / g).
    tp+fsdp: TP inside each node with sequence parallelism, per layer an all-gather and a
             reduce-scatter of b·s·h activations around attention and around the MLP, in
             forward and in backward (8 (g-1)/g · tokens · h per layer; with ``recompute``,
             full activation checkpointing, 11: ``tp_collectives_per_layer``); FSDP of the
             1/g of the parameters each GPU holds across the nodes (3 (m-1)/m · P / g).
    A collective whose ranks span nodes is counted as traffic between nodes: a ring is as
    fast as its slowest link.
    """
    g, m = gpus_per_node, nodes
    n = g * m
    p = params * pbytes
    ring = lambda k: (k - 1) / k  # noqa: E731  (the share of a full tensor a ring sends per rank)
    tp_bytes = tp_collectives_per_layer(recompute) * layers * ring(g) * tokens * hidden * abytes
    spans_nodes = m > 1
    formulas = {
        "ddp": (0.0, 2 * ring(n) * p) if spans_nodes else (2 * ring(n) * p, 0.0),
        "fsdp": (0.0, 3 * ring(n) * p) if spans_nodes else (3 * ring(n) * p, 0.0),
        "hsdp": (3 * ring(g) * p, 2 * ring(m) * p / g),
        "tp+fsdp": (tp_bytes, 3 * ring(m) * p / g),
    }
    if layout not in formulas:
        raise ValueError(f"layout must be one of {tuple(formulas)}, got {layout!r}")
    inside, between = formulas[layout]
    return {"inside": inside, "between": between}


def step_time(
    layout: str,
    *,
    params: float,
    layers: int,
    hidden: int,
    seq: int,
    batch: int,
    gpus_per_node: int,
    nodes: int,
    flops: float = 400e12,
    inside_bps: float = LINK_SPEEDS["nvlink"],
    between_bps: float = LINK_SPEEDS["infiniband"],
    checkpointing: bool = False,
) -> dict:
    """Seconds per step on one GPU: compute, communication, and the part of it not hidden.

    ``batch`` sequences per GPU in every layout (the same global batch); with TP a group of
    ``gpus_per_node`` GPUs shares ``gpus_per_node · batch`` sequences. Compute: 6 · params ·
    tokens / ``flops`` (forward 2, backward 4; 400 TFLOP/s is ~40 % of an H100's dense bf16
    peak); with ``checkpointing`` (full activation checkpointing, as ``memory_per_gpu``
    assumes) 8 · params · tokens, because every block runs its forward twice (a little
    less: torch's checkpoint skips each block's last matrix product, chapter 09), and TP
    sends 11 collectives per layer instead of 8. The attention scores' own FLOPs are left
    out: 12 · layers · hidden · seq per token next to 6 · params, a share that grows with seq.
    Data-parallel traffic (DDP, FSDP, HSDP) overlaps with compute, so only what exceeds the
    compute time is exposed; TP's collectives sit between the layers' matrix products and
    are exposed in full (in eager PyTorch; async TP, which is not on by default, hides part of them).
    """
    g = gpus_per_node
    compute = (8 if checkpointing else 6) * params * batch * seq / flops
    tokens = batch * seq * (g if layout == "tp+fsdp" else 1)
    traffic = volume(
        layout,
        params=params,
        layers=layers,
        hidden=hidden,
        tokens=tokens,
        gpus_per_node=g,
        nodes=nodes,
        recompute=checkpointing,
    )
    if layout == "tp+fsdp":
        tp, data = traffic["inside"] / inside_bps, traffic["between"] / between_bps
    else:
        tp, data = 0.0, traffic["inside"] / inside_bps + traffic["between"] / between_bps
    exposed = tp + max(0.0, data - compute)
    return {"compute": compute, "communication": tp + data, "exposed": exposed, "total": compute + exposed}


def memory_per_gpu(
    layout: str,
    *,
    params: float,
    layers: int,
    hidden: int,
    heads: int,
    batch: int,
    seq: int,
    gpus_per_node: int,
    nodes: int,
) -> float:
    """Bytes per GPU: mixed-precision Adam states (16 per parameter, chapter 08), sharded as
    the layout shards them, plus bf16 activations of fused-attention blocks with full
    checkpointing (chapter 09): every block's input, and one block's activations at a time.
    With TP (and sequence parallelism) a group of g GPUs holds g · batch sequences and splits
    all of those activations g ways."""
    from .common.memory import block_formula

    g, m = gpus_per_node, nodes
    shards = {"ddp": 1, "hsdp": g, "fsdp": g * m, "tp+fsdp": g * m}[layout]
    tp = g if layout == "tp+fsdp" else 1
    sequences = batch * tp
    kept = layers * sequences * seq * hidden * 2
    recompute = block_formula(sequences, seq, hidden, heads, "sdpa", 2)
    return 16 * params / shards + (kept + recompute) / tp


def choose(
    *,
    params: float,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    gpu_memory: float,
    gpus_per_node: int,
    nodes: int,
) -> dict:
    """The chapter's decision rule, from its own formulas.

    Among the layouts that fit in ``gpu_memory`` bytes, the one with the shortest step
    (``step_time`` with full activation checkpointing, as ``memory_per_gpu`` assumes); on a
    tie the simpler one, in the order DDP, HSDP, FSDP, TP + FSDP. If none fits, ``layout``
    is None and ``verdict`` says so: pipeline stages would not help, since with FSDP the
    model states are already divided by the number of GPUs.
    """
    sizes = dict(
        params=params, layers=layers, hidden=hidden, seq=seq, batch=batch, gpus_per_node=gpus_per_node, nodes=nodes
    )
    order = ["ddp", "hsdp", "fsdp", "tp+fsdp"] if nodes > 1 else ["ddp", "fsdp", "tp+fsdp"]  # one node: HSDP is FSDP
    rows = []
    for rank_, layout in enumerate(order):
        memory = memory_per_gpu(layout, heads=heads, **sizes)
        rows.append(
            {
                "layout": layout,
                "memory": memory,
                "fits": memory <= gpu_memory,
                **step_time(layout, checkpointing=True, **sizes),
                "order": rank_,
            }
        )
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        verdict = tr("does not fit: more GPUs, CPU offload or smaller optimizer states")
        return {"layout": None, "verdict": verdict, "rows": rows}
    best = min(fitting, key=lambda r: (round(r["total"], 3), r["order"]))
    return {"layout": best["layout"], "verdict": best["layout"], "rows": rows}
