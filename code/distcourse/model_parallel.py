"""Model parallelism and pipelining by hand (chapter 06).

A model that does not fit on one device is cut into consecutive **stages**, one per
device; the activation at the cut travels forward, its gradient travels back. Three
parts, each readable on its own:

1. the split itself: ``two_stage_model``, ``SplitModel`` and ``split_vs_whole``;
2. a GPipe training step written with ``isend``/``irecv`` between two ranks, one stage
   per rank, which records when every micro-batch ran (``pipeline_run``), and the
   single-device baseline it is timed against (``single_device_run``);
3. schedules on paper: ``simulate`` computes the timeline of any per-stage order of
   forwards and backwards, ``bubble_fractions`` measures the idle share of a timeline,
   and ``plot_schedule`` draws it as a Gantt chart.

``torch.distributed.pipelining`` (GPipe, 1F1B) and DDP on top of a pipeline are in
``pipeline.py``. Rank functions live here because rank processes import them by name.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .common.datasets import digits_batch
from .common.timing import clock
from .runtime.hardware import gpu_count, rank_device
from .runtime.i18n import tr

# --------------------------------------------------------------------------------------
# 1. A model in two stages, and the same model split over two devices
# --------------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    """Identity that sleeps: ``seconds`` per sample forward, twice that backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds * len(x))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds * len(grad))  # backward costs about twice the forward
        return grad, None


class Work(nn.Module):
    """A stand-in for compute of a known duration: sleeps ``seconds_per_sample`` per sample.

    A sleeping process needs no core, so the schedule experiments measure the schedule,
    not how busy the machine's cores happen to be. With 0 it is a plain identity.
    """

    def __init__(self, seconds_per_sample: float = 0.0):
        super().__init__()
        self.seconds_per_sample = seconds_per_sample

    def forward(self, x):
        if self.seconds_per_sample <= 0:
            return x
        return _Sleep.apply(x, self.seconds_per_sample)


def two_stage_model(width: int = 32, depth: int = 1, work=0.0, seed: int = 0) -> nn.Sequential:
    """A digits classifier as ``nn.Sequential(stage0, stage1)``: ``model[s]`` is stage ``s``.

    Each stage has ``depth - 1`` hidden ``width x width`` layers besides its end layer
    (64 -> width in stage 0, width -> 10 in stage 1), so the two stages cost about the
    same. ``work``: seconds of simulated compute per sample at the end of each stage, one
    number for both or a pair (stage 0, stage 1). The same ``seed`` gives the same weights
    in any process.
    """
    work0, work1 = (work, work) if isinstance(work, (int, float)) else work

    def hidden():
        return [layer for _ in range(depth - 1) for layer in (nn.Linear(width, width), nn.ReLU())]

    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        stage0 = nn.Sequential(nn.Linear(64, width), nn.ReLU(), *hidden(), Work(work0))
        stage1 = nn.Sequential(*hidden(), nn.Linear(width, 10), Work(work1))
    return nn.Sequential(stage0, stage1)


def step_terms(width: int = 32, depth: int = 1, batch: int = 64) -> int:
    """The additions behind one gradient of ``two_stage_model(width, depth)``: ``terms`` for
    ``common.numerics``. Forward and backward each add across each layer's width (64 pixels, the
    ``2 depth - 1`` hidden layers of ``width``, 10 classes), then the weight gradients over the batch."""
    return 2 * (64 + (2 * depth - 1) * width + 10) + batch


def two_devices() -> tuple[torch.device, torch.device]:
    """Two GPUs if there are; else a GPU and the CPU; else the CPU twice."""
    gpus = gpu_count()
    if gpus >= 2:
        return torch.device("cuda", 0), torch.device("cuda", 1)
    if gpus == 1:
        return torch.device("cuda", 0), torch.device("cpu")
    return torch.device("cpu"), torch.device("cpu")


