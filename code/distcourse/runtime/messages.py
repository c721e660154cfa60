"""What the launcher and its ranks say to each other, as types rather than bare tuples.

parent -> rank: a :class:`Task` when the rank starts, and :data:`RECEIVED` once its
reply has been read (a rank that returned tensors through shared memory must stay
alive until then: the parent fetches the shared-memory handles from it).
rank -> parent: exactly one :class:`Returned` or :class:`Failed`.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory reductions of tensors)

RECEIVED = b"received"


@dataclass(frozen=True)
class Task:
    world_size: int
    backend: str
    threads: int
    port: int  # the launcher's TCPStore on 127.0.0.1 (0 without a process group)
    run_id: str
    collective_timeout: float
    init_process_group: bool
    share_tensors: bool  # results' tensors through shared memory (True) or pickled through the pipe
    start_method: str  # the launching process's default, for what the rank itself starts
    payload: bytes  # pickled (fn, args, kwargs)
    language: str = "en"  # the notebook's (i18n.language()): what the rank prints through tr()
    # The caller's environment at the launch call, with launch(env=...) applied: the rank's
    # os.environ, as mp.spawn's children and torchrun's workers get their parent's.
    environ: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Returned:
    value: Any


@dataclass(frozen=True)
class Failed:
    traceback: str
    when: float  # time.time() of the failure: the launcher blames the earliest one


def _same(value):
    return value


class _CpuResults:
    """Tensors leave a rank on the CPU: a GPU tensor shared by CUDA IPC would die with its rank,
    and unpickling one would start CUDA in the notebook's kernel."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or obj.grad_fn is not None):
            return _same, (obj.detach().cpu(),)
        return NotImplemented


class _SharedPickler(_CpuResults, ForkingPickler):
    """torch.multiprocessing's pickler: tensor storages move to shared memory, only handles travel."""


class _PipePickler(_CpuResults, pickle.Pickler):
    """The standard pickler: tensor bytes are copied through the pipe."""


def dumps(reply: Returned | Failed, share_tensors: bool) -> bytes:
    buffer = io.BytesIO()
    pickler = _SharedPickler if share_tensors else _PipePickler
    pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(reply)
    return buffer.getvalue()
