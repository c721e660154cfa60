"""Checkpoints of chapter 05: save once, load everywhere, resume exactly, never corrupt.

Three parts, each readable on its own:

1. save-on-rank-0 demo: ``save_then_load``;
2. a full training state and exact resume: ``training_state``, ``train_run``, ``resume_forgetting``;
   with DataLoader workers: ``augmented_batches``, ``NoisyImages``, ``ResumableSampler``;
3. what goes wrong: ``save_and_die`` (a crash mid-write), ``RunsCodeWhenLoaded`` (why
   ``weights_only=True``).

Builds on: ``dataloaders.py`` (``reseed_worker``); ``common/checkpoint_files.py`` (atomic writes, RNG state);
sharded checkpoints with ``torch.distributed.checkpoint`` are in ``distributed_checkpoints.py``.
Rank functions live here, not in the notebook, because rank processes import them by name.
Every ``torch.load`` in this module uses ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from .common.checkpoint_files import (
    atomic_save,
    atomic_write,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    seed_everything,
    set_rng_state,
)
from .common.datasets import digits as digits  # chapter 05 loads its data as checkpoints.digits()
from .common.models import mlp
from .common.training import global_mean, wrap_ddp
from .dataloaders import reseed_worker
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr

# --------------------------------------------------------------------------------------
# 1. Save on rank 0, barrier, load everywhere
# --------------------------------------------------------------------------------------


def make_model() -> nn.Module:
    """A small MLP for 8x8 digit images; the dropout makes training consume random numbers.

    Its initial weights come from the caller's random generator (``torch.manual_seed`` first).
    """
    return mlp(width=128, dropout=0.1, seed=None)


def save_then_load(path, barrier: bool = True, delay: float = 0.0):
    """Rank 0 saves its model; every rank loads the file into its own, differently initialised model."""
    rank, device = dist.get_rank(), rank_device()
    torch.manual_seed(rank)  # deliberately different weights on every rank
    model = make_model().to(device)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        time.sleep(delay)  # stands in for a slow file system
        atomic_save(model.state_dict(), path)
        print(tr("saved {file}").format(file=pathlib.Path(path).name))
    if barrier:
        dist.barrier()  # nobody reads before rank 0 has finished writing
    map_location = device  # "cpu" here; "cuda:<rank>" under nccl, so no rank lands on cuda:0
    state = load_checkpoint(path, map_location=map_location)
    print(tr("loaded with {argument}").format(argument=f"map_location={map_location}"))
    # For comparison: without map_location every tensor goes back to the device it was saved from.
    default_on = sorted({str(t.device) for t in torch.load(path, weights_only=True).values()})
    model.load_state_dict(state)
    after = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    loaded_on = sorted({str(t.device) for t in state.values()})
    return {"wrote": rank == 0, "default_on": default_on, "loaded_on": loaded_on, "before": before, "after": after}


# --------------------------------------------------------------------------------------
# 2. A full training state, and exact resume
# --------------------------------------------------------------------------------------


def make_training(device, seed: int = 0):
    """Model, optimizer and LR scheduler: everything with state that changes as we train."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.5)  # stepped every step
    return model, optimizer, scheduler


def digits_loader(data, batch_size: int = 64, seed: int = 0) -> DataLoader:
    """Each rank gets its own shard; ``set_epoch`` changes the shuffle from epoch to epoch."""
    dataset = TensorDataset(*data)
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


def augment(x: torch.Tensor) -> torch.Tensor:
    """Random pixel noise (NumPy) and a random one-pixel shift (Python's random)."""
    noise = torch.from_numpy(np.random.normal(0.0, 0.05, size=tuple(x.shape)).astype(np.float32))
    shift = random.choice((-1, 0, 1))
    return (x + noise).view(-1, 8, 8).roll(shift, dims=-1).reshape(-1, 64)


def training_state(model, optimizer, scheduler, step, epoch, batch) -> dict:
    """What rank 0 writes: one copy of everything the ranks share, and every rank's RNG.

    A collective: every rank must call it. The RNG states differ between ranks (each
    rank draws its own dropout masks and augmentation), so they are gathered to rank 0.
    """
    device = next(model.parameters()).device
    rngs = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rng_state(device), rngs, dst=0)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,  # optimizer steps done so far
        "epoch": epoch,  # for DistributedSampler.set_epoch
        "batch": batch,  # batches of this epoch already trained on
        "rng": rngs,  # one entry per rank
        "world_size": dist.get_world_size(),
    }


