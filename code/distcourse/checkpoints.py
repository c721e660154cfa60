"""Checkpoints of chapter 05: save once, load everywhere, resume exactly, never corrupt.

Four parts, each readable on its own:

1. files: ``atomic_save`` / ``load_checkpoint`` (safe writing, clear errors);
2. save-on-rank-0 demo: ``save_then_load``;
3. a full training state and exact resume: ``rng_state``, ``train_run``, ``resume_forgetting``;
4. what goes wrong: ``save_and_die`` (a crash mid-write), ``RunsCodeWhenLoaded`` (why
   ``weights_only=True``), and sharded checkpoints with ``torch.distributed.checkpoint``.

Rank functions live here, not in the notebook, because rank processes import them by name.
Every ``torch.load`` in this module uses ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import signal
import time
import warnings
import zipfile

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .common.datasets import digits as digits  # chapter 05 loads its data as checkpoints.digits()
from .common.models import mlp
from .common.timing import clock
from .common.training import global_mean, wrap_ddp
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr

# --------------------------------------------------------------------------------------
# 1. Writing and reading checkpoint files
# --------------------------------------------------------------------------------------


class CorruptCheckpointError(ValueError):
    """A checkpoint file exists but cannot be read: truncated, or damaged."""


def atomic_write(path, write) -> None:
    """Call ``write(file)`` on a temporary file, then move it to ``path`` in one step.

    Readers see either the old file or the complete new one, never a half-written one:
    ``os.replace`` swaps a directory entry atomically. That only holds within one file
    system, so the temporary file lives in the same directory as the target.
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: no two writers collide
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a failed save leaves no debris (a killed process cannot do this)
        raise
    _fsync_directory(path.parent)  # make the rename itself survive a power loss


def atomic_save(obj, path) -> None:
    """``torch.save`` that never leaves a partial file at ``path``."""
    atomic_write(path, lambda f: torch.save(obj, f))


