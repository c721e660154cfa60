"""``torch.distributed.pipelining``, and a pipeline inside data parallelism (chapter 06).

The hand-written GPipe step of ``model_parallel.py`` is what PyTorch's pipelining package
automates: ``PipelineStage`` wraps the part of the model a rank holds and knows its
neighbours; a schedule (``ScheduleGPipe``, ``Schedule1F1B``) cuts the batch into
micro-batches and decides in which order each stage runs its forwards and backwards.

* ``torch_pipeline_step``: a training step of a 2-stage pipeline on 2 ranks, with the
  time of every forward and backward recorded, so the notebook can draw the schedule;
* ``ddp_pipeline_step``: 2 x 2 ranks, two data-parallel replicas of a 2-stage pipeline,
  each stage wrapped in ``DistributedDataParallel`` over its own process group.

Builds on: model_parallel
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .common.timing import clock
from .common.training import wrap_ddp
from .model_parallel import two_stage_model
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def _record(stage: PipelineStage, events: list, device: torch.device) -> None:
    """Log (kind, micro-batch, start, end) of every forward and backward the schedule runs.

    The schedules call these two methods of the stage once per micro-batch; wrapping them
    on this one object changes nothing else.
    """
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(i, *args, **kwargs):
        start = clock(device)
        out = forward(i, *args, **kwargs)
        events.append(("F", i, start, clock(device)))
        return out

    def backward_one_chunk(i, *args, **kwargs):
        start = clock(device)
        out = backward(i, *args, **kwargs)
        events.append(("B", i, start, clock(device)))
        return out

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def _examples(module, micro: int, index: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of stage ``index`` for one micro-batch: what crosses its cuts.

    Given these, ``PipelineStage`` knows the shapes of the messages up front; without them
    it finds out by running a micro-batch through the stage first (and, with DDP, by
    all-reducing that trial run's gradients once more). ``requires_grad`` matters: it says
    which gradients travel back (into every stage's input but the first one's; out of
    every stage's output).
    """
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    example_in = torch.empty(micro, linears[0].in_features, device=device, requires_grad=index > 0)
    return example_in, torch.empty(micro, linears[-1].out_features, device=device, requires_grad=True)


def torch_pipeline_step(schedule: str, model_kwargs: dict, x, y, n_micro: int) -> dict:
    """Rank function for 2 ranks: a training step with ``ScheduleGPipe`` or ``Schedule1F1B``.

    Rank r holds stage r of ``two_stage_model(**model_kwargs)``. Rank 0 feeds the inputs,
    rank 1 the targets; the loss is ``F.cross_entropy`` (a mean), and the schedule divides
    the accumulated gradients by ``n_micro`` (``scale_grads=True``): together the
    full-batch mean-loss gradient. Returns, for the second of two identical steps, this
    stage's gradients (named as in the whole model), the micro-batch losses (rank 1) and
    the recorded events.
    """
    rank, device = dist.get_rank(), rank_device()
    module = two_stage_model(**model_kwargs)[rank].to(device)
    example_in, example_out = _examples(module, len(x) // n_micro, rank, device)
    stage = PipelineStage(
        module, stage_index=rank, num_stages=2, device=device, input_args=example_in, output_args=example_out
    )
    runner = SCHEDULES[schedule](stage, n_microbatches=n_micro, loss_fn=F.cross_entropy)
    events: list = []
    _record(stage, events, device)
    for _ in range(2):  # a warm-up step, then the recorded one (the first also sets up messaging)
        module.zero_grad(set_to_none=True)
        events.clear()
        losses: list = []
        dist.barrier()
        t0 = clock(device)
        if rank == 0:
            runner.step(x.to(device))
        else:
            runner.step(target=y.to(device), losses=losses)
    return {
        "grads": {f"{rank}.{name}": p.grad.cpu() for name, p in module.named_parameters()},
        "losses": [loss.item() for loss in losses],
        "events": [(kind, i, start - t0, end - t0) for kind, i, start, end in events],
    }


def _grid_groups(world: int):
    """Process groups of a (replica, stage) grid with 2 stages: rank = 2 * replica + stage.

    Every rank must create every group, in the same order (``new_group`` is collective).
    """
    pipelines = [dist.new_group([2 * r, 2 * r + 1]) for r in range(world // 2)]  # one replica each
    replicas = [dist.new_group(list(range(s, world, 2))) for s in range(2)]  # one stage each
    rank = dist.get_rank()
    return pipelines[rank // 2], replicas[rank % 2]


def _report(replica: int, stage: int, samples: int, loss: float | None) -> None:
    """One line per rank: where it sits in the grid, its samples, and the loss on a last stage."""
    if loss is None:
        print(tr("replica {replica}, stage {stage}: {n} samples").format(replica=replica, stage=stage, n=samples))
    else:
        text = tr("replica {replica}, stage {stage}: {n} samples, loss {loss}")
        print(text.format(replica=replica, stage=stage, n=samples, loss=number(loss, 4)))


def ddp_pipeline_step(model_kwargs: dict, x, y, n_micro: int, lr: float = 0.1) -> dict:
    """Rank function for 2k ranks: k data-parallel replicas of a 2-stage 1F1B pipeline.

    Rank ``2 * replica + stage``. Each replica trains on its own 1/k of the batch; the
    stage's DDP all-reduces its gradients with the same stage of the other replicas
    (its data-parallel group) during the last micro-batch's backward, then SGD steps.
    Returns the rank's place in the grid and its two groups, the replica's loss (on its
    last stage), how many gradient buckets DDP all-reduced, and this stage's parameters
    after the step.
    """
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    index, replica = rank % 2, rank // 2
    pipeline_group, dp_group = _grid_groups(world)
    module = two_stage_model(**model_kwargs)[index].to(device)
    ddp = wrap_ddp(module, device, process_group=dp_group)
    all_reduces = []

    def counted_all_reduce(group, bucket):  # DDP's default all-reduce, counted
        all_reduces.append(bucket.index())
        return allreduce_hook(group, bucket)

    ddp.register_comm_hook(dp_group, counted_all_reduce)
    # The stage talks to its neighbour inside its own replica only: group=pipeline_group.
    example_in, example_out = _examples(module, len(x) // (world // 2) // n_micro, index, device)
    stage = PipelineStage(
        ddp,
        stage_index=index,
        num_stages=2,
        device=device,
        group=pipeline_group,
        input_args=example_in,
        output_args=example_out,
    )
    runner = Schedule1F1B(stage, n_microbatches=n_micro, loss_fn=F.cross_entropy)
    xr, yr = x.tensor_split(world // 2)[replica].to(device), y.tensor_split(world // 2)[replica].to(device)
    losses: list = []
    if index == 0:
        runner.step(xr)
    else:
        runner.step(target=yr, losses=losses)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    optimizer.step()
    loss = sum(loss.item() for loss in losses) / n_micro if losses else None
    _report(replica, index, len(xr), loss)
    return {
        "replica": replica,
        "stage": index,
        "pipeline_group": dist.get_process_group_ranks(pipeline_group),
        "dp_group": dist.get_process_group_ranks(dp_group),
        "loss": loss,
        "all_reduces": len(all_reduces),  # gradient buckets all-reduced during the step
        "params": {f"{index}.{name}": p.detach().cpu() for name, p in module.named_parameters()},
    }