PARTS = ("optimizer", "scheduler", "rng", "sampler_epoch")


def restore(state, model, optimizer, scheduler, forget=()):
    """Put a loaded training state back; returns (step, epoch, batch, this rank's RNG state).

    ``forget`` names parts to leave out, to see what each one is for. The state was
    loaded with map_location="cpu": ``load_state_dict`` copies the tensors to wherever the
    model lives, and RNG states must stay CPU tensors anyway.
    """
    model.load_state_dict(state["model"])
    if "optimizer" not in forget:
        optimizer.load_state_dict(state["optimizer"])  # Adam's moment estimates and step counts
    if "scheduler" not in forget:
        scheduler.load_state_dict(state["scheduler"])  # where the LR schedule is
    epoch = 0 if "sampler_epoch" in forget else state["epoch"]
    rng = None
    if "rng" not in forget:
        if state["world_size"] != dist.get_world_size():
            raise ValueError(
                tr("the checkpoint holds RNG states of {saved} ranks, this run has {now}").format(
                    saved=state["world_size"], now=dist.get_world_size()
                )
            )
        rng = state["rng"][dist.get_rank()]
    resumed = tr("resumed at step {step} (epoch {epoch}, batch {batch})").format(
        step=state["step"], epoch=state["epoch"], batch=state["batch"]
    )
    if forget:
        resumed += tr(", forgetting: {parts}").format(parts=", ".join(forget))
    print(resumed)
    return state["step"], epoch, state["batch"], rng


def train(
    data,
    steps: int,
    *,
    every: int = 0,
    directory=None,
    resume_from=None,
    crash_at: tuple[int, int] | None = None,
    forget: tuple[str, ...] = (),
    seed: int = 0,
):
    """Train for ``steps`` optimizer steps under DDP; checkpoint every ``every`` steps.

    directory: where checkpoints ``step-NNNN.pt`` and the loss log ``losses.jsonl`` go.
    resume_from: a checkpoint to start from; ``forget`` names parts of it to ignore.
    crash_at: (rank, step): that rank kills itself with SIGKILL just before that step.
    Returns the global loss of every step this run trained and the final weights.
    """
    directory = _checked_directory(every, directory)
    rank, device = dist.get_rank(), rank_device()
    model, optimizer, scheduler = make_training(device, seed)
    loader = digits_loader(data, seed=seed)
    seed_everything(seed + 1 + rank)  # each rank its own dropout and augmentation stream
    step, epoch, first_batch, pending_rng = 0, 0, 0, None
    if resume_from is not None:
        state = load_checkpoint(resume_from, map_location="cpu")
        step, epoch, first_batch, pending_rng = restore(state, model, optimizer, scheduler, forget)
    ddp = wrap_ddp(model, device)

    losses = {}
    while step < steps:
        loader.sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        for batch, (x, y) in enumerate(loader):  # creating the iterator draws one torch random number
            if batch < first_batch:
                continue  # trained on before the checkpoint was written
            if pending_rng is not None:  # so restore the RNG only now, right before the next step
                set_rng_state(pending_rng, device)
                pending_rng = None
            if crash_at == (rank, step):
                print(tr("simulated crash: SIGKILL before step {step}").format(step=step))
                os.kill(os.getpid(), signal.SIGKILL)
            loss = nn.functional.cross_entropy(ddp(augment(x).to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients across ranks here
            optimizer.step()
            scheduler.step()
            losses[step] = global_mean(loss)
            if directory is not None and rank == 0:
                _log(directory / "losses.jsonl", step, losses[step])
            step += 1
            if every and step % every == 0:
                state = training_state(model, optimizer, scheduler, step, epoch, batch + 1)
                save_on_rank_0(state, directory, step, losses[step - 1])
            if step == steps:
                break
        epoch, first_batch = epoch + 1, 0
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "device": str(device)}


def _checked_directory(every: int, directory) -> pathlib.Path | None:
    if every and directory is None:
        raise ValueError(tr("every > 0 needs a directory to write the checkpoints to"))
    return pathlib.Path(directory) if directory is not None else None


def save_on_rank_0(state: dict, directory, step: int, loss: float) -> None:
    """Rank 0 writes the checkpoint atomically; every rank waits until it is complete on disk."""
    if dist.get_rank() == 0:
        atomic_save(state, checkpoint_path(directory, step))
        print(tr("step {step}: loss {loss}, checkpoint saved").format(step=step, loss=number(loss, 4)))
    dist.barrier()  # the checkpoint is complete on disk before anyone goes on


def _log(path, step: int, loss: float) -> None:
    # One line per step, written and closed at once, so a crash loses at most the current line.
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "loss": loss}) + "\n")  # json keeps every bit of a float