class SplitModel(nn.Module):
    """A copy of a two-stage model with stage 0 on ``dev0`` and stage 1 on ``dev1``."""

    def __init__(self, model: nn.Sequential, dev0: torch.device, dev1: torch.device):
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.stage0 = copy.deepcopy(model[0]).to(dev0)
        self.stage1 = copy.deepcopy(model[1]).to(dev1)

    def forward(self, x):
        h = self.stage0(x.to(self.dev0))
        # The only communication: one activation tensor. `.to` is differentiable, so in
        # backward autograd sends h's gradient back to dev0 by itself.
        return self.stage1(h.to(self.dev1))


def split_vs_whole(batch_size: int = 64, seed: int = 0, **model_kwargs) -> dict:
    """Forward and backward of the same model, whole on one device and split over two.

    Run it in a fresh process (``launch(..., world_size=1, init_process_group=False)``):
    on a GPU machine it starts CUDA, which the notebook's kernel never does.
    """
    dev0, dev1 = two_devices()
    model = two_stage_model(seed=seed, **model_kwargs)
    whole, split = copy.deepcopy(model).to(dev0), SplitModel(model, dev0, dev1)
    x, y = digits_batch(batch_size, seed)
    outputs, grads = {}, {}
    for name, net in (("whole", whole), ("split", split)):
        out = net(x.to(dev0))
        F.cross_entropy(out, y.to(out.device)).backward()
        outputs[name] = out.detach().cpu()
        grads[name] = [p.grad.cpu() for p in net.parameters()]
    return {
        "devices": (str(dev0), str(dev1)),
        "stage_devices": [sorted({str(p.device) for p in s.parameters()}) for s in (split.stage0, split.stage1)],
        "stage_params": [sum(p.numel() for p in s.parameters()) for s in (split.stage0, split.stage1)],
        "activation_shape": tuple(split.stage0(x.to(dev0)).shape),
        "output_device": str(split(x).device),
        "outputs": outputs,  # "whole" and "split", to compare with common.numerics
        "grads": grads,
        "max_output_diff": (outputs["whole"] - outputs["split"]).abs().max().item(),
        "max_grad_diff": max((a - b).abs().max().item() for a, b in zip(grads["whole"], grads["split"])),
    }


# --------------------------------------------------------------------------------------
# 2. A GPipe step by hand: one stage per rank, activations sent with isend/irecv
# --------------------------------------------------------------------------------------


def _in_features(stage: nn.Module) -> int:
    return next(m for m in stage.modules() if isinstance(m, nn.Linear)).in_features


def gpipe_step(stage: nn.Module, index: int, x, y, n_micro: int, peer: int, t0: float):
    """One training step of a 2-stage pipeline as stage ``index`` (0 or 1) sees it.

    GPipe order: the forward of every micro-batch, then the backward of every micro-batch.
    Gradients accumulate in ``.grad``; each micro-batch's mean loss is weighted by its share
    of the batch, so they add up to the full-batch gradient. Returns ``(loss, events)``:
    the full-batch loss on stage 1 (None on stage 0) and ``(kind, micro_batch, start, end)``
    for every forward ("F") and backward ("B"), in seconds since ``t0``.
    """
    device = next(stage.parameters()).device
    xs, ys = x.tensor_split(n_micro), y.tensor_split(n_micro)
    share = [len(c) / len(x) for c in xs]
    events, pending = [], []

    def timed(kind, i, work):
        start = clock(device)
        result = work()
        events.append((kind, i, start - t0, clock(device) - t0))
        return result

    if index == 0:
        outs = []
        for i, xi in enumerate(xs):
            outs.append(timed("F", i, lambda: stage(xi.to(device))))
            # isend returns at once: stage 0 goes on with micro-batch i+1 while the
            # activation travels and stage 1 works on micro-batch i. That is the pipeline.
            pending.append(dist.isend(outs[i].detach(), peer, tag=i))
        grads = [torch.empty_like(out) for out in outs]
        arriving = [dist.irecv(g, peer, tag=n_micro + i) for i, g in enumerate(grads)]
        for i in range(n_micro):
            arriving[i].wait()
            timed("B", i, lambda: outs[i].backward(grads[i]))
        loss = None
    else:
        inputs = [torch.empty(len(xi), _in_features(stage), device=device) for xi in xs]
        arriving = [dist.irecv(a, peer, tag=i) for i, a in enumerate(inputs)]  # post all receives now
        losses = []
        for i in range(n_micro):
            arriving[i].wait()  # time spent here is idle time: the bubble
            a = inputs[i].requires_grad_()
            losses.append(timed("F", i, lambda: F.cross_entropy(stage(a), ys[i].to(device)) * share[i]))
        for i in range(n_micro):
            timed("B", i, lambda: losses[i].backward())
            pending.append(dist.isend(inputs[i].grad, peer, tag=n_micro + i))
        loss = sum(micro_loss.item() for micro_loss in losses)
    for work in pending:
        work.wait()  # a sent tensor must stay alive until its send is done
    return loss, events


