"""Pipeline schedules in practice, and a pipeline inside FSDP2 (chapter 13).

Chapter 06 ran ``ScheduleGPipe`` and ``Schedule1F1B`` on a two-stage MLP. Here a small GPT
is cut into stages by hand (``split``) and run by four schedules of
``torch.distributed.pipelining``, on 2 and on 4 ranks:

* ``schedule_sweep`` (rank function): GPipe, 1F1B, interleaved 1F1B and interleaved zero
  bubble; every forward and backward a rank runs is timed (``_record`` wraps the stage's
  methods), so the notebook draws what the ranks did, not what the schedule planned;
* ``simulate`` and ``bubble``: the order each rank ran, replayed with unit costs, gives the
  bubble without wall-clock noise; ``predicted_bubble`` is the formula;
* ``peak_live``: how many micro-batches' activations a stage held at once, from the events;
* ``pp_fsdp_step`` (rank function, 4 ranks as dp = 2 x pp = 2): FSDP2 inside each stage,
  its all-gathers and reduce-scatters counted, and ``clip_grad_norm_pp``: clipping by the
  norm of the whole model, combined over the pp group;
* ``reference``: the same model and batch in one process.

Builds on: meshes

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from .common.models import gpt
from .common.sharded import full
from .common.timing import clock
from .meshes import CommVolume
from .runtime.hardware import rank_device
from .runtime.i18n import tr

SIZES = {"vocab": 32, "hidden": 32, "heads": 2, "layers": 8}
SEQ, BATCH = 8, 8  # tokens per sequence, sequences per step
MAX_NORM = 0.5  # below the whole model's gradient norm, so clipping really scales
LR = 0.1
# name: (schedule class, stages per rank)
SCHEDULES = {
    "GPipe": (ScheduleGPipe, 1),
    "1F1B": (Schedule1F1B, 1),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2),
}
COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}  # unit costs for ``simulate``: a backward costs two forwards


def tokens(step: int = 0, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of global batch ``step``: fixed random tokens."""
    generator = torch.Generator().manual_seed(100 + step)
    text = torch.randint(0, SIZES["vocab"], (batch, SEQ + 1), generator=generator)
    return text[:, :-1], text[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: the schedule's ``loss_fn``, called once per micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_terms(batch: int = BATCH) -> int:
    """The additions chained into the loss and gradients (``terms`` for ``common.numerics``).

    Per block: two LayerNorms (h each, twice), the four attention projections and w1 (h each),
    the scores (h / heads) and the weighted values (the sequence), w2 (4h); then the final
    norm, the output layer, the cross-entropy over the vocabulary and the mean over tokens.
    """
    h = SIZES["hidden"]
    block = 2 * 2 * h + 5 * h + h // SIZES["heads"] + 2 * SEQ + 4 * h
    return SIZES["layers"] * block + 3 * h + SIZES["vocab"] + batch * SEQ


class Stage(nn.Module):
    """Consecutive blocks of a GPT, with its embedding if first and its norm and output if last.

    The parts are the whole model's own modules under the same attribute names, so a stage's
    parameter names (``layers.3.attention.wq.weight``) are those of the whole model.
    """

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in blocks})
        self.norm, self.output = (model.norm, model.output) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x)) if self.output is not None else x


def split(model: nn.Module, n_stages: int) -> list[Stage]:
    """Cut ``model`` (a ``common.models.GPT``) into ``n_stages`` stages of equally many blocks."""
    n = len(model.layers)
    if n % n_stages:
        raise ValueError(f"{n} blocks do not split into {n_stages} equal stages")
    per = n // n_stages
    return [Stage(model, range(s * per, (s + 1) * per), s == 0, s == n_stages - 1) for s in range(n_stages)]