def read_losses(path) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def train_run(data, directory, steps: int = 40, every: int = 5, crash_at=None, resume: bool = False):
    """Rank function: one training run (uninterrupted, crashing, or resuming from the newest checkpoint)."""
    resume_from = latest_checkpoint(directory) if resume else None
    if resume and resume_from is None:
        raise FileNotFoundError(tr("resume=True but {directory} holds no checkpoint").format(directory=directory))
    return train(data, steps, every=every, directory=directory, crash_at=crash_at, resume_from=resume_from)


def resume_forgetting(data, path, steps: int = 40, parts=PARTS):
    """Rank function: resume from checkpoint ``path`` once per part, each time ignoring that part."""
    # No directory: these variants write neither checkpoints nor a loss log.
    return {part: train(data, steps, resume_from=path, forget=(part,))["losses"] for part in parts}


# --------------------------------------------------------------------------------------
# 2b. Exact resume when DataLoader workers augment the data
# --------------------------------------------------------------------------------------


class NoisyImages(Dataset):
    """Images with random noise added in ``__getitem__``, that is, in a DataLoader worker.

    ``per_sample_seed=False`` is chapter 01's recipe: one generator per worker, reseeded by
    ``reseed_worker`` from ``torch.initial_seed()``; what a sample gets depends on the worker
    that loads it and on everything that worker loaded before. ``per_sample_seed=True`` draws
    each sample's noise from a generator seeded with (seed, epoch, index), handed in by the
    sampler as an (epoch, index) pair: the noise is a function of the checkpoint's epoch alone.
    """

    def __init__(self, images: torch.Tensor, seed: int = 0, per_sample_seed: bool = False):
        self.images, self.seed, self.per_sample_seed = images, seed, per_sample_seed
        self.rng = np.random.default_rng(seed)  # replaced in each worker by reseed_worker

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key):
        if self.per_sample_seed:
            epoch, index = key
            rng = np.random.default_rng((self.seed, epoch, index))
        else:
            index, rng = key, self.rng
        noise = torch.from_numpy(rng.normal(0.0, 0.05, size=tuple(self.images[index].shape)).astype(np.float32))
        return self.images[index] + noise


class ResumableSampler(DistributedSampler):
    """``DistributedSampler``'s order, as (epoch, index) pairs, from any position of an epoch.

    The sampler runs in the training process, so the epoch reaches the workers with every
    index, persistent workers included; and ``set_position`` starts an epoch at a batch
    without loading the batches before it.
    """

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, **kwargs)
        self.start = 0

    def set_position(self, epoch: int, samples_done: int) -> None:
        self.set_epoch(epoch)
        self.start = samples_done

    def __iter__(self):
        return iter([(self.epoch, index) for index in list(super().__iter__())[self.start :]])

    def __len__(self) -> int:
        return self.num_samples - self.start


def _augmenting_loader(images, resumable: bool, batch_size: int, num_workers: int, seed: int, rank: int):
    """``augmented_batches``' DataLoader: chapter 01's recipe, or the resumable one."""
    dataset = NoisyImages(images, seed=seed, per_sample_seed=resumable)
    sampler_kind = ResumableSampler if resumable else DistributedSampler
    sampler = sampler_kind(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        worker_init_fn=None if resumable else reseed_worker,
        generator=None if resumable else torch.Generator().manual_seed(seed + rank),
    )