def _fsync_directory(directory) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory; the rename still happened
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_path(directory, step: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"step-{step:04d}.pt"


def latest_checkpoint(directory):
    """The checkpoint with the highest step in ``directory``, or None.

    Only complete files carry this name: ``atomic_write`` gives unfinished ones a
    hidden temporary name.
    """
    found = pathlib.Path(directory).glob("step-*.pt")
    return max(found, key=lambda p: int(p.stem.split("-")[1]), default=None)


def stale_temp_files(directory) -> list[pathlib.Path]:
    """Temporary files that ``atomic_write`` left behind because its process was killed."""
    return sorted(pathlib.Path(directory).glob(".*.tmp"))


def load_checkpoint(path, map_location="cpu"):
    """``torch.load(path, weights_only=True)`` with errors that say what is wrong.

    FileNotFoundError: nothing at ``path``. CorruptCheckpointError (a ValueError): the file
    is truncated or damaged. pickle.UnpicklingError passes through unchanged: the file is
    complete but holds objects that ``weights_only=True`` refuses to rebuild.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        listing = sorted(p.name for p in path.parent.glob("*")) if path.parent.is_dir() else None
        where = f"; the directory holds {listing}" if listing is not None else "; the directory does not exist"
        raise FileNotFoundError(f"no checkpoint at {path}{where}")
    size = path.stat().st_size
    # torch.save writes a zip archive whose directory is at the very end of the file, so
    # a file cut short by a crash is no longer a zip archive at all.
    if not zipfile.is_zipfile(path):
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt or truncated ({size} bytes, not a complete zip archive); "
            "was the save interrupted? Load an earlier checkpoint."
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, KeyError, IndexError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt ({size} bytes): {first_line}") from None


def saved_locations(path) -> set[str]:
    """Devices the tensors of a checkpoint lived on when it was saved (e.g. {'cuda:0'}).

    ``map_location`` may be a function of (storage, location); returning the storage
    unchanged keeps it on the CPU, so this never touches a GPU.
    """
    seen = set()

    def remember(storage, location):
        seen.add(location)
        return storage

    torch.load(path, map_location=remember, weights_only=True)
    return seen


# --------------------------------------------------------------------------------------
# 2. Save on rank 0, barrier, load everywhere
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
# 3. A full training state, and exact resume
# --------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds every GPU
    np.random.seed(seed)
    random.seed(seed)


def rng_state(device=torch.device("cpu")) -> dict:
    """Every random generator the training loop draws from, as plain types and tensors.

    NumPy's state holds an ndarray, which ``torch.load(weights_only=True)`` refuses to
    rebuild, so its key array is stored as a tensor.
    """
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device=torch.device("cpu")) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


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
                f"the checkpoint holds RNG states of {state['world_size']} ranks, this run has {dist.get_world_size()}"
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
    if every and directory is None:
        raise ValueError("every > 0 needs a directory to write the checkpoints to")
    rank, device = dist.get_rank(), rank_device()
    directory = pathlib.Path(directory) if directory is not None else None
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
                if rank == 0:
                    atomic_save(state, checkpoint_path(directory, step))
                    print(
                        tr("step {step}: loss {loss}, checkpoint saved").format(
                            step=step, loss=number(losses[step - 1], 4)
                        )
                    )
                dist.barrier()  # the checkpoint is complete on disk before anyone goes on
            if step == steps:
                break
        epoch, first_batch = epoch + 1, 0
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "device": str(device)}


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
        raise FileNotFoundError(f"resume=True but {directory} holds no checkpoint")
    return train(data, steps, every=every, directory=directory, crash_at=crash_at, resume_from=resume_from)


def resume_forgetting(data, path, steps: int = 40, parts=PARTS):
    """Rank function: resume from checkpoint ``path`` once per part, each time ignoring that part."""
    # No directory: these variants write neither checkpoints nor a loss log.
    return {part: train(data, steps, resume_from=path, forget=(part,))["losses"] for part in parts}


# --------------------------------------------------------------------------------------
# 4. What goes wrong: crashes mid-write, unsafe pickles; and sharded checkpoints
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


def weights_only_planner():
    """A DCP load planner that unpickles non-tensor entries with ``weights_only=True``.

    DCP stores entries that are not tensors (an optimizer's hyperparameters, say) as small
    pickles, and its default planner loads them with ``torch.load(..., weights_only=False)``.
    This one changes only that call.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            obj = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if not self.flatten_state_dict:
                self.state_dict[fqn] = obj
                return
            target, path = self.original_state_dict, self.mappings[fqn]  # e.g. ("optimizer", "param_groups", 0, "lr")
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = obj

    return WeightsOnlyLoadPlanner()


def _fsdp_model(device):
    """The chapter's MLP, each Linear sharded by FSDP2 over all ranks (dim 0 split)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = make_model().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(state: dict) -> dict:
    """Whole tensors gathered from the shards (a collective), on the CPU."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _full(value)
        elif hasattr(value, "full_tensor"):
            out[key] = value.full_tensor().cpu()
        elif isinstance(value, torch.Tensor):
            out[key] = value.cpu()
        else:
            out[key] = value
    return out


def dcp_save_sharded(directory, steps: int = 3):
    """Rank function: train a few steps with FSDP2, then save model and optimizer with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    device = rank_device()
    model = _fsdp_model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(16, 64, generator=generator).to(device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    local = {k: tuple(v.to_local().shape) for k, v in model_sd.items()}
    print(tr("local shards: {shapes}").format(shapes=local))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory)  # each rank writes its shards
    return {"local_shapes": local, "model": _full(model_sd), "optimizer": _full(optim_sd)}


def dcp_load_resharded(directory):
    """Rank function: load a DCP checkpoint into an FSDP2 model sharded over this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _fsdp_model(rank_device())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # empty shards of the right shapes
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=directory, planner=weights_only_planner())  # each rank reads only its slices
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    local = {k: tuple(v.to_local().shape) for k, v in state["model"].items()}
    print(tr("local shards: {shapes}").format(shapes=local))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"local_shapes": local, "model": _full(model_sd), "optimizer": _full(optim_sd)}


