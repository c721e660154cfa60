"""Checkpoint files, written once for every chapter that saves (05, 07, 12): atomic writes,
``weights_only=True`` loads with clear errors, and the random generators' state.

Chapter 05 explains each function; chapter 07's ``train.py`` and chapter 12's capstone save
and resume through them, so they live here rather than in chapter 05's module.
Every ``torch.load`` in this module uses ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import zipfile

import numpy as np
import torch

from ..runtime.i18n import number, tr

# --------------------------------------------------------------------------------------
# Writing and reading checkpoint files
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
    """Flush the directory entry itself: after a power loss the rename is still there."""
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
        if path.parent.is_dir():
            listing = sorted(p.name for p in path.parent.glob("*"))
            raise FileNotFoundError(
                tr("no checkpoint at {path}; the directory holds {files}").format(path=path, files=listing)
            )
        raise FileNotFoundError(tr("no checkpoint at {path}; the directory does not exist").format(path=path))
    size = path.stat().st_size
    # torch.save writes a zip archive whose directory is at the very end of the file, so
    # a file cut short by a crash is no longer a zip archive at all.
    if not zipfile.is_zipfile(path):
        raise CorruptCheckpointError(
            tr(
                "checkpoint {path} is corrupt or truncated ({size} bytes, not a complete zip archive); "
                "was the save interrupted? Load an earlier checkpoint."
            ).format(path=path, size=number(size))
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, KeyError, IndexError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        text = tr("checkpoint {path} is corrupt ({size} bytes): {error}")
        raise CorruptCheckpointError(text.format(path=path, size=number(size), error=first_line)) from None


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
# Random generators: what an exact resume must restore
# --------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), NumPy and Python's random: every stream a loop may draw from."""
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
    """Put back what ``rng_state`` returned: the next random number is the one the saved run drew."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