def traced_split(split_at: int = 4) -> dict:
    """The tracer's cut: ``pipeline()`` exports the whole model and splits it before block ``split_at``.

    In one process: the parameter names of each traced stage, and the largest difference
    between the two stage modules chained and the whole model.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = gpt(**SIZES)
    inputs, _ = tokens()
    with warnings.catch_warnings():  # torch.export's own deprecation notices, not the learner's business
        warnings.simplefilter("ignore")
        pipe = pipeline(model, mb_args=(inputs,), split_spec={f"layers.{split_at}": SplitPoint.BEGINNING})
    stages = [pipe.get_stage_module(s) for s in range(pipe.num_stages)]
    with torch.no_grad():
        gap = (stages[1](stages[0](inputs)) - model(inputs)).abs().max().item()
    return {"stages": pipe.num_stages, "names": [[n for n, _ in s.named_parameters()] for s in stages], "gap": gap}


def stage_indices(rank: int, p: int, v: int) -> list[int]:
    """The stages rank ``rank`` holds: ``rank``, ``rank + p``, ... (the interleaved, "loop" layout)."""
    return [rank + k * p for k in range(v)]


def _record(stage: PipelineStage, events: list, t0: list, collectives=lambda: None) -> None:
    """Log (kind, stage, micro-batch, start, end, collectives so far) of everything the stage computes.

    The schedules call these methods of the stage; wrapping them on this one object changes
    nothing else. "B" is a full backward, "I" the input-gradient half and "W" the weight-gradient
    half that zero-bubble schedules run apart. ``collectives()`` says what FSDP2 issued so far.
    """
    s = stage.stage_index
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def timed(kind, fn, i, *args, **kwargs):  # on a GPU, clock() waits for the stage's queued kernels
        start = clock(stage.device) - t0[0]
        out = fn(i, *args, **kwargs)
        events.append((kind, s, i, start, clock(stage.device) - t0[0], collectives()))
        return out

    def backward_one_chunk(i, *args, full_backward=True, **kwargs):
        return timed("B" if full_backward else "I", backward, i, *args, full_backward=full_backward, **kwargs)

    stage.forward_one_chunk = lambda i, *a, **k: timed("F", forward, i, *a, **k)
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = lambda i, *a, **k: timed("W", weight, i, *a, **k)


def _examples(index: int, n_stages: int, micro: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of stage ``index`` for one micro-batch (the shapes crossing its cuts)."""
    h, vocab = SIZES["hidden"], SIZES["vocab"]
    example_in = (
        torch.zeros(micro, SEQ, dtype=torch.long, device=device)
        if index == 0
        else torch.empty(micro, SEQ, h, device=device, requires_grad=True)
    )
    width = vocab if index == n_stages - 1 else h
    return example_in, torch.empty(micro, SEQ, width, device=device, requires_grad=True)


def _build(modules: list[nn.Module], indices: list[int], n_stages: int, micro: int, group) -> list[PipelineStage]:
    device = rank_device()
    stages = []
    for module, s in zip(modules, indices):
        example_in, example_out = _examples(s, n_stages, micro, device)
        stages.append(
            PipelineStage(module, s, n_stages, device, input_args=example_in, output_args=example_out, group=group)
        )
    return stages


def _step(runner, stages: list[PipelineStage], n_stages: int, inputs, targets) -> list:
    """One schedule step: the rank with stage 0 feeds the inputs, the one with the last stage the targets."""
    indices = [s.stage_index for s in stages]
    losses: list = []
    args = (inputs.to(rank_device()),) if 0 in indices else ()
    kwargs = {"target": targets.to(rank_device()), "losses": losses} if n_stages - 1 in indices else {}
    runner.step(*args, **kwargs)
    return [loss.item() for loss in losses]


