"""Data parallelism by hand, in one process and across processes (chapter 02).

One training step of data parallelism, with k replicas of a model:

1. scatter   split the batch into k chunks, one per device;
2. replicate give every device its own copy of the model;
3. compute   forward and backward of each replica on its own chunk;
4. all-reduce average the replicas' gradients, so that every replica holds
             the gradient of the whole batch;
5. step      every replica applies the same update and stays identical.

The functions below do each of these in a few lines, on "devices" that are
either GPUs (when there are enough) or the CPU standing in for k devices.
``nn.DataParallel`` does the same in one process; ``all_reduce_step`` does it
with one process per rank and ``torch.distributed.all_reduce``, which is what
DistributedDataParallel (chapter 04) automates.
"""

from __future__ import annotations

import copy
import functools
import sys
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .common import numerics
from .common.datasets import digits_batch
from .common.models import mlp  # chapter 02 builds its models from here: data_parallel.mlp
from .common.replicas import params_of  # written once for chapters 02 and 04: data_parallel.params_of
from .common.timing import Stopwatch, clock
from .runtime.hardware import gpu_count, rank_device
from .runtime.i18n import number, tr

# --- models and data ------------------------------------------------------------------


class ShapeReporter(nn.Module):
    """A linear layer that says, on every forward call, what input it got and where.

    ``calls`` records (shape, device) per call. ``nn.DataParallel`` replicas are
    shallow copies of this module, so they all append to the same list.
    """

    def __init__(self, features: int = 5, outputs: int = 2):
        super().__init__()
        self.fc = nn.Linear(features, outputs)
        self.calls: list[tuple[tuple[int, ...], str]] = []

    def forward(self, x):
        print("  " + tr("forward: input {shape} on {device}").format(shape=tuple(x.shape), device=x.device))
        self.calls.append((tuple(x.shape), str(x.device)))
        return self.fc(x)


def devices_for(k: int) -> list[torch.device]:
    """k GPUs when the machine has them; otherwise the CPU plays all k devices."""
    if gpu_count() >= k:
        return [torch.device("cuda", i) for i in range(k)]
    return [torch.device("cpu")] * k


# --- the five steps -----------------------------------------------------------------


def scatter(batch: torch.Tensor, devices) -> list[torch.Tensor]:
    """One chunk per device; sizes differ by at most one (``tensor_split`` never returns fewer)."""
    return [chunk.to(device) for chunk, device in zip(batch.tensor_split(len(devices)), devices)]


def replicate(model: nn.Module, devices) -> list[nn.Module]:
    """An independent copy of the model (parameters and buffers) on every device."""
    return [copy.deepcopy(model).to(device) for device in devices]


def forward_backward(replica: nn.Module, x, y):
    """The replica's own mean loss on its own chunk; leaves gradients in ``.grad``."""
    output = replica(x)
    loss = F.cross_entropy(output, y)
    loss.backward()
    return loss.detach(), output.detach()


@torch.no_grad()
def average_gradients(replicas) -> None:
    """The all-reduce, by hand: sum each parameter's gradient over replicas, divide by k,
    and copy the result back into every replica.

    This is the full-batch gradient only when every chunk has the same size
    (the mean of equal-sized means is the overall mean).
    """
    for grads in zip(*([p.grad for p in r.parameters()] for r in replicas)):
        mean = sum(g.to(grads[0].device) for g in grads) / len(grads)
        for g in grads:
            g.copy_(mean)  # copy_ moves it to each replica's device


@torch.no_grad()
def sgd_step(replicas, lr: float) -> None:
    """Plain SGD on every replica: same parameters + same gradient = same new parameters."""
    for replica in replicas:
        for p in replica.parameters():
            p -= lr * p.grad
            p.grad = None


def data_parallel_step(model: nn.Module, x, y, devices, lr: float = 0.1, reduce=None):
    """One data-parallel training step from scratch, in this one process.

    Returns ``(replicas, outputs, losses)``: the replicas after the step, the
    forward outputs of all chunks concatenated on ``devices[0]``, and each
    replica's loss. ``model`` itself is not changed.

    reduce: None for :func:`average_gradients`, or ``reduce(replicas, chunk_sizes)``.
    """
    xs, ys = scatter(x, devices), scatter(y, devices)
    sizes = [len(chunk) for chunk in xs]
    if reduce is None and len(set(sizes)) > 1:
        raise ValueError(
            tr(
                "chunks of unequal size {sizes}: their plain average is not the full-batch gradient; "
                "pass reduce=fn(replicas, chunk_sizes) that weights them (exercise 1)"
            ).format(sizes=sizes)
        )
    replicas = replicate(model, devices)
    results = [forward_backward(r, xc, yc) for r, xc, yc in zip(replicas, xs, ys)]
    if reduce is None:
        average_gradients(replicas)
    else:
        reduce(replicas, sizes)
    sgd_step(replicas, lr)
    outputs = torch.cat([out.to(devices[0]) for _, out in results])
    return replicas, outputs, [loss.item() for loss, _ in results]


