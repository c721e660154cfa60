"""Mixture of experts in chapter 13: a routed MoE block in one process, then expert parallelism.

1. ``route``, ``capacity``, ``aux_loss``: top-k routing with a capacity per expert (tokens past
   it are dropped) and the load-balancing loss of Switch Transformer / GShard;
2. ``MoE`` and ``reference``: a small model (input layer, router, experts, output layer) trained
   one step in one process, its tokens routed in groups of ``TOKENS`` (one group per rank);
3. ``ep_step`` (rank function, 4 ranks): the experts split over the ranks, tokens dispatched to
   them and combined with ``all_to_all_single``, the dense layers sharded with FSDP2; outputs,
   losses and gradients returned for comparison with ``reference``;
4. ``imbalance`` (rank function): the same dispatch with a router biased towards expert 0:
   tokens per expert and rank, tokens dropped, bytes and time of each rank.

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .common.sharded import full
from .common.timing import clock
from .runtime.hardware import rank_device

SIZES = dict(inputs=12, hidden=16, ffn=32, experts=8, top_k=2, classes=5)
TOKENS = 32  # tokens per rank (one routing group)
WORLD = 4
ALPHA = 0.01  # weight of the auxiliary loss (Switch Transformer's value)
CAPACITY_FACTOR = 1.25


# --------------------------------------------------------------------------------------
# 1. Routing
# --------------------------------------------------------------------------------------


def capacity(tokens: int, experts: int, top_k: int, factor: float | None) -> int | None:
    """Slots per expert in a group of ``tokens`` tokens: ceil(factor · tokens · top_k / experts).

    A perfectly balanced router sends tokens · top_k / experts to each expert; the factor is
    the headroom (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021, eq. 3).
    None: no capacity, nothing is dropped.
    """
    return None if factor is None else math.ceil(factor * tokens * top_k / experts)


def route(logits: torch.Tensor, top_k: int, slots: int | None) -> dict:
    """Top-k routing of one group: probabilities, chosen experts, gate weights, and which of the
    (token, choice) pairs fit in their expert's ``slots`` (in the order of the tokens)."""
    probs = logits.float().softmax(-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)  # the k gates of a token add up to 1
    onehot = F.one_hot(chosen.flatten(), logits.shape[-1])  # token-major: token 0's choices first
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in its expert's queue
    keep = torch.ones_like(position, dtype=torch.bool) if slots is None else position < slots
    load = onehot.sum(0)  # assignments per expert, before dropping
    return {"probs": probs, "chosen": chosen, "weights": weights, "keep": keep.view_as(chosen), "load": load}


def dropped(load: torch.Tensor, slots: int | None) -> int:
    """Assignments past their expert's capacity: sum over experts of max(0, load − slots)."""
    return 0 if slots is None else int((load - slots).clamp(min=0).sum())


def aux_loss(load: torch.Tensor, prob_sum: torch.Tensor, tokens: int, top_k: int, alpha: float = ALPHA):
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4), for top-k choices:
    alpha · E · sum_i f_i · P_i, with f_i the share of the tokens' k choices that went to expert
    i and P_i the mean router probability of expert i. Equal to alpha when both are uniform,
    larger when the router favours experts it also sends many tokens to. ``load`` carries no
    gradient (a count); the loss trains the router through ``prob_sum``."""
    experts = load.numel()
    f = load.float() / (tokens * top_k)
    return alpha * experts * (f * (prob_sum / tokens)).sum()


def expert_mlp(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Expert ``ids[j]`` (an index into w1, w2) applied to row j of x: gelu(x w1ᵀ) w2ᵀ."""
    y = x.new_zeros(x.shape[0], w2.shape[1])
    for e in ids.unique().tolist():
        rows = ids == e
        y[rows] = F.gelu(x[rows] @ w1[e].T) @ w2[e].T
    return y


# --------------------------------------------------------------------------------------
# 2. The model and one process
# --------------------------------------------------------------------------------------


class MoE(nn.Module):
    """x -> h = inp(x) -> h + MoE(h) -> out: the experts are two stacked weights (E, ffn, h) and
    (E, h, ffn); ``router_bias`` is added to the router's logits (0 unless a demonstration skews it)."""

    def __init__(self, inputs, hidden, ffn, experts, top_k, classes):
        super().__init__()
        self.top_k = top_k
        self.inp = nn.Linear(inputs, hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, ffn, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)
        self.out = nn.Linear(hidden, classes)
        self.register_buffer("router_bias", torch.zeros(experts))


