"""What this machine can run: cores, GPUs, and the backend/device a launch uses.

Nothing here initialises CUDA: ``torch.cuda.device_count()`` asks NVML when it
can and never creates a CUDA context, so calling these functions in a notebook
kernel keeps it safe to start rank processes afterwards.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

# More ranks than this on one machine is almost certainly a typo (world_size=2000
# instead of 2); refusing it early saves the learner from a frozen machine.
MAX_LOCAL_WORLD_SIZE = 64

BACKENDS = ("gloo", "nccl")


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def threads_per_rank(world_size: int, cores: int | None = None) -> int:
    """Intra-op threads per rank so that all ranks together use each core once."""
    return max(1, (cores or cpu_cores()) // world_size)


def loopback_interface() -> str:
    """Name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return "lo"


@dataclass(frozen=True)
class Plan:
    """How a launch of ``world_size`` ranks will run on this machine."""

    world_size: int
    backend: str
    device_type: str  # "cpu" or "cuda"
    threads: int
    cores: int
    gpus: int

    def describe(self) -> str:
        where = "one GPU per rank" if self.device_type == "cuda" else "CPU"
        plural = "s" if self.threads != 1 else ""
        return (
            f"{self.world_size} rank{'s' if self.world_size != 1 else ''}, backend {self.backend} "
            f"on {where}, {self.threads} intra-op thread{plural} per rank "
            f"({self.cores} cores, {self.gpus} GPUs)"
        )


def plan(world_size: int, backend: str | None = None, threads: int | None = None) -> Plan:
    """Validate a launch request and choose backend and device from the hardware.

    Raises ``ValueError`` with a message that says what to change; nothing is started.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an integer, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if world_size > MAX_LOCAL_WORLD_SIZE:
        raise ValueError(
            f"world_size={world_size} is more processes than one machine should start "
            f"(limit {MAX_LOCAL_WORLD_SIZE}); for multi-node jobs use torchrun (chapter 07)"
        )
    cores, gpus = cpu_cores(), gpu_count()
    if backend is None:
        use_nccl = gpus >= world_size and dist.is_nccl_available()
        backend = "nccl" if use_nccl else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None (automatic), got {backend!r}")
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend 'nccl' is not available in this PyTorch build; use 'gloo'")
        if gpus < world_size:
            raise ValueError(
                f"backend 'nccl' needs one GPU per rank: world_size={world_size} but this "
                f"machine has {gpus} GPU(s); use backend='gloo' (CPU) or fewer ranks"
            )
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("backend 'gloo' is not available in this PyTorch build")
    if threads is None:
        threads = threads_per_rank(world_size, cores)
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
    device_type = "cuda" if backend == "nccl" else "cpu"
    return Plan(world_size, backend, device_type, threads, cores, gpus)


def rank_device() -> torch.device:
    """The device of the calling rank: its own GPU under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def gpu_names() -> list[str]:
    """The GPUs' names, from ``nvidia-smi``: asking torch would create a CUDA context in this
    process, and ranks forked from a process with a CUDA context cannot use CUDA."""
    if gpu_count() == 0:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    return names[: gpu_count()] or ["GPU"] * gpu_count()


def run_summary(text: str, cpu: str) -> str:
    """``text`` with {torch} and {device} filled in: what produces a chapter's outputs.

    ``cpu`` describes a machine without GPUs ({cores}); both come translated from the chapter.
    """
    names = gpu_names()
    if names:
        counts = {name: names.count(name) for name in dict.fromkeys(names)}
        device = ", ".join(f"{n} × {name}" for name, n in counts.items())
    else:
        device = cpu.format(cores=cpu_cores())
    return text.format(torch=torch.__version__, device=device)


def describe_machine() -> str:
    # Device names would need a CUDA context in this process; the count does not.
    return f"torch {torch.__version__}, {cpu_cores()} CPU cores, {gpu_count()} GPU(s)"