def run_schedule(name: str, n_micro: int, group=None) -> dict:
    """One schedule on the ranks of ``group``: a warm-up step, then a recorded step from the same weights.

    Returns this rank's stages, the events of the recorded step, the micro-batch losses (on the
    rank with the last stage) and its stages' gradients, named as in the whole model.
    """
    cls, v = SCHEDULES[name]
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    n_stages, inputs, targets = p * v, *tokens()
    indices = stage_indices(rank, p, v)
    parts = split(gpt(**SIZES).to(rank_device()), n_stages)
    modules = [parts[s] for s in indices]
    stages = _build(modules, indices, n_stages, BATCH // n_micro, group)
    runner = cls(stages[0] if v == 1 else stages, n_microbatches=n_micro, loss_fn=lm_loss)
    events: list = []
    t0 = [0.0]
    for stage in stages:
        _record(stage, events, t0)
    for _ in range(2):  # the first step also sets up the messaging; the second is the one shown
        for module in modules:
            module.zero_grad(set_to_none=True)
        events.clear()
        dist.barrier(group)
        t0[0] = clock(rank_device())
        losses = _step(runner, stages, n_stages, inputs, targets)
    grads = {n: p.grad.cpu() for m in modules for n, p in m.named_parameters()}
    return {"stages": indices, "events": list(events), "losses": losses, "grads": grads}


def schedule_sweep(names: list[str], n_micro: int) -> dict:
    """Rank function: each schedule in ``names`` on all ranks, one after the other, in one launch."""
    return {name: run_schedule(name, n_micro) for name in names}


# --------------------------------------------------------------------------------------
# Reading the events: order, bubble, memory
# --------------------------------------------------------------------------------------


def predicted_bubble(p: int, m: int, v: int = 1) -> float:
    """Idle share of each rank: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p-1) interleaved.

    Interleaving gives each rank v stages of 1/v the work: the fill and drain shrink v times.
    """
    if min(p, m, v) < 1:
        raise ValueError(f"p, m and v must be at least 1, got {p}, {m}, {v}")
    return (p - 1) / (v * m + p - 1)


def orders(run: list[dict]) -> list[list[tuple]]:
    """Per rank, the (kind, stage, micro-batch) it computed, in the order it did."""
    return [[e[:3] for e in sorted(r["events"], key=lambda e: e[3])] for r in run]


def _ready(kind: str, s: int, i: int, done: dict, last: int):
    """When the inputs of action (kind, s, i) are ready, or None while they are not computed yet.

    ("G", s, i) is when stage s sent the gradient of its input: after its B, or its I.
    """
    if kind == "F":
        needs = [("F", s - 1, i)] if s > 0 else []
    elif kind in "BI":
        needs = [("F", s, i)] + ([("G", s + 1, i)] if s < last else [])
    else:  # W needs its own I
        needs = [("I", s, i)]
    times = [done.get(n) for n in needs]
    return None if any(t is None for t in times) else max(times, default=0)


def simulate(rank_orders: list[list[tuple]], costs: dict = COSTS) -> list[list[tuple]]:
    """Replay each rank's order with unit costs: per rank, (kind, stage, mb, start, end).

    An action starts when its rank is free and its inputs exist: a forward needs the previous
    stage's forward of that micro-batch, a backward (B or I) the next stage's, a W its I.
    The result depends only on the orders, never on this machine's timing.
    """
    last = max(s for order in rank_orders for _, s, _ in order)
    done, free, nxt = {}, [0] * len(rank_orders), [0] * len(rank_orders)
    timeline: list[list[tuple]] = [[] for _ in rank_orders]
    while any(n < len(o) for n, o in zip(nxt, rank_orders)):
        progressed = False
        for r, order in enumerate(rank_orders):
            while nxt[r] < len(order):
                kind, s, i = order[nxt[r]]
                ready = _ready(kind, s, i, done, last)
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = done[(kind, s, i)] = start + costs[kind]
                if kind in "BI":
                    done[("G", s, i)] = free[r]
                timeline[r].append((kind, s, i, start, free[r]))
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("these orders wait on each other: no action can start")
    return timeline


def measured(run: list[dict]) -> list[list[tuple]]:
    """Per rank, the (kind, stage, mb, start, end) it recorded, in the order it ran them."""
    return [[e[:5] for e in sorted(r["events"], key=lambda e: e[3])] for r in run]


def bubble(timeline: list[list[tuple]]) -> list[float]:
    """Each rank's idle share of the whole step, from (kind, stage, mb, start, end) (simulated or measured)."""
    begin = min(e[3] for t in timeline for e in t)
    span = max(e[4] for t in timeline for e in t) - begin
    return [1 - sum(e[4] - e[3] for e in t) / span for t in timeline]


COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#8172B3"}


def plot_timeline(ax, timeline: list[list[tuple]], title: str, unit: float = 1e3, xlabel: str | None = None):
    """Gantt chart of (kind, stage, mb, start, end) per rank: one row per rank, one bar per action.

    Bars are labelled "kind stage.mb" where they have room; ``unit`` 1e3 shows milliseconds,
    1 the unit costs of ``simulate``.
    """
    if xlabel is None:
        xlabel = tr("time since the step started (ms)")
    total = max(e[4] for t in timeline for e in t) * unit
    for r, events in enumerate(timeline):
        for kind, s, i, start, end in events:
            width = (end - start) * unit
            ax.broken_barh([(start * unit, width)], (r - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white")
            if width > 0.035 * total:
                ax.text(
                    start * unit + width / 2, r, f"{kind}{s}.{i}", ha="center", va="center", fontsize=6, color="white"
                )
    ax.set_yticks(range(len(timeline)), [tr("rank {r}").format(r=r) for r in range(len(timeline))])
    ax.set_ylim(len(timeline) - 0.5, -0.5)
    ax.set_xlim(0, total * 1.01)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)


def _frees(kind: str, s: int, split_stages: set) -> bool:
    return kind == "B" or (kind == "W" and s in split_stages)


def peak_live(order: list[tuple]) -> dict[int, int]:
    """Per stage, the most micro-batches whose activations it held at once.

    A forward stores a micro-batch's activations; a full backward (B) frees them, and so does
    the weight half (W) when the backward is split, since W still needs the layer inputs.
    """
    split_stages = {s for kind, s, _ in order if kind == "W"}
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for kind, s, _ in order:
        if kind == "F":
            live[s] = live.get(s, 0) + 1
            peak[s] = max(peak.get(s, 0), live[s])
        elif _frees(kind, s, split_stages):
            live[s] -= 1
    return peak


def peak_held(order: list[tuple], v: int = 1) -> float:
    """The most activations a rank held at once, in micro-batches of its whole share of the model.

    A rank with v stages holds 1/v of its share per stage and micro-batch: live (stage,
    micro-batch) pairs count 1/v each.
    """
    split_stages = {s for kind, s, _ in order if kind == "W"}
    live = peak = 0
    for kind, s, _ in order:
        live += 1 if kind == "F" else -1 if _frees(kind, s, split_stages) else 0
        peak = max(peak, live)
    return peak / v


# --------------------------------------------------------------------------------------
# One process, and the pipeline inside FSDP2
# --------------------------------------------------------------------------------------


def reference(max_norm: float = MAX_NORM, lr: float = LR) -> dict:
    """One process, the whole batch: loss, gradients, their norm, clipped gradients, parameters after SGD."""
    model = gpt(**SIZES)
    inputs, targets = tokens()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=lr).step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "norm": norm.item(), "clipped": clipped, "params": params}


