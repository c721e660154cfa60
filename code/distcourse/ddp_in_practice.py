"""DistributedDataParallel in practice (chapter 04, notebook ``04-ddp-in-practice``).

Rank functions (run by ``distcourse.launch``) and the helpers the notebook checks them
with, by section of the chapter (sections 1-5, notebook ``04-ddp``, are in ``ddp.py``):

6. uneven inputs and ``Join``: ``uneven_inputs``, ``key_line``; mismatched collectives and
   ``TORCH_DISTRIBUTED_DEBUG``: ``mismatched_all_reduce``;
7. parameters without gradients: ``TwoHeads``, ``unused_branch``;
8. a slow rank: ``skewed_speed``;
9. BatchNorm across ranks: ``SumOverRanks``, ``AllReduceBatchNorm1d``, ``batchnorm_step``, ``syncbn_on_cpu``;
10. throughput of 1 vs 2 ranks: ``throughput_run``;
11. the everyday training loop: ``DigitsWithWorker``, ``train_with_loader``, ``run_subprocess``.

The model and the data are chapter 02's (``data_parallel.mlp``, scikit-learn's digits),
sent to the ranks as tensors by the notebook.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

from .common import timing
from .common.models import mlp
from .common.replicas import my_share, params_of
from .common.training import train_step
from .common.training import wrap_ddp as wrap  # this rank's device, device_ids only on a GPU
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr


def clock() -> float:
    """Wall time that includes the work queued on this rank's device (see ``common/timing.py``)."""
    return timing.clock(rank_device())


# --- 6. Uneven inputs ---------------------------------------------------------------------


def uneven_inputs(batches_per_rank, use_join: bool, model_kwargs: dict, divide_by_initial_world_size: bool = True):
    """Train on ``batches_per_rank[rank]`` batches, then wait for everyone at a barrier.

    Without ``Join`` the rank with more batches waits in its next all-reduce for a rank
    that has already left the loop, and that rank waits at the barrier: neither ever
    proceeds. With ``Join`` a rank that runs out of data keeps answering the others'
    all-reduces (with zeros) until every rank is done.
    """
    rank = dist.get_rank()
    ddp = wrap(mlp(**model_kwargs))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    if use_join:  # a rank out of data shadows the others' all-reduces until all are done
        joining = Join([ddp], divide_by_initial_world_size=divide_by_initial_world_size)
    else:
        joining = contextlib.nullcontext()
    try:
        with joining:
            for _ in range(batches_per_rank[rank]):
                x = torch.randn(8, 64, generator=generator).to(rank_device())
                y = torch.randint(10, (8,), generator=generator).to(rank_device())
                train_step(ddp, optimizer, x, y)
        print(tr("finished {n} batches").format(n=batches_per_rank[rank]))
        dist.barrier()  # everyone waits for everyone, e.g. before rank 0 saves a checkpoint (chapter 05)
    except RuntimeError as error:  # say what went wrong on *this* rank, then fail as before
        print(f"{type(error).__name__}: {_CPP_LOCATION.sub('', str(error))}")
        raise
    return {"batches": batches_per_rank[rank], "params": params_of(ddp.module)}


def key_line(text: str, *needles: str) -> str:
    """The first line of an error text that contains one of ``needles`` (case-insensitive),
    without the C++ source location that gloo puts in front of its messages."""
    for line in text.splitlines():
        if any(n.lower() in line.lower() for n in needles):
            return _CPP_LOCATION.sub("", line.strip())
    return text.strip().splitlines()[-1] if text.strip() else ""


_CPP_LOCATION = re.compile(r"\[/[^\]]*\] ")  # e.g. "[/path/to/gloo/unbound_buffer.cc:78] "


# --- 7. Parameters that get no gradient ---------------------------------------------------