def pipeline_run(model_kwargs: dict, x, y, micro_batches, repeats: int = 3) -> dict:
    """Rank function for 2 ranks: rank r holds stage r of ``two_stage_model(**model_kwargs)``.

    For every m in ``micro_batches``: one warm-up step, then ``repeats`` timed GPipe steps,
    each started by both ranks together after a barrier. Returns, per m, every timed
    step's events and this stage's gradients and loss of the last step.
    """
    rank, device = dist.get_rank(), rank_device()
    stage = two_stage_model(**model_kwargs)[rank].to(device)
    runs = {}
    for m in micro_batches:
        steps = []
        for r in range(repeats + 1):
            stage.zero_grad(set_to_none=True)
            dist.barrier()  # both ranks leave the barrier together: a common time zero
            t0 = clock(device)
            loss, events = gpipe_step(stage, rank, x, y, m, peer=1 - rank, t0=t0)
            if r > 0:
                steps.append(events)
        runs[m] = {"steps": steps, "loss": loss, "grads": [p.grad.cpu() for p in stage.parameters()]}
    return runs


def single_device_run(model_kwargs: dict, x, y, repeats: int = 3) -> dict:
    """Rank function for 1 rank: the whole model on one device, timed like ``pipeline_run``."""
    device = rank_device()
    model = two_stage_model(**model_kwargs).to(device)
    seconds = []
    for r in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        start = clock(device)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        if r > 0:
            seconds.append(clock(device) - start)
    return {"seconds": seconds, "loss": loss.item(), "grads": [p.grad.cpu() for p in model.parameters()]}


def step_seconds(stage_events) -> float:
    """Wall time of one pipeline step: from time zero to the last action on any stage."""
    return max(end for events in stage_events for *_, end in events)


def stage_steps(results, m: int) -> list[list]:
    """``pipeline_run`` results as one ``[stage 0 events, stage 1 events]`` pair per timed step."""
    return [list(pair) for pair in zip(*(rank[m]["steps"] for rank in results))]


def stage_grads(results, m: int) -> list[torch.Tensor]:
    """Both stages' gradients from ``pipeline_run`` results, in the whole model's order."""
    return [g for rank in results for g in rank[m]["grads"]]


# --------------------------------------------------------------------------------------
# 3. Schedules on paper, bubbles, Gantt charts
# --------------------------------------------------------------------------------------


def predicted_bubble(p: int, m: int) -> float:
    """Idle share of each stage in a GPipe (or 1F1B) step with p stages and m micro-batches."""
    return (p - 1) / (m + p - 1)