def build(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(**SIZES)


def batch(world: int = WORLD, tokens: int = TOKENS, seed: int = 1):
    """The global batch: ``world`` groups of ``tokens`` inputs and class labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * tokens, SIZES["inputs"], generator=g)
    y = torch.randint(0, SIZES["classes"], (world * tokens,), generator=g)
    return x, y


def _combine(h, routing, expert_out):
    """Each kept (token, choice) adds gate · expert output to its token; dropped ones add nothing."""
    k = routing["chosen"].shape[1]
    token = torch.arange(h.shape[0], device=h.device).repeat_interleave(k)
    keep = routing["keep"].flatten()
    gates = routing["weights"].flatten()[keep, None]
    return h.new_zeros(h.shape).index_add(0, token[keep], expert_out * gates)


def reference(factor: float | None = CAPACITY_FACTOR, world: int = WORLD, tokens: int = TOKENS) -> dict:
    """One process, the whole batch, routed in ``world`` groups of ``tokens`` tokens (each group
    with its own capacity, as each rank has below): logits, losses, load, drops, gradients."""
    model = build()
    x, y = batch(world, tokens)
    slots = capacity(tokens, SIZES["experts"], SIZES["top_k"], factor)
    h = model.inp(x)
    moe, probs, loads, kept, drops = [], [], [], [], 0
    for group in h.split(tokens):
        r = route(model.router(group) + model.router_bias, model.top_k, slots)
        keep = r["keep"].flatten()
        ids = r["chosen"].flatten()[keep]
        rows = group.repeat_interleave(model.top_k, 0)[keep]
        moe.append(_combine(group, r, expert_mlp(model.w1, model.w2, rows, ids)))
        probs.append(r["probs"])
        loads.append(r["load"])
        kept.append(torch.bincount(ids, minlength=SIZES["experts"]))
        drops += dropped(r["load"], slots)
    logits = model.out(h + torch.cat(moe))
    task = F.cross_entropy(logits, y)
    load = torch.stack(loads).sum(0)
    aux = aux_loss(load, torch.cat(probs).sum(0), world * tokens, model.top_k)
    (task + aux).backward()
    return {
        "logits": logits.detach(),
        "task": task.item(),
        "aux": aux.item(),
        "load": load,
        "loads": torch.stack(loads),  # (group, expert): assignments before dropping
        "kept": torch.stack(kept),  # (group, expert): assignments each group sends each expert
        "dropped": drops,
        "slots": slots,
        "mean probs": torch.cat(probs).mean(0).detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def loss_terms(world: int = WORLD, tokens: int = TOKENS) -> int:
    """Additions behind the gradients: across each layer's width forward and backward, then over the batch."""
    s = SIZES
    return 2 * (s["inputs"] + s["hidden"] + s["ffn"] + s["hidden"] + s["classes"]) + world * tokens


# --------------------------------------------------------------------------------------
# 3. Expert parallelism
# --------------------------------------------------------------------------------------


def all_to_all_sent(func, args) -> dict | None:
    """For an all-to-all op seen by a dispatch mode: its group, dtype and the bytes this rank
    sends to other ranks (the rows for itself stay in memory); None for any other op."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = func.__name__.split(".")[0]
    if func.namespace == "c10d" and name == "alltoall_base_":  # dist.all_to_all_single
        tensor, group, splits = args[1], dist.ProcessGroup.unbox(args[2]), list(args[4])
    elif func.namespace.startswith("_c10d_functional") and name == "all_to_all_single":  # differentiable
        tensor, group, splits = args[0], _resolve_process_group(args[3]), list(args[2] or [])
    else:
        return None
    splits = splits or [tensor.shape[0] // group.size()] * group.size()
    row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
    sent = (sum(splits) - splits[group.rank()]) * row
    return {"group": group.group_name, "size": group.size(), "floating": tensor.is_floating_point(), "bytes": sent}


class AllToAllBytes(TorchDispatchMode):
    """Records each all-to-all this rank issues (``all_to_all_sent``)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (record := all_to_all_sent(func, args)) is not None:
            self.records.append(record)
        return func(*args, **(kwargs or {}))


def dispatch_combine(h, routing, w1_local, w2_local, group=None, symmetric: bool = False) -> torch.Tensor:
    """Send each kept (token, choice) to the rank holding its expert, run the experts there,
    send the results back (``all_to_all_single`` both ways, differentiable) and combine.
    ``symmetric``: every rank receives as many rows from each rank as it sends it (a routing
    even by construction), so the counts need not be exchanged first."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    world, local = dist.get_world_size(group), w1_local.shape[0]
    keep = routing["keep"].flatten()
    ids = routing["chosen"].flatten()[keep]
    order = ids.argsort(stable=True)  # grouped by expert, hence by destination rank
    rows = h.repeat_interleave(routing["chosen"].shape[1], 0)[keep][order]
    send = torch.bincount(ids // local, minlength=world)
    recv = send.clone()
    if not symmetric:
        dist.all_to_all_single(recv, send, group=group)  # how many rows each rank will send me
    send, recv = send.tolist(), recv.tolist()
    their_ids = ids.new_zeros(sum(recv))
    dist.all_to_all_single(their_ids, ids[order], recv, send, group=group)
    group = group or dist.group.WORLD
    arrived = all_to_all_single_autograd(rows, recv, send, group)
    done = expert_mlp(w1_local, w2_local, arrived, their_ids % local)
    back = all_to_all_single_autograd(done, send, recv, group)
    expert_out = torch.empty_like(back).index_copy(0, order, back)  # undo the sort
    return _combine(h, routing, expert_out)


def _ep_model(mesh):
    """The model with this rank's experts only, its dense layers sharded with FSDP2 over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    model = build().to(rank_device())
    local = SIZES["experts"] // mesh.size()
    mine = slice(mesh.get_local_rank() * local, (mesh.get_local_rank() + 1) * local)
    model.w1 = nn.Parameter(model.w1.detach()[mine].clone())
    model.w2 = nn.Parameter(model.w2.detach()[mine].clone())
    for layer in (model.inp, model.router, model.out):
        fully_shard(layer, mesh=mesh)
    return model, mine


def ep_step(factor: float | None = CAPACITY_FACTOR) -> dict:
    """Rank function: one forward and backward of ``MoE`` with expert parallelism.

    Every rank takes its own ``TOKENS`` of the global batch (data parallel) and holds
    experts/world of the experts (expert parallel, over the same ranks, as torchtitan
    borrows its ep dimension from data parallelism). The auxiliary loss needs the whole
    batch's load (all-reduced: a count, no gradient) and mean probabilities. Each rank
    differentiates world × its own tokens' share of the probability term: the mean of those
    over the ranks is the whole batch's loss, and FSDP2 averages the gradients over the ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(rank_device().type, (world,), mesh_dim_names=("dp",))
    model, mine = _ep_model(mesh)
    x, y = (t.split(TOKENS)[rank].to(rank_device()) for t in batch(world))
    slots = capacity(TOKENS, SIZES["experts"], SIZES["top_k"], factor)
    recorder = AllToAllBytes()
    with recorder:
        h = model.inp(x)
        r = route(model.router(h) + model.router_bias, model.top_k, slots)
        logits = model.out(h + dispatch_combine(h, r, model.w1, model.w2))
        load = r["load"].clone()
        dist.all_reduce(load)
        aux = aux_loss(load, world * r["probs"].sum(0), world * TOKENS, model.top_k)
        task = F.cross_entropy(logits, y)
        (task + aux).backward()
    for p in (model.w1, model.w2):
        # each rank differentiates its own mean loss; an expert's gradient arrives summed over the
        # ranks' losses, where FSDP2 averages the dense layers' gradients: average here too
        p.grad /= world
    grads = {n: full(p.grad).detach().cpu() for n, p in model.named_parameters() if n not in ("w1", "w2")}
    tokens_bytes = sum(r["bytes"] for r in recorder.records if r["floating"])
    losses = torch.stack([task, aux]).detach()
    dist.all_reduce(losses)  # the means over the ranks: the whole batch's losses
    return {
        "logits": logits.detach().cpu(),
        "task": losses[0].item() / world,
        "aux": losses[1].item() / world,
        "experts": (mine.start, mine.stop),
        "expert grads": {"w1": model.w1.grad.cpu(), "w2": model.w2.grad.cpu()},
        "grads": grads,
        "dropped": dropped(r["load"], slots),
        "all-to-alls": len(recorder.records),
        "token bytes": tokens_bytes,
    }


def expected_bytes(kept: torch.Tensor, rank: int, hidden: int = SIZES["hidden"], element: int = 4) -> dict:
    """Bytes rank ``rank`` sends in one step, from the one-process routing table ``kept``
    (group x expert: kept assignments). Dispatch: its rows for experts on other ranks;
    combine: the rows other ranks sent it, returned. Backward repeats both, reversed."""
    world, experts = kept.shape
    owner = torch.arange(experts) // (experts // world)
    dispatch = int(kept[rank][owner != rank].sum()) * hidden * element
    combine = int(kept[:, owner == rank].sum() - kept[rank][owner == rank].sum()) * hidden * element
    return {"dispatch": dispatch, "combine": combine, "step": 2 * (dispatch + combine)}


def uniform_bytes(tokens: int, top_k: int, world: int, hidden: int, element: int = 4) -> float:
    """The same for a router that spreads every choice evenly and drops nothing:
    each all-to-all sends tokens · k · (world − 1)/world rows of ``hidden`` values; 4 per step."""
    return 4 * tokens * top_k * (world - 1) / world * hidden * element


# --------------------------------------------------------------------------------------
# 4. Unbalanced routing
# --------------------------------------------------------------------------------------


def _imbalance_run(model, x, bias: float, factor, repeats: int) -> dict:
    """Forward-only dispatch with ``bias`` added to expert 0's logit: what each rank receives."""
    world = dist.get_world_size()
    model.router_bias.zero_()[0] = bias
    slots = capacity(x.shape[0], SIZES["experts"], SIZES["top_k"], factor)
    with torch.no_grad():
        h = model.inp(x)
        r = route(model.router(h) + model.router_bias, model.top_k, slots)
        keep = r["keep"].flatten()
        ids = r["chosen"].flatten()[keep]
        per_expert = torch.bincount(ids, minlength=SIZES["experts"])
        total = per_expert.clone()
        dist.all_reduce(total)  # tokens each expert receives from all ranks
        recorder = AllToAllBytes()
        dist.barrier()
        started = clock(x.device)
        with recorder:
            for _ in range(repeats):
                dispatch_combine(h, r, model.w1, model.w2)
        seconds = (clock(x.device) - started) / repeats  # clock() waits for the queued kernels
    local = SIZES["experts"] // world
    mine = slice(dist.get_rank() * local, (dist.get_rank() + 1) * local)
    return {
        "sent per expert": per_expert.tolist(),
        "load": r["load"].tolist(),
        "received per expert": total.tolist(),
        "received": int(total[mine].sum()),
        "dropped": dropped(r["load"], slots),
        "slots": slots,
        "bytes": sum(rec["bytes"] for rec in recorder.records if rec["floating"]) / repeats,
        "seconds": seconds,
    }


def imbalance(bias: float = 20.0, tokens: int = 256, factor: float = CAPACITY_FACTOR, repeats: int = 3) -> dict:
    """Rank function: dispatch and combine ``tokens`` tokens per rank, with an unbiased router and
    with ``bias`` added to expert 0's logit, each without capacity and with ``factor``.
    A bias of 20 makes expert 0 every token's first choice (its probability is then near 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(rank_device().type, (world,), mesh_dim_names=("ep",))
    model, _ = _ep_model(mesh)
    x = torch.randn(tokens, SIZES["inputs"], generator=torch.Generator().manual_seed(10 + rank)).to(rank_device())
    _imbalance_run(model, x, 0.0, None, 1)  # warm-up: the first dispatch pays for allocations
    runs = {}
    for name, b in (("balanced", 0.0), ("biased", bias)):
        for cap in (None, factor):
            runs[(name, cap)] = _imbalance_run(model, x, b, cap, repeats)
    return {"rank": rank, "tokens": tokens, "runs": runs}


def ep_all(factor: float | None = CAPACITY_FACTOR) -> dict:
    """Rank function: ``ep_step`` and ``imbalance`` in one launch (starting 4 ranks costs more than both)."""
    return {"step": ep_step(factor), "imbalance": imbalance()}