def dcp_layout(directory) -> list[dict]:
    """Which slice of which entry each file of a DCP checkpoint holds, read from its .metadata.

    DCP's reader unpickles .metadata with plain pickle (see the chapter): use this only on
    checkpoints you trust, such as one your own ranks have just written.
    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata()
    rows = [
        {
            "file": where.relative_path,
            "key": index.fqn,
            "bytes": where.length,
            "offset": None if index.offset is None else tuple(index.offset),
        }
        for index, where in metadata.storage_data.items()
    ]
    return sorted(rows, key=lambda r: (r["file"], r["key"]))


def dcp_load_single_process(model, optimizer, directory):
    """Load a DCP checkpoint into an ordinary model and optimizer, here, without a process group.

    Returns the loaded state as plain CPU tensors, keyed like the saved one.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # the layout we want: whole tensors
    state = {"model": model_sd, "optimizer": optim_sd}
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes a single process: that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=directory, planner=weights_only_planner(), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": _full(model_sd), "optimizer": _full(optim_sd)}


# --------------------------------------------------------------------------------------
# 5. Saving while training goes on: dcp.async_save and Stateful
# --------------------------------------------------------------------------------------


class TrainingState:
    """Model, optimizer and step as one object DCP saves and loads (the ``Stateful`` protocol).

    ``dcp.save`` and ``dcp.async_save`` call ``state_dict()`` on every entry that has both
    methods, and ``dcp.load`` calls ``load_state_dict()`` after filling that dict in place:
    the caller hands DCP live objects instead of converting dicts by hand around every call.
    """

    def __init__(self, model, optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # sharded entries stay sharded
        return {"model": model_sd, "optimizer": optim_sd, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.step = state["step"]


def _snapshot(state: dict) -> dict:
    """Whole tensors on the CPU, copied: later training steps cannot change them (a collective)."""
    import copy

    return copy.deepcopy(_full(state))


def dcp_async_save_while_training(directory, steps: int = 8, save_at=(3, 6)):
    """Rank function: FSDP2 training that checkpoints with ``dcp.async_save`` and keeps training.

    The saves get a gloo process group of their own: ``async_save`` runs collectives in a
    background thread, and on the default group they would interleave with the training's
    own collectives in a different order on each rank (a hang or an abort). At most one save
    is in flight: the previous one's ``.result()`` is waited for before the next starts.
    Afterwards every checkpoint is loaded into a fresh model and optimizer, through the same
    ``Stateful`` object, and returned next to what was saved.
    """
    import torch.distributed.checkpoint as dcp

    device = rank_device()
    model = _fsdp_model(device)
    app = TrainingState(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    save_group = dist.new_group(backend="gloo")  # every rank creates it; only the saves use it
    generator = torch.Generator().manual_seed(dist.get_rank())
    pending, saves, expected = None, [], {}
    for _ in range(steps):
        x = torch.randn(16, 64, generator=generator).to(device)
        model(x).square().mean().backward()
        app.optimizer.step()
        app.optimizer.zero_grad()
        app.step += 1
        if pending is not None and not pending.done():
            saves[-1]["steps while writing"] += 1  # a step that ran while the checkpoint was written
        if app.step in save_at:
            if pending is not None:
                pending.result()  # the previous save is complete (and raises here if it failed)
            expected[app.step] = _snapshot(app.state_dict())  # what this checkpoint must hold
            start = clock(device)  # after this step's kernels: the save's own time
            pending = dcp.async_save(
                {"app": app}, checkpoint_id=pathlib.Path(directory) / f"step-{app.step}", process_group=save_group
            )
            record = {
                "step": app.step,
                "returned after": clock(device) - start,
                "still writing on return": not pending.done(),
                "steps while writing": 0,
            }
            pending.add_done_callback(lambda _, r=record, t=start: r.update({"written after": time.perf_counter() - t}))
            saves.append(record)
    pending.result()
    final = _snapshot(app.state_dict())

    loaded = {}
    for step in save_at:
        fresh_model = _fsdp_model(device)
        fresh = TrainingState(fresh_model, torch.optim.Adam(fresh_model.parameters(), lr=1e-3))
        dcp.load({"app": fresh}, checkpoint_id=pathlib.Path(directory) / f"step-{step}", planner=weights_only_planner())
        loaded[step] = _snapshot(fresh.state_dict())
    dist.destroy_process_group(save_group)
    return {"saves": saves, "expected": expected, "loaded": loaded, "final": final}