def augmented_batches(
    images: torch.Tensor,
    steps: int,
    *,
    resumable: bool,
    stop: int | None = None,
    resume: dict | None = None,
    batch_size: int = 8,
    num_workers: int = 2,
    seed: int = 0,
    rank: int = 0,
):
    """The batches a training loop receives over ``steps`` steps, as a new job would load them.

    ``stop``: end after that many steps and return, with the batches, the state a checkpoint
    written then would hold. ``resume``: such a state; carry on from it with a new DataLoader
    and new workers, as a resumed job does. Returns (batches, state).

    ``resumable=False`` is the loop of chapters 01 and 04: workers reseeded from a generator
    seeded with ``seed + rank``, persistent workers, trained batches skipped by iterating,
    the RNG state restored right before the first resumed step. ``resumable=True`` seeds
    each sample's noise from (seed, epoch, index) and starts the sampler at the saved position.
    """
    with torch.random.fork_rng(devices=[]):  # a new job's generator, and the caller's left alone
        torch.manual_seed(seed)
        loader = _augmenting_loader(images, resumable, batch_size, num_workers, seed, rank)
        sampler = loader.sampler
        step, epoch, first = (resume["step"], resume["epoch"], resume["batch"]) if resume else (0, 0, 0)
        pending_rng = resume.get("rng") if resume else None
        batches = []
        while step < steps:
            if resumable:
                sampler.set_position(epoch, first * batch_size)  # no batch before `first` is loaded
            else:
                sampler.set_epoch(epoch)
            for batch, x in enumerate(loader, start=first if resumable else 0):
                if batch < first:
                    continue  # trained on before the checkpoint: loaded, augmented and thrown away
                if pending_rng is not None:
                    torch.set_rng_state(pending_rng)
                    pending_rng = None
                batches.append(x)
                step += 1
                if step == stop:
                    state = {"step": step, "epoch": epoch, "batch": batch + 1}
                    return batches, state if resumable else {**state, "rng": torch.get_rng_state()}
                if step == steps:
                    break
            epoch, first = epoch + 1, 0
        return batches, None


# --------------------------------------------------------------------------------------
# 3. What goes wrong: crashes mid-write, unsafe pickles
# --------------------------------------------------------------------------------------


class DiesAfter:
    """A file wrapper that kills its own process after ``limit`` bytes, in the middle of a write."""

    def __init__(self, file, limit: int):
        self.file, self.limit, self.written = file, limit, 0

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if self.written + len(data) >= self.limit:
            self.file.write(data[: self.limit - self.written])
            self.file.flush()  # what reached the kernel stays in the file after the kill
            os.kill(os.getpid(), signal.SIGKILL)
        self.written += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def save_and_die(path, atomic: bool, megabytes: int = 8, die_after: int = 2 * 2**20, step: int = 2):
    """Rank function: start saving a large checkpoint and get killed after ``die_after`` bytes."""
    state = {"step": step, "weights": torch.randn(megabytes * 2**20 // 4)}
    if atomic:
        print(tr("writing a {size} MiB checkpoint atomically...").format(size=megabytes))
    else:
        print(tr("writing a {size} MiB checkpoint in place...").format(size=megabytes))
    if atomic:
        atomic_write(path, lambda f: torch.save(state, DiesAfter(f, die_after)))
    else:
        with open(path, "wb") as f:  # truncates the previous checkpoint right away
            torch.save(state, DiesAfter(f, die_after))


def leave_marker(path) -> str:
    """Harmless stand-in for what a malicious pickle could run: it only creates a file."""
    pathlib.Path(path).write_text("this code ran while a checkpoint was being unpickled\n")
    return "gotcha"


class RunsCodeWhenLoaded:
    """An object whose unpickling calls ``leave_marker(path)``.

    pickle rebuilds an object by calling whatever ``__reduce__`` named when it was saved;
    here that is ``leave_marker``, in a real attack it could be ``os.system``.
    """

    def __init__(self, marker_path):
        self.marker_path = str(marker_path)

    def __reduce__(self):
        return (leave_marker, (self.marker_path,))