def gpipe_order(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """GPipe: every forward, then every backward, on every stage."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def check_order(order, m: int, stage: int) -> None:
    """Raise ValueError unless ``order`` has one ('F', i) and one ('B', i) for every i < m."""
    expected = sorted((kind, i) for kind in "FB" for i in range(m))
    try:
        got = sorted((str(kind), int(i)) for kind, i in order)
    except (TypeError, ValueError):
        raise ValueError(
            tr("stage {stage}: the order must be a list of ('F', i) / ('B', i) pairs, got {order}").format(
                stage=stage, order=repr(order)
            )
        ) from None
    if got != expected:
        raise ValueError(
            tr("stage {stage}: every micro-batch 0..{last} needs exactly one 'F' and one 'B'").format(
                stage=stage, last=m - 1
            )
        )


def simulate(orders, forward=1.0, backward=2.0) -> list[list[tuple]]:
    """Timeline of a pipeline step: ``orders[s]`` lists stage s's actions, in the order it runs them.

    Each stage runs its actions one after another; an action also waits for what it needs:
    F(s, i) for F(s-1, i), and B(s, i) for F(s, i) and B(s+1, i). Communication is free.
    ``forward``/``backward``: the time of one micro-batch, one number or one per stage.
    Returns per stage ``(kind, i, start, end)`` events, as the real runs do.
    Raises ValueError for a wrong order or one that deadlocks.
    """
    p, m = len(orders), sum(1 for kind, _ in orders[0] if kind == "F")
    cost = {kind: [t] * p if isinstance(t, (int, float)) else list(t) for kind, t in (("F", forward), ("B", backward))}
    if m == 0:
        raise ValueError(tr("stage 0 runs no forward at all"))
    for s, order in enumerate(orders):
        check_order(order, m, s)
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, i) -> end time
    events = [[] for _ in range(p)]
    position, free = [0] * p, [0.0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            kind, i = str(kind), int(i)
            needs = [("F", s - 1, i)] if kind == "F" and s > 0 else []
            if kind == "B":
                needs = [("F", s, i)] + ([("B", s + 1, i)] if s < p - 1 else [])
            if all(n in done for n in needs):
                start = max([free[s]] + [done[n] for n in needs])
                free[s] = done[(kind, s, i)] = start + cost[kind][s]
                events[s].append((kind, i, start, free[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][position[s]] for s in range(p) if position[s] < len(orders[s])}
            raise ValueError(tr("the schedule deadlocks: every stage waits ({stuck})").format(stuck=stuck))
    return events


def bubble_fractions(stage_events) -> list[float]:
    """Per stage: idle time / span, the span being first start to last end over all stages."""
    first = min(start for events in stage_events for _, _, start, _ in events)
    span = max(end for events in stage_events for *_, end in events) - first
    return [1 - sum(end - start for _, _, start, end in events) / span for events in stage_events]


def overlap(events_a, events_b) -> float:
    """Seconds during which two stages were both busy."""
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for *_, a0, a1 in events_a for *_, b0, b1 in events_b)


def peak_in_flight(events) -> int:
    """Most micro-batches one stage held at once: forwarded, backward not yet done.

    Each of them keeps its activations in memory until its backward.
    """
    held = peak = 0
    for kind, *_ in events:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


COLORS = {"F": "#4C72B0", "B": "#DD8452"}


def plot_schedule(ax, stage_events, title: str, unit: float = 1e3, xlabel: str | None = None):
    """Gantt chart: one row per stage, one bar per forward (blue) and backward (orange).

    ``xlabel``: default "time since the step started (ms)", in the notebook's language."""
    if xlabel is None:
        xlabel = tr("time since the step started (ms)")
    total = step_seconds(stage_events) * unit
    for s, events in enumerate(stage_events):
        for kind, i, start, end in events:
            ax.broken_barh(
                [(start * unit, (end - start) * unit)],
                (s - 0.4, 0.8),
                facecolors=COLORS[kind],
                edgecolor="white",
                linewidth=0.5,
            )
            if (end - start) * unit > 0.03 * total:  # label the bars that have room for it
                ax.text((start + end) / 2 * unit, s, f"{kind}{i}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(stage_events)), [tr("stage {s}").format(s=s) for s in range(len(stage_events))])
    ax.set_ylim(len(stage_events) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, total * 1.02)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
