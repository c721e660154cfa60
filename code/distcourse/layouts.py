"""Choosing a layout for a real cluster in chapter 13: pipeline and expert dimensions on top of chapter 10's.

1. ``MODELS``, ``CLUSTERS``: published sizes of a dense model (Llama 3 70B), an MoE model
   (DeepSeek-V3) and of H100 / H800 clusters;
2. ``memory``, ``traffic``, ``step_time``: per GPU and step, from formulas, for a layout
   (pp, dp, tp, ep) with its pipeline schedule and micro-batches; ``choose``: the fastest
   layout that fits, chapter 10's ``meshes.choose`` extended with pp and ep;
3. ``dry_run``: one rank of a layout at the real world size (64 to 512 ranks) in this one
   process, on torch's fake process group: the mesh built with ``init_device_mesh``, one
   step of a tiny stand-in model run, each collective and its bytes counted per mesh dimension.

Builds on: meshes, experts
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from . import experts, meshes
from .common.memory import block_formula
from .runtime.i18n import tr

# Published sizes. Llama 3 70B: Llama 3 paper (arXiv:2407.21783), table 3. DeepSeek-V3: technical
# report (arXiv:2412.19437), sections 2 and 4.2: 61 layers, the first 3 dense, 58 with 256 routed
# experts (top 8) and one shared expert; 37B of the 671B parameters active per token; 15360
# sequences of 4096 tokens per step (section 4.2). Llama 3 70B: 512 sequences of 8192, the global batch
# of torchtitan's 70B benchmark (benchmarks/llama3_h100_202412_torchtitan.md, table 4).
MODELS = {
    "Llama 3 70B": dict(
        params=70.6e9,
        active=70.6e9,
        expert_params=0.0,
        layers=80,
        moe_layers=0,
        hidden=8192,
        heads=64,
        experts=0,
        top_k=0,
        seq=8192,
        batch=512,
    ),
    "DeepSeek-V3": dict(
        params=671e9,
        active=37e9,
        expert_params=58 * 256 * 3 * 7168 * 2048,
        layers=61,
        moe_layers=58,
        hidden=7168,
        heads=128,
        experts=256,
        top_k=8,
        seq=4096,
        batch=15360,
    ),
}
# H100 SXM nodes (chapter 10's link speeds) and DeepSeek's H800 nodes: NVLink 160 GB/s, IB 50 GB/s
# per GPU as the report measures them (section 3.2.2).
CLUSTERS = {
    "H100": dict(gpus_per_node=8, memory=80e9, intra=meshes.LINK_SPEEDS["nvlink"], inter=50e9, flops=400e12),
    "H800": dict(gpus_per_node=8, memory=80e9, intra=160e9, inter=50e9, flops=400e12),
}
DIMS = ("pp", "edp", "ep", "tp")  # mesh order, outermost first: tp on neighbouring GPUs, pp across nodes


# --------------------------------------------------------------------------------------
# 1. Formulas
# --------------------------------------------------------------------------------------


def _ring(n: int) -> float:
    return (n - 1) / n


def groups(layout: dict) -> dict:
    """{dimension: mesh dimensions it spans}; "dp" (dense FSDP) is (edp, ep); the experts are
    sharded over ep and their FSDP runs over (edp, tp), the ranks that hold the same experts."""
    return {"pp": ("pp",), "dp": ("edp", "ep"), "ep": ("ep",), "tp": ("tp",), "edp": ("edp", "tp")}


def spans_nodes(layout: dict, dims: tuple, gpus_per_node: int) -> bool:
    """Whether the group of rank 0 along ``dims`` holds GPUs of more than one node."""
    shape = [layout["pp"], layout["dp"] // layout["ep"], layout["ep"], layout["tp"]]
    ranks = torch.arange(math.prod(shape)).view(shape)
    index = tuple(slice(None) if d in dims else 0 for d in DIMS)
    return (ranks[index].flatten() // gpus_per_node).unique().numel() > 1


def microbatches(model: dict, layout: dict) -> int:
    """Sequences of one step per data-parallel replica; each micro-batch is one sequence."""
    return model["batch"] // layout["dp"]


def memory(model: dict, layout: dict, bytes_: int = 2) -> dict:
    """Bytes per GPU. states: 16 per parameter (mixed-precision Adam, chapter 08), every
    parameter sharded over all GPUs (dense ones over pp, tp and dp; experts over pp, ep and
    (edp, tp)). gathered: the bf16 parameters FSDP unshards: one layer and the next one
    (prefetched); with pp, the whole stage, which stays gathered between micro-batches.
    activations: with full checkpointing (chapter 09), each layer's input for every micro-batch
    in flight (1F1B keeps pp of them on the first stage; without pp the whole replica's
    batch), split by tp (sequence parallel), plus one block recomputed."""
    pp, tp, ep, m = layout["pp"], layout["tp"], layout["ep"], microbatches(model, layout)
    gpus = pp * tp * layout["dp"]
    dense = model["params"] - model["expert_params"]
    states = 16 * model["params"] / gpus
    if pp > 1:  # the stage's dense weights split by tp, its experts by ep
        gathered = bytes_ * (dense / tp + model["expert_params"] / ep) / pp
    else:  # one layer of each kind, twice
        gathered = (
            2 * bytes_ * (dense / model["layers"] / tp + model["expert_params"] / max(model["moe_layers"], 1) / ep)
        )
    in_flight = min(pp, m) if pp > 1 else m
    kept = model["layers"] / pp * in_flight * model["seq"] * model["hidden"] * bytes_ / tp
    block = block_formula(1 if pp > 1 else m, model["seq"], model["hidden"], model["heads"], "sdpa", bytes_) / tp
    total = states + gathered + kept + block
    return {"states": states, "gathered": gathered, "activations": kept + block, "total": total}


def traffic(model: dict, layout: dict, *, recompute: bool = True, bytes_: int = 2, sublayers: int = 2) -> dict:
    """Bytes each GPU sends per step, per mesh dimension (ring algorithms: (n-1)/n of a full tensor).

    tp: chapter 10's 8 collectives per transformer layer (11 with ``recompute``), each of the
        micro-batch's tokens · hidden, for ``sublayers`` / 2 of a layer (a stand-in has 1);
    ep: per MoE layer, dispatch and combine in forward, both again in backward (and in the
        recomputed forward): each sends (ep-1)/ep of the GPU's tokens · top_k rows;
    pp: per micro-batch, the activation to the next stage and its gradient to the previous
        one (a middle stage; with 2 stages each sends one of the two);
    dp: FSDP of the dense parameters over dp, of the experts over (edp, tp): all-gather in
        forward, again in backward, reduce-scatter (3 passes); with pp, torchtitan keeps the
        parameters gathered between micro-batches and reduces once per step (2 passes).
    """
    pp, dp, tp, ep = layout["pp"], layout["dp"], layout["tp"], layout["ep"]
    m, stage = microbatches(model, layout), model["layers"] / pp
    tokens = model["seq"] * bytes_ * model["hidden"]  # one micro-batch's activations, in bytes
    tp_calls = meshes.tp_collectives_per_layer(recompute) * sublayers / 2
    ep_calls = 6 if recompute else 4
    passes = 2 if pp > 1 else 3
    dense = model["params"] - model["expert_params"]
    return {
        "tp": tp_calls * stage * m * _ring(tp) * tokens if tp > 1 else 0.0,
        "ep": ep_calls * model["moe_layers"] / pp * m * model["top_k"] * _ring(ep) * tokens / tp if ep > 1 else 0.0,
        "pp": (2 if pp > 2 else 1) * m * tokens / tp if pp > 1 else 0.0,
        "dp": passes * _ring(dp) * dense / (pp * tp) * bytes_ if dp > 1 else 0.0,
        "edp": passes * _ring(dp // ep * tp) * model["expert_params"] / (pp * ep) * bytes_
        if dp // ep * tp > 1
        else 0.0,
    }


def step_time(model: dict, cluster: dict, layout: dict, overlap: tuple = ()) -> dict:
    """Seconds per step: compute 8 · active params · tokens (full checkpointing) over the GPUs of a
    replica, stretched by the pipeline bubble (pp-1)/(m+pp-1); tp, ep and pp traffic on the
    critical path, data-parallel traffic hidden behind compute up to the compute time.
    ``overlap``: more dimensions whose traffic hides behind compute (DeepSeek's DualPipe
    overlaps the expert all-to-alls of one micro-batch with another's compute: ("ep",))."""
    pp, tp, m = layout["pp"], layout["tp"], microbatches(model, layout)
    compute = 8 * model["active"] * m * model["seq"] / (pp * tp) / cluster["flops"]
    bubble = compute * (pp - 1) / m
    seconds = {}
    for name, sent in traffic(model, layout).items():
        slow = spans_nodes(layout, groups(layout)[name], cluster["gpus_per_node"])
        seconds[name] = sent / (cluster["inter"] if slow else cluster["intra"])
    behind = ("dp", "edp") + tuple(overlap)
    hidden = sum(seconds[name] for name in behind)
    exposed = sum(s for name, s in seconds.items() if name not in behind) + max(0.0, hidden - compute)
    return {"compute": compute, "bubble": bubble, "exposed": exposed, "total": compute + bubble + exposed} | {
        f"{name} seconds": s for name, s in seconds.items()
    }


def candidates(model: dict, cluster: dict, nodes: int):
    """Every (pp, dp, tp, ep) on ``nodes`` nodes: tp inside a node, pp at most 16 stages of at
    least 2 layers, ep dividing dp and the experts, at least pp micro-batches per step."""
    gpus = nodes * cluster["gpus_per_node"]
    for tp in (t for t in (1, 2, 4, 8) if t <= cluster["gpus_per_node"]):
        for pp in (p for p in (1, 2, 4, 8, 16) if model["layers"] >= 2 * p or p == 1):
            dp, rest = divmod(gpus, tp * pp)
            if rest or model["batch"] % dp or microbatches(model, {"dp": dp}) < pp:
                continue
            for ep in (e for e in (1, 2, 4, 8, 16, 32, 64) if dp % e == 0 and (e == 1 or model["experts"] % e == 0)):
                yield {"pp": pp, "dp": dp, "tp": tp, "ep": ep}


def choose(model: dict, cluster: dict, nodes: int, overlap: tuple = ()) -> dict:
    """The fastest layout that fits in the GPUs' memory, chapter 10's ``meshes.choose`` with two
    more dimensions: pipeline stages (schedule 1F1B, one sequence per micro-batch) and expert
    parallelism. On a tie (same step time to the millisecond) the one with fewer stages, then
    less TP, then less EP. ``layout`` is None, with a verdict, when nothing fits.
    ``overlap``: as in ``step_time``."""
    rows = []
    for layout in candidates(model, cluster, nodes):
        need = memory(model, layout)
        layout |= {"schedule": "1F1B" if layout["pp"] > 1 else None, "microbatches": microbatches(model, layout)}
        rows.append({"layout": layout, "memory": need, "fits": need["total"] <= cluster["memory"]})
        rows[-1] |= step_time(model, cluster, layout, overlap)
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return {"layout": None, "verdict": tr("does not fit: more GPUs or fewer bytes per parameter"), "rows": rows}
    best = min(fitting, key=lambda r: (round(r["total"], 3), r["layout"]["pp"], r["layout"]["tp"], r["layout"]["ep"]))
    return {"layout": best["layout"], "verdict": describe(best["layout"]), "best": best, "rows": rows}


def describe(layout: dict) -> str:
    """``pp 16 (1F1B, 8 micro-batches) × dp 32 (ep 8) × tp 1``."""
    pp = f"pp {layout['pp']}"
    if layout["pp"] > 1:
        pp += (
            " ("
            + tr("{schedule}, {m} micro-batches").format(schedule=layout["schedule"], m=layout["microbatches"])
            + ")"
        )
    return f"{pp} × dp {layout['dp']} (ep {layout['ep']}) × tp {layout['tp']}"


# --------------------------------------------------------------------------------------
# 2. A dry run at the real world size, on the fake process group
# --------------------------------------------------------------------------------------


class StepTraffic(meshes.CommVolume):
    """Chapter 10's byte counter, plus all-to-alls of floating-point rows (``experts.all_to_all_sent``;
    the integer ids sent beside them are left out) and point-to-point sends."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.__name__.split(".")[0] == "send":
            tensor, group = args[0][0], dist.ProcessGroup.unbox(args[1])
            sent = tensor.numel() * tensor.element_size()
            self.records.append({"kind": "send", "group": group.group_name, "size": group.size(), "bytes": sent})
        elif (record := experts.all_to_all_sent(func, args)) is not None:
            if record.pop("floating"):
                self.records.append({"kind": "all-to-all"} | record)
        else:
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


class StandInExperts(nn.Module):
    """This rank's ``local`` experts of one MoE layer (a module of its own: FSDP2 shards it)."""

    def __init__(self, hidden: int, local: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(local, hidden, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(local, hidden, hidden) / hidden**0.5)

    def forward(self, x, routing, group):
        return experts.dispatch_combine(x, routing, self.w1, self.w2, group, symmetric=True)


class StandInBlock(nn.Module):
    """One layer of the stand-in: an MLP (tensor parallel, sequence parallel) then, for an MoE
    model (``local`` > 0), an MoE layer (expert parallel), both with residuals."""

    def __init__(self, hidden: int, local: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 2 * hidden, bias=False), nn.GELU(), nn.Linear(2 * hidden, hidden, bias=False)
        )
        self.moe = StandInExperts(hidden, local) if local else None

    def forward(self, x, routing, group):
        x = x + self.mlp(x)
        return x if self.moe is None else x + self.moe(x, routing, group)


def standin(model: dict, layout: dict) -> dict:
    """The tiny model the dry run trains, in ``model``'s own terms (for ``traffic``): one stand-in
    block per stage, one expert per ep rank (none for a dense model), ``model``'s top-k, 2 micro-batches (1 without pp)
    of tp · ep tokens (so that round-robin routing is exactly even), fp32. Its hidden size is
    the smallest power of 2 (at least 16) that every FSDP2 shard divides: no padding."""
    hidden = max(16, layout["dp"] * layout["tp"])
    layers, experts_ = layout["pp"], layout["ep"] if model["experts"] else 0
    dense, expert = layers * 4 * hidden**2, layers * experts_ * 2 * hidden**2
    return dict(
        params=dense + expert,
        active=0,
        expert_params=expert,
        layers=layers,
        moe_layers=layers if experts_ else 0,
        hidden=hidden,
        heads=1,
        experts=experts_,
        top_k=model["top_k"],
        seq=layout["tp"] * layout["ep"],
        batch=layout["dp"] * (2 if layout["pp"] > 1 else 1),
    )


def _mesh(layout: dict) -> dict:
    """The (pp, edp, ep, tp) mesh and the 1-D meshes the stand-in uses, by name."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout["pp"], layout["dp"] // layout["ep"], layout["ep"], layout["tp"])
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMS)
    return {
        "pp": mesh["pp"],
        "ep": mesh["ep"],
        "tp": mesh["tp"],
        "dp": mesh["edp", "ep"]._flatten("dp"),  # dense FSDP runs over both
        "edp_tp": mesh["edp", "tp"]._flatten("edp_tp"),  # the experts' FSDP: the ranks holding the same experts
    }


def _stage(small: dict, layout: dict, mesh):
    """This rank's stage of the stand-in: TP on "tp", experts split over "ep", FSDP2 on top."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    local = small["experts"] // layout["ep"]
    blocks = nn.ModuleList(StandInBlock(small["hidden"], local) for _ in range(small["layers"] // layout["pp"]))
    plan = {"mlp.0": ColwiseParallel(input_layouts=Shard(0)), "mlp.2": RowwiseParallel(output_layouts=Shard(0))}
    keep = layout["pp"] > 1  # torchtitan: with pp, parameters stay gathered between micro-batches
    by_hidden = lambda p: Shard(1)  # noqa: E731  (experts: dim 0 counts the few local experts)
    for block in blocks:
        if layout["tp"] > 1:
            parallelize_module(block, mesh["tp"], plan)
        if block.moe is not None:
            fully_shard(block.moe, mesh=mesh["edp_tp"], reshard_after_forward=not keep, shard_placement_fn=by_hidden)
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=not keep)
    return blocks


def _run_stage(blocks, small: dict, layout: dict, mesh) -> None:
    """Forward and backward of every micro-batch through this stage, with the stage's sends."""
    stage, pp, ep = mesh["pp"].get_local_rank(), layout["pp"], mesh["ep"].get_group()
    pp_group = mesh["pp"].get_group()
    tokens, k = small["seq"] // layout["tp"], small["top_k"]
    token_choice = torch.arange(tokens * k).view(tokens, k)
    local = max(1, small["experts"] // layout["ep"])
    routing = {
        "chosen": (token_choice % layout["ep"]) * local,  # round robin over the ep ranks: even by construction
        "weights": torch.full((tokens, k), 1 / max(k, 1)),
        "keep": torch.ones(tokens, k, dtype=torch.bool),
    }
    m = microbatches(small, layout)
    for i in range(m):
        last = i == m - 1
        for module in (m_ for block in blocks for m_ in (block, block.moe) if m_ is not None):
            module.set_requires_gradient_sync(last)  # one reduce-scatter per step, on the last micro-batch
            module.set_reshard_after_backward(last)  # and the parameters stay gathered until then
        x = torch.zeros(tokens, small["hidden"], requires_grad=True)  # what the previous stage sent
        h = x
        for block in blocks:
            h = block(h, routing, ep)
        if stage < pp - 1:
            dist.send(h.detach(), group=pp_group, group_dst=stage + 1)
            h.backward(torch.zeros_like(h))  # the gradient the next stage sends back
        else:
            h.sum().backward()
        if stage > 0:
            dist.send(x.grad, group=pp_group, group_dst=stage - 1)


def dry_run(model: dict, layout: dict, rank: int | None = None) -> dict:
    """One step of ``standin(model, layout)`` as rank ``rank`` (default: the first rank of a
    middle stage) of ``pp · dp · tp`` ranks, on the fake process group, in this process.

    The fake backend returns from every collective at once without moving data, so the step
    runs in milliseconds at any world size; what it measures is which collectives each rank
    issues and their sizes. Returns {dimension: {"calls": n, "bytes": b}} and the stand-in."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    world = layout["pp"] * layout["dp"] * layout["tp"]
    rank = (layout["pp"] // 2) * (world // layout["pp"]) if rank is None else rank
    small = standin(model, layout)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        mesh = _mesh(layout)
        names = {m.get_group().group_name: d for d, m in mesh.items()}
        blocks = _stage(small, layout, mesh)
        recorder = StepTraffic()
        with recorder:
            _run_stage(blocks, small, layout, mesh)
        counted = {}
        for r in recorder.records:
            dim = {"edp_tp": "edp"}.get(names.get(r["group"]), names.get(r["group"], "world"))
            calls, sent = counted.get(dim, {}).get("calls", 0), counted.get(dim, {}).get("bytes", 0.0)
            counted[dim] = {"calls": calls + 1, "bytes": sent + r["bytes"]}
        return {"rank": rank, "world": world, "standin": small, "counted": counted}
    finally:
        dist.destroy_process_group()