class TwoHeads(nn.Module):
    """A trunk with two heads; ``forward`` uses only ``main`` (``aux`` is switched off,
    as an auxiliary loss often is after some epochs)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.trunk = nn.Linear(64, 32)
            self.main = nn.Linear(32, 10)
            self.aux = nn.Linear(32, 10)

    def forward(self, x):
        return self.main(torch.relu(self.trunk(x)))


def unused_branch(x, y, find_unused_parameters: bool, steps: int = 2) -> dict:
    """A few training steps of ``TwoHeads`` under DDP."""
    ddp = wrap(TwoHeads(), find_unused_parameters=find_unused_parameters)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    xs, ys, _ = my_share(x, y)
    for step in range(steps):
        train_step(ddp, optimizer, xs, ys)
        print(tr("step {step} done").format(step=step))
    return {"aux_grad_is_none": ddp.module.aux.weight.grad is None, "params": params_of(ddp.module)}


# --- 8. A slow rank -----------------------------------------------------------------------


def skewed_speed(x, y, model_kwargs: dict, slow_rank: int = 1, extra_seconds: float = 0.05, steps: int = 8) -> dict:
    """Seconds per phase over ``steps`` steps, when ``slow_rank`` needs ``extra_seconds`` more
    per step (a slower GPU, a busier node, a longer sequence...). The extra time is a sleep
    in the first phase.

    The slow rank starts its extra work only once the others have finished their forward
    (a barrier on a gloo group of its own, which the training never uses), so the others
    wait at least ``extra_seconds`` in every backward by construction, however the
    processes happen to be scheduled.
    """
    rank = dist.get_rank()
    ddp = wrap(mlp(**model_kwargs))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    side = dist.new_group(backend="gloo")
    xs, ys, _ = my_share(x, y)
    phases = ["forward + own work", "backward (incl. waiting for the all-reduce)", "optimizer step"]
    seconds = dict.fromkeys(phases, 0.0)
    # Two warm-up steps: the first allocates memory; in the second's forward DDP rebuilds its
    # buckets, a collective that a rank held at the barrier below would never join.
    for step in range(steps + 2):
        timed = step >= 2
        t0 = clock()
        if rank == slow_rank:
            if timed:
                dist.barrier(group=side)  # the others have computed their forward...
            time.sleep(extra_seconds)  # ...and only now does this rank's extra work begin
        loss = F.cross_entropy(ddp(xs), ys)
        t1 = clock()
        if rank != slow_rank and timed:
            dist.barrier(group=side)
        loss.backward()  # finishes only when every bucket's all-reduce has finished
        t2 = clock()
        optimizer.step()
        optimizer.zero_grad()
        t3 = clock()
        if timed:
            for phase, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                seconds[phase] += dt
    dist.destroy_process_group(side)
    return seconds


# --- 9. BatchNorm across ranks ------------------------------------------------------------


class SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) that autograd can see through: the gradient of a sum over ranks,
    with respect to each rank's input, is the sum of the gradients over ranks."""

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class AllReduceBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d that normalises with the statistics of the *global* batch.

    In training, every rank all-reduces three things per channel over its chunk:
    the count, the sum and the sum of squares (chapter 02's ``combined_moments``,
    across processes). Mean and variance follow from them. ``nn.SyncBatchNorm``
    does the same on GPUs (it all-gathers each rank's mean, variance and count).
    E[x^2] - E[x]^2 loses precision when the mean is large compared with the
    spread; it is fine for the activations here.
    """

    def forward(self, x):
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels = x.shape[1]
        count = torch.full((1,), float(x.shape[0]), device=x.device, dtype=x.dtype)
        totals = SumOverRanks.apply(torch.cat([count, x.sum(dim=0), (x * x).sum(dim=0)]))
        n, mean = totals[0], totals[1 : 1 + channels] / totals[0]
        var = totals[1 + channels :] / n - mean * mean  # biased: what normalisation uses
        if self.track_running_stats:
            with torch.no_grad():  # running_var is kept unbiased, as nn.BatchNorm1d does
                self.num_batches_tracked += 1
                # momentum=None means a cumulative average, as in nn.BatchNorm1d
                factor = self.momentum if self.momentum is not None else 1.0 / self.num_batches_tracked.item()
                self.running_mean.lerp_(mean, factor)
                self.running_var.lerp_(var * n / (n - 1), factor)
        y = (x - mean) / torch.sqrt(var + self.eps)
        return y * self.weight + self.bias if self.affine else y


def with_allreduce_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm1d by an AllReduceBatchNorm1d with the same state (in place),
    as ``nn.SyncBatchNorm.convert_sync_batchnorm`` does for SyncBatchNorm."""
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm1d:
            synced = AllReduceBatchNorm1d(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            synced.load_state_dict(child.state_dict())
            setattr(module, name, synced)
        else:
            with_allreduce_batchnorm(child)
    return module


def batchnorm_step(x, y, model_kwargs: dict, kind: str, lr: float = 0.1) -> dict:
    """One DDP training step of an MLP with BatchNorm, each rank on its share of the batch.

    kind: "local" (plain BatchNorm1d: each rank's own statistics), "allreduce"
    (AllReduceBatchNorm1d) or "sync" (``nn.SyncBatchNorm``, GPUs only).
    Returns this rank's sample indices, its outputs, the BatchNorm buffers and the
    parameters after the step.
    """
    model = mlp(batchnorm=True, **model_kwargs)
    if kind == "allreduce":
        with_allreduce_batchnorm(model)
    elif kind == "sync":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = wrap(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    xs, ys, index = my_share(x, y)
    out = ddp(xs)
    F.cross_entropy(out, ys).backward()
    optimizer.step()
    bn = next(m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    print(
        tr("{layer} on {device}: {n} samples of {total}").format(
            layer=type(bn).__name__, device=xs.device, n=len(index), total=len(x)
        )
    )
    return {
        "samples": index,
        "out": out.detach().cpu(),
        "running_mean": bn.running_mean.cpu(),
        "running_var": bn.running_var.cpu(),
        "params": params_of(model),
    }


def reference_batchnorm_step(x, y, model_kwargs: dict, lr: float = 0.1) -> dict:
    """The same step in one process on the whole batch: what synchronised BatchNorm must match."""
    model = mlp(batchnorm=True, **model_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    out = model(x)
    F.cross_entropy(out, y).backward()
    optimizer.step()
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
    stats = {"running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone()}
    return {"out": out.detach(), **stats, "params": params_of(model)}


def syncbn_on_cpu() -> str:
    """Try ``nn.SyncBatchNorm`` in training mode on CPU tensors; return the error it raises."""
    layer = nn.SyncBatchNorm(4)
    try:
        layer(torch.randn(8, 4))
    except ValueError as error:
        print(tr("SyncBatchNorm on a CPU tensor: {error}").format(error=f"ValueError: {error}"))
        return str(error)
    return ""


# --- 10. Throughput -----------------------------------------------------------------------


def throughput_run(x, y, global_batch: int, steps: int, model_kwargs: dict, lr: float = 0.05) -> dict:
    """Train ``steps`` steps of ``global_batch`` samples, split over the ranks; time them.

    Step s uses the s-th slice of ``global_batch`` samples of (x, y), cycling through
    the data; each rank takes its share. So one rank and two ranks see exactly the
    same global batches and, up to float rounding, take the same steps.
    """
    world = dist.get_world_size()
    ddp = wrap(mlp(**model_kwargs))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    batches = len(x) // global_batch
    dist.barrier()  # start the clock together
    start = clock()
    for step in range(steps):
        lo = (step % batches) * global_batch
        xs, ys, index = my_share(x[lo : lo + global_batch], y[lo : lo + global_batch])
        train_step(ddp, optimizer, xs, ys)
    seconds = clock() - start
    return {
        "samples": steps * len(index),
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "world_size": world,
        "params": params_of(ddp.module),
    }


# --- 6. Mismatched collectives and TORCH_DISTRIBUTED_DEBUG --------------------------------


def mismatched_all_reduce(sizes, debug: str | None = "DETAIL") -> list[float]:
    """All-reduce a tensor of ``sizes[rank]`` elements: collectives whose shapes disagree.

    torch reads ``TORCH_DISTRIBUTED_DEBUG`` when ``torch.distributed`` is imported, and
    wraps every process group created while the level is DETAIL in a checker that first
    compares the ranks' collectives (operation, shapes, dtypes) through a separate gloo
    group. In a script, set the variable in the environment you launch with
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ...``). These ranks are forked from a
    process that imported torch before, so the level is set again here and the group
    that gets the checks is created afterwards.
    """
    if debug is not None:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
        dist.set_debug_level_from_env()
    group = dist.new_group()  # created now: wrapped in the checker when the level is DETAIL
    tensor = torch.ones(sizes[dist.get_rank()], device=rank_device())
    try:
        dist.all_reduce(tensor, group=group)
    except RuntimeError as error:  # print this rank's view, then fail as before
        print(f"{type(error).__name__}: {_CPP_LOCATION.sub('', str(error))}")
        raise
    return tensor.tolist()


# --- 11. The everyday training loop: DataLoader workers in every rank ---------------------


class DigitsWithWorker(Dataset):
    """Images and labels, each sample with the PID of the process that loaded it and
    that process's parent.

    The PIDs are bookkeeping for the chapter: they show which DataLoader worker
    prepared each sample, and that the worker is a child of the rank.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        worker = get_worker_info()  # None in the rank itself, set in a DataLoader worker
        pids = [os.getpid(), os.getppid()] if worker is not None else [-1, -1]
        return self.images[index], self.labels[index], torch.tensor(pids)


def digits_loader(x, y, batch_size: int, num_workers: int, seed: int, device) -> DataLoader:
    """This rank's DataLoader: its share through a ``DistributedSampler``, loaded by worker processes.

    The workers start with the platform's default start method, as in any script: forcing
    ``fork`` would be quicker where it exists, but a rank is multi-threaded (gloo's or NCCL's
    threads, here the launcher's watcher too), and a forked child gets a copy of every lock
    those threads held, with none of the threads to release them. ``persistent_workers`` pays
    the start-up once instead of every epoch.
    """
    dataset = DigitsWithWorker(x, y)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=DistributedSampler(dataset, shuffle=True, seed=seed),  # instead of shuffle=True
        num_workers=num_workers,
        persistent_workers=num_workers > 0,  # the same workers for every epoch, not new ones
        pin_memory=device.type == "cuda",  # page-locked batches copy to the GPU asynchronously
    )


def os_threads() -> int | None:
    """This process's threads as the operating system counts them (Linux's /proc), or None elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except FileNotFoundError:
        return None


def train_with_loader(
    x,
    y,
    epochs: int = 2,
    batch_size: int = 32,
    num_workers: int = 2,
    lr: float = 0.1,
    model_kwargs: dict | None = None,
    seed: int = 0,
) -> dict:
    """The DDP training loop of every PyTorch example, as one rank runs it.

    A ``DistributedSampler`` deals each rank its share, ``set_epoch`` reshuffles every
    epoch, a ``DataLoader`` with worker processes prepares the batches, DDP averages
    the gradients, and only rank 0 shows a progress bar.

    The workers start with the platform's default start method (``digits_loader`` says why);
    the result records it, with the number of threads the rank runs when its workers start.
    """
    # Imported here, in the rank: in a notebook's kernel tqdm.auto would look for Jupyter widgets.
    from tqdm.auto import tqdm

    rank, device = dist.get_rank(), rank_device()
    loader = digits_loader(x, y, batch_size, num_workers, seed, device)
    sampler = loader.sampler
    torch.manual_seed(seed + rank)  # different initial weights on purpose: DDP broadcasts rank 0's
    ddp = wrap(mlp(**(model_kwargs or {})))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    loader_pids, losses = set(), []
    threads = os_threads()  # now, before the first epoch starts the workers: gloo's threads already run
    start = clock()
    desc, unit = tr("rank {rank}").format(rank=rank), tr("step")
    with tqdm(total=epochs * len(loader), desc=desc, unit=unit, disable=rank != 0) as bar:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)  # a new permutation every epoch, the same on every rank
            for images, labels, pids in loader:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                loss = train_step(ddp, optimizer, images, labels)
                loader_pids.update(tuple(pair) for pair in pids.tolist())
                losses.append(loss.item())
                bar.set_postfix({tr("epoch"): epoch, tr("loss"): number(loss.item(), 3)}, refresh=False)
                bar.update()
    return {
        "pid": os.getpid(),
        "loaders": sorted(loader_pids),  # (pid, parent pid) of each process that loaded samples
        "start_method": multiprocessing.get_start_method(),  # the platform's default: not overridden
        "threads": threads,
        "seconds": clock() - start,
        "steps": len(losses),
        "losses": losses,
        "params": params_of(ddp.module),
    }


def run_subprocess(code: str, timeout: float = 60.0) -> dict:
    """Run ``python -c code`` from inside a rank and return what it printed.

    The child inherits the rank's environment (RANK, WORLD_SIZE, MASTER_ADDR...),
    as a program started by a training script would.
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    return {"pid": os.getpid(), "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
