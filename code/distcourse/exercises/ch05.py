"""Self-check for the exercise of chapter 05: an ``atomic_save`` written by the learner.

It runs in the notebook's own process (a function defined in a notebook cannot be sent
to rank processes), watching ``os.fsync`` and ``os.replace`` while the learner's
function runs, and simulating a save that fails halfway.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile

import torch

from ..common.checkpoint_files import load_checkpoint
from ..runtime.i18n import tr
from . import verdict


class _FailsWhileSaving:
    """Pickling this raises, as a crash in the middle of ``torch.save`` would interrupt it."""

    def __reduce__(self):
        raise RuntimeError("simulated failure in the middle of a save")


@contextlib.contextmanager
def _watch_os_calls(events: list):
    """Record calls of os.fsync and os.replace/os.rename (pathlib uses them too)."""
    originals = {name: getattr(os, name) for name in ("fsync", "replace", "rename")}

    def spy(name):
        def call(*args, **kwargs):
            events.append((name, *[os.fspath(a) if isinstance(a, (str, os.PathLike)) else a for a in args]))
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(os, name, spy(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(os, name, original)


def check_atomic_save(atomic_save) -> bool:
    """Exercise 05: ``atomic_save(obj, path)`` must never leave a partial file at ``path``."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        path = directory / "checkpoint.pt"
        first = {"step": 1, "weights": torch.arange(6.0)}
        events: list = []
        try:
            with _watch_os_calls(events):
                atomic_save(first, path)
        except Exception as exc:
            problems.append(tr("saving a plain state raised {error}").format(error=repr(exc)))
        if not path.is_file():
            problems.append(tr("after atomic_save(obj, path) there is no file at path"))
        else:
            try:
                loaded = load_checkpoint(path)
                if loaded["step"] != 1 or not torch.equal(loaded["weights"], first["weights"]):
                    problems.append(tr("the saved file does not load back as the object that was saved"))
            except Exception as exc:
                problems.append(tr("the saved file does not load with weights_only=True: {error}").format(error=exc))
            problems += _check_os_calls(events, path)

        if path.is_file():  # a save that fails halfway must leave the previous checkpoint intact
            problems += _check_failed_save(atomic_save, path)
        leftovers = sorted(p.name for p in directory.iterdir() if p.name != path.name)
        if leftovers:
            problems.append(tr("temporary files left behind in the directory: {files}").format(files=leftovers))
    return verdict(
        problems, tr("Correct: complete files only, flushed to disk before the rename, no debris after a failure.")
    )


def _check_failed_save(atomic_save, path: pathlib.Path) -> list[str]:
    try:
        atomic_save({"step": 2, "weights": torch.zeros(6), "oops": _FailsWhileSaving()}, path)
        return [tr("a save that fails while writing must raise, not return quietly")]
    except RuntimeError:
        pass
    except Exception as exc:
        return [tr("a failing save should let the original error through, got {error}").format(error=repr(exc))]
    if not path.is_file():
        return [tr("a save that failed halfway deleted the previous checkpoint")]
    try:
        step = load_checkpoint(path)["step"]
    except Exception:
        return [tr("a save that failed halfway destroyed the previous checkpoint")]
    return [] if step == 1 else [tr("a failed save replaced the previous checkpoint")]


def _check_os_calls(events, path: pathlib.Path) -> list[str]:
    moves = [e for e in events if e[0] in ("replace", "rename") and pathlib.Path(e[2]) == path]
    if not moves:
        return [tr("the file was not moved into place with os.replace: write elsewhere, then rename")]
    source = pathlib.Path(moves[-1][1])
    problems = []
    if source.parent != path.parent:
        problems.append(
            tr(
                "the temporary file was in {folder}, not next to the target: a rename is "
                "atomic only within one file system, so keep it in the same directory"
            ).format(folder=source.parent)
        )
    move_at = events.index(moves[-1])
    if not any(e[0] == "fsync" for e in events[:move_at]):
        problems.append(tr("no os.fsync before the rename: after a power loss the renamed file may be empty"))
    return problems