@torch.no_grad()
def clip_grad_norm_pp(parameters, max_norm: float, pp_group) -> torch.Tensor:
    """Clip by the norm of the whole model when each pp rank holds one stage of it.

    This stage's norm (whole over its dp shards: ``full`` all-reduces the DTensor's squares),
    squared, summed over the pp group, then the root: the norm ``clip_grad_norm_`` would give
    in one process. Every stage then scales by the same factor.
    """
    params = [p for p in parameters if p.grad is not None]
    squared = full(nn.utils.get_total_norm([p.grad for p in params])).square()
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _sharded_stage(mesh, reshard_after_forward: bool) -> nn.Module:
    """This rank's stage of the GPT, with FSDP2 over the dp mesh: each block a unit, the stage the root."""
    from torch.distributed.fsdp import fully_shard

    module = split(gpt(**SIZES).to(rank_device()), mesh.size(1))[mesh.get_local_rank("pp")]
    for block in module.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    return fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)


def _fsdp_step(mesh, reshard_after_forward: bool, n_micro: int) -> tuple[nn.Module, dict]:
    """A 1F1B step of this rank's FSDP2 stage on its dp row's half of the batch, collectives counted."""
    module = _sharded_stage(mesh, reshard_after_forward)
    dp, pp = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    rows = mesh.size(0)
    stages = _build([module], [pp], mesh.size(1), BATCH // rows // n_micro, mesh["pp"].get_group())
    runner = Schedule1F1B(stages[0], n_microbatches=n_micro, loss_fn=lm_loss)
    inputs, targets = (t.tensor_split(rows)[dp] for t in tokens())
    recorder, events, t0 = CommVolume(), [], [clock(rank_device())]
    dp_group = mesh["dp"].get_group().group_name
    counts = lambda: {k: _count(recorder, k, dp_group) for k in ("all-gather", "reduce-scatter")}  # noqa: E731
    _record(stages[0], events, t0, counts)
    with recorder:
        losses = _step(runner, stages, mesh.size(1), inputs, targets)
    return module, {"events": events, "losses": losses, "collectives": counts(), "units": 1 + len(module.layers)}


def _count(recorder: CommVolume, kind: str, group_name: str) -> int:
    return sum(1 for r in recorder.records if r["kind"] == kind and r["group"] == group_name)


def one_f_one_b_order(stage: int, p: int, m: int) -> list[tuple]:
    """Stage ``stage``'s 1F1B order as ("F"/"B", stage, micro-batch): p - stage - 1 forwards to
    warm up, then one forward and one backward in turn, then the remaining backwards."""
    warm = min(m, p - stage - 1)
    order = [("F", stage, i) for i in range(warm)]
    for j in range(m - warm):
        order += [("F", stage, warm + j), ("B", stage, j)]
    return order + [("B", stage, i) for i in range(m - warm, m)]


def predicted_all_gathers(order: list[tuple], reshard_after_forward: bool) -> int:
    """All-gathers of one FSDP2 unit in a stage that runs ``order`` (kinds "F" and "B").

    A unit is gathered whenever it is needed while sharded. After a forward, FSDP2 frees the
    whole weights if ``reshard_after_forward``; inside a pipeline step it keeps them after a
    backward (``PipelineStage`` sets ``reshard_after_backward=False`` until the last one).
    """
    gathers, whole = 0, False
    for kind, *_ in order:
        gathers += not whole
        whole = kind != "F" or not reshard_after_forward
    return gathers


def pp_fsdp_step(n_micro: int = 4, max_norm: float = MAX_NORM, lr: float = LR) -> dict:
    """Rank function for 4 ranks, a (dp = 2, pp = 2) mesh: FSDP2 inside each pipeline stage.

    One 1F1B step with ``reshard_after_forward=True`` (collectives counted only), one with
    False, whose gradients are then clipped twice: by ``clip_grad_norm_`` (this stage's own
    norm: the wrong one) and, after restoring them, by ``clip_grad_norm_pp``; then SGD steps.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(rank_device().type, (2, 2), mesh_dim_names=("dp", "pp"))
    _, resharding = _fsdp_step(mesh, True, n_micro)
    module, kept = _fsdp_step(mesh, False, n_micro)
    grads = {n: full(p.grad).cpu() for n, p in module.named_parameters()}
    saved = [p.grad.clone() for p in module.parameters()]
    try:  # torch's clipping on one stage: it runs, with this stage's norm
        stage_norm, clip_error = full(nn.utils.clip_grad_norm_(module.parameters(), max_norm)).item(), None
    except Exception as exc:  # it does not, in torch 2.13; shown if a later release refuses
        stage_norm, clip_error = float("nan"), repr(exc)
    naive = {n: full(p.grad).cpu() for n, p in module.named_parameters()}
    for p, g in zip(module.parameters(), saved):
        p.grad = g
    norm = clip_grad_norm_pp(module.parameters(), max_norm, mesh["pp"].get_group()).item()
    clipped = {n: full(p.grad).cpu() for n, p in module.named_parameters()}
    torch.optim.SGD(module.parameters(), lr=lr).step()
    return {
        "dp": mesh.get_local_rank("dp"),
        "pp": mesh.get_local_rank("pp"),
        "reshard": resharding,
        "keep": kept,
        "grads": grads,
        "stage_norm": stage_norm,
        "clip_error": clip_error,
        "naive_clipped": naive,
        "norm": norm,
        "clipped": clipped,
        "params": {n: full(p.detach()).cpu() for n, p in module.named_parameters()},
    }


def four_ranks(names: list[str], n_micro: int, fsdp_micro: int = 4) -> dict:
    """Rank function: the schedules on a 4-stage pipeline, then the (dp, pp) mesh, in one launch."""
    return {"sweep": schedule_sweep(names, n_micro), "fsdp": pp_fsdp_step(fsdp_micro)}