def full_batch_step(model: nn.Module, x, y, lr: float = 0.1):
    """The reference: a copy of ``model`` trained one SGD step on the whole batch (mean loss).

    Returns ``(trained_copy, outputs, loss)``.
    """
    reference = copy.deepcopy(model)
    loss, outputs = forward_backward(reference, x, y)
    sgd_step([reference], lr)
    return reference, outputs, loss.item()


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between the parameters of two models of the same shape."""
    return max((p - q).abs().max().item() for p, q in zip(params_of(a), params_of(b)))


def identical(a: nn.Module, b: nn.Module) -> bool:
    """Bit-for-bit equal parameters."""
    return all(torch.equal(p, q) for p, q in zip(params_of(a), params_of(b)))


# --- the same with processes: one rank per replica --------------------------------------


def all_reduce_step(x, y, state: dict, lr: float = 0.1, **model_kwargs):
    """Rank function for ``distcourse.launch``: data parallel with one process per replica.

    Every rank builds the same model from ``state``, takes its own chunk of the
    batch, and averages gradients with ``dist.all_reduce`` instead of by hand.
    """
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    model = mlp(**model_kwargs)
    model.load_state_dict(state)
    model.to(device)
    xc, yc = x.tensor_split(world)[rank].to(device), y.tensor_split(world)[rank].to(device)
    loss, _ = forward_backward(model, xc, yc)
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # every rank now holds the sum...
        p.grad /= world  # ...and divides it: the average
    sgd_step([model], lr)
    print(
        tr("chunk {shape} on {device}, loss {loss}").format(
            shape=tuple(xc.shape), device=device, loss=number(loss.item(), 4)
        )
    )
    return {"loss": loss.item(), "params": params_of(model)}


# --- why nn.DataParallel is slow: what it does on every step ------------------------------


def plain_step(model, optimizer, x, y, clock: Stopwatch):
    with clock("forward"):
        output = model(x)
    with clock("backward"):
        F.cross_entropy(output, y).backward()
    with clock("step"):
        optimizer.step()
        optimizer.zero_grad()


def dataparallel_style_step(model, optimizer, x, y, devices, clock: Stopwatch):
    """One step the way ``nn.DataParallel`` organises it, phase by phase.

    The model lives on ``devices[0]`` and is copied to every device *on every
    step*; outputs are gathered on ``devices[0]``, where the loss of the whole
    batch is computed; the replicas' gradients are summed back into the one
    model, and only that model is updated (so the next step must copy it again).
    Summing, not averaging, is right here: the loss is already the mean over
    the whole batch, and each replica's gradient is its share of it.
    """
    with clock("replicate"):
        replicas = replicate(model, devices)
    with clock("scatter"):
        xs = scatter(x, devices)
    with clock("forward"):
        outputs = [r(xc) for r, xc in zip(replicas, xs)]
    with clock("gather"):
        output = torch.cat([o.to(devices[0]) for o in outputs])
    with clock("backward"):
        F.cross_entropy(output, y.to(devices[0])).backward()
    with clock("reduce"):
        with torch.no_grad():
            for p, *copies in zip(model.parameters(), *(r.parameters() for r in replicas)):
                p.grad = sum(c.grad.to(p.device) for c in copies)
    with clock("step"):
        optimizer.step()
        optimizer.zero_grad()


def step_time_breakdown(
    replica_counts=(2, 4), steps: int = 20, batch_size: int = 256, width: int = 512, depth: int = 3
):
    """Seconds per step, phase by phase: a plain step, and DataParallel-style steps
    with k replicas, on the same model and batch: on GPUs when there are
    ``max(replica_counts)`` of them, otherwise on the CPU.

    Returns ``{label: {phase: seconds}}``, each phase's fastest time over ``steps``
    steps: other programs on the machine can only add time, so the fastest is the
    phase's own cost. The configurations take turns step by step, so a busy moment
    slows all of them alike.
    """
    x, y = digits_batch(batch_size, seed=1)
    # All configurations on GPUs if there are enough for the largest, else all on the CPU.
    on_gpus = gpu_count() >= max(replica_counts)
    runs = {}
    for k in (1, *replica_counts):
        devices = [torch.device("cuda", i) for i in range(k)] if on_gpus else [torch.device("cpu")] * k
        model = mlp(width=width, depth=depth).to(devices[0])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        xd, yd = x.to(devices[0]), y.to(devices[0])
        where = devices[0].type if k == 1 or devices[0].type == "cpu" else tr("{k} GPUs").format(k=k)
        if k == 1:
            label = tr("plain step ({where})").format(where=where)
            runs[label] = devices, functools.partial(plain_step, model, optimizer, xd, yd)
        else:
            label = tr("DataParallel-style, {k} replicas ({where})").format(k=k, where=where)
            runs[label] = devices, functools.partial(dataparallel_style_step, model, optimizer, xd, yd, devices)
    samples = {label: defaultdict(list) for label in runs}
    for i in range(3 + steps):  # 3 warm-up rounds: first calls allocate memory
        for label, (devices, step) in runs.items():
            clock = Stopwatch(devices)  # waits for every GPU of the run, not only the current one
            step(clock=clock)
            for phase, seconds in clock.seconds.items():
                if i >= 3:
                    samples[label][phase].append(seconds)
    return {label: {phase: min(v) for phase, v in phases.items()} for label, phases in samples.items()}


def same_update_as_plain(k: int = 2, batch_size: int = 64) -> float:
    """Relative parameter difference (``numerics.relative_gap``) between one DataParallel-style
    step and one plain step of ``mlp(width=64, depth=2)``: compare it with a rounding bound."""
    x, y = digits_batch(batch_size, seed=2)
    devices = devices_for(k)
    models = [mlp(width=64, depth=2).to(devices[0]) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    xd, yd = x.to(devices[0]), y.to(devices[0])
    plain_step(models[0], optimizers[0], xd, yd, Stopwatch(devices))
    dataparallel_style_step(models[1], optimizers[1], xd, yd, devices, Stopwatch(devices))
    return numerics.relative_gap(params_of(models[1]), params_of(models[0]))


# --- one process, many threads: the GIL ------------------------------------------------


def _work(kind: str):
    """Two kinds of work for one thread: many tiny tensor operations, or a few big ones."""
    if kind == "many small ops":
        model, x, repeats = nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)]), torch.randn(4, 8), 60
    else:
        model, x, repeats = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)), torch.randn(512, 1024), 4

    def run():
        torch.set_num_threads(1)  # one core per thread (the setting is per thread)
        with torch.no_grad():
            for _ in range(repeats):
                model(x)

    return run


def _seconds(jobs, threaded: bool) -> float:
    start = clock()  # CPU threads: nothing queued to wait for
    if threaded:
        threads = [threading.Thread(target=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for job in jobs:
            job()
    return clock() - start


def thread_speedup(kind: str, threads: int = 2, repeats: int = 7) -> float:
    """How much faster ``threads`` Python threads finish ``threads`` jobs than one thread does.

    This is how ``nn.DataParallel`` runs its replicas: one Python thread per device,
    all in one process. A thread holds the GIL while Python code runs (here: the
    Python side of every small operation); big operations release it.
    """
    previous = torch.get_num_threads()
    try:
        jobs = [_work(kind) for _ in range(threads)]
        jobs[0]()  # warm-up
        sequential, parallel = [], []
        for _ in range(repeats):  # alternate, so that a busy moment hits both alike
            sequential.append(_seconds(jobs, threaded=False))
            parallel.append(_seconds(jobs, threaded=True))
    finally:
        torch.set_num_threads(previous)
    return min(sequential) / min(parallel)


def gil_enabled() -> bool:
    """False only on a free-threaded Python build running without the GIL."""
    return getattr(sys, "_is_gil_enabled", lambda: True)()


# --- BatchNorm ----------------------------------------------------------------------


def batchnorm_layers(model: nn.Module) -> list[nn.BatchNorm1d]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def combined_moments(chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) variance of the whole batch from per-chunk count, sum and sum of squares.

    Three numbers per channel per chunk are all that has to travel between replicas:
    that is the idea of SyncBatchNorm (chapter 04 does it across processes).
    """
    count = sum(len(c) for c in chunks)
    total = sum(c.sum(dim=0) for c in chunks)
    squares = sum((c * c).sum(dim=0) for c in chunks)
    mean = total / count
    return mean, squares / count - mean * mean
