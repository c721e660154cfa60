"""What this machine can run, and how a launch uses it: backend, device, precision, threads.

Every decision is a function of a :class:`Hardware` description, so that the choices made
for GPU machines can be checked on a laptop: ``plan(2, hardware=Hardware(cores=16, gpus=1,
gpu_bf16=True))`` says what one GPU would give a 2-rank launch (gloo on the CPU, fp32),
without a GPU in sight. ``Hardware.detect()`` describes the machine this runs on.

Nothing here initialises CUDA. ``torch.cuda.is_available()`` calls ``cudaGetDeviceCount``,
which initialises the CUDA driver (``cuInit``): processes forked afterwards, DataLoader
workers included, fail with "CUDA error: initialization error". ``torch.cuda.device_count()``
asks NVML instead when it can, and GPU names and compute capabilities come from
``nvidia-smi`` (a separate process), never from ``torch.cuda.get_device_properties``.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import gpus as gpu_profiles
from .i18n import number, tr

# More ranks than this on one machine is almost certainly a typo (world_size=2000
# instead of 2); refusing it early saves the learner from a frozen machine.
MAX_LOCAL_WORLD_SIZE = 64

BACKENDS = ("gloo", "nccl")
# fp16 needs a GradScaler and can overflow: a script asks for it, a plan never picks it.
PRECISIONS = ("fp32", "bf16", "fp16")
# bf16 matrix units arrived with compute capability 8.0 (A100); a T4 (7.5) only emulates bf16.
# One source of truth: the GPU profiles (runtime/gpus.py) decide, this is the same number as a float.
BF16_COMPUTE_CAPABILITY = float(".".join(map(str, gpu_profiles.BF16_CAPABILITY)))


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def gpu_count() -> int:
    """GPUs this process can see (after ``CUDA_VISIBLE_DEVICES``), without initialising CUDA.

    0 for a CPU build of torch. On a CUDA build, NVML counts them; only where NVML is
    missing does torch fall back to the CUDA runtime."""
    return torch.cuda.device_count()


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


# ------------------------------------------------------------------ what the machine has


@dataclass(frozen=True)
class SmiGpu:
    """One row of ``nvidia-smi --query-gpu``: a physical GPU of this machine."""

    index: str
    uuid: str
    name: str
    compute_capability: float | None  # None: the driver is too old to say


@functools.cache
def nvidia_smi_gpus() -> tuple[SmiGpu, ...]:
    """Every GPU ``nvidia-smi`` lists (it ignores ``CUDA_VISIBLE_DEVICES``); () without it.

    Cached: the GPUs of a machine do not change while a notebook runs, and every launch
    asks (a call to ``nvidia-smi`` takes a noticeable fraction of a second)."""
    for fields in ("index,uuid,name,compute_cap", "index,uuid,name"):  # compute_cap: drivers >= 510
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
        except (OSError, subprocess.SubprocessError):
            return ()
        if out.returncode == 0:
            return tuple(_smi_row(line) for line in out.stdout.splitlines() if line.strip())
    return ()


def _smi_row(line: str) -> SmiGpu:
    parts = [p.strip() for p in line.split(",")]
    index, uuid, name = (parts + ["", "", ""])[:3]
    try:
        capability = float(parts[3]) if len(parts) > 3 else None
    except ValueError:  # "[N/A]"
        capability = None
    return SmiGpu(index, uuid, name or "GPU", capability)


def visible_gpu_ids(count: int, visible: str | None = None) -> tuple[str, ...]:
    """How ``CUDA_VISIBLE_DEVICES`` names the ``count`` GPUs a process sees, in CUDA's order:
    ("0", "1", ...) when it is unset, else its first ``count`` entries ("2", "GPU-8e1c...")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return tuple(str(i) for i in range(count))
    return tuple(v.strip() for v in visible.split(",") if v.strip())[:count]


def _match(gpu_id: str, rows: Sequence[SmiGpu]) -> SmiGpu | None:
    for row in rows:
        if gpu_id == row.index or (gpu_id.startswith("GPU-") and row.uuid.startswith(gpu_id)):
            return row
    return None  # e.g. a MIG slice


def _row_bf16(row: SmiGpu) -> bool:
    """What the GPU profiles say about this GPU: by name, else by what its capability implies."""
    known = gpu_profiles.by_name(row.name)
    if known is not None:
        return known.native_bf16
    return row.compute_capability is not None and row.compute_capability >= BF16_COMPUTE_CAPABILITY


def _bf16(rows: Sequence[SmiGpu]) -> bool:
    return bool(rows) and all(_row_bf16(r) for r in rows)


@dataclass(frozen=True)
class Hardware:
    """What one machine gives a job: ``cores`` CPU cores and ``gpus`` GPUs on each of ``nodes``
    machines (a launch from a notebook uses one).

    gpu_bf16: every GPU has bf16 matrix units (compute capability >= 8.0).
    nccl_available: this torch build has NCCL (default: whether there are GPUs).
    gpu_ids: the GPUs as ``CUDA_VISIBLE_DEVICES`` names them (default "0", "1", ...): a
        worker given its own ``CUDA_VISIBLE_DEVICES`` must be given these names.
    """

    cores: int
    gpus: int = 0
    gpu_bf16: bool = False
    gpu_names: tuple[str, ...] = ()
    nodes: int = 1
    nccl_available: bool | None = None
    gpu_ids: tuple[str, ...] = ()

    def __post_init__(self):
        if self.cores < 1 or self.gpus < 0 or self.nodes < 1:
            raise ValueError(f"a machine needs cores >= 1, gpus >= 0 and nodes >= 1: {self}")
        fill = object.__setattr__  # frozen: the defaults are filled in once, here
        if self.nccl_available is None:
            fill(self, "nccl_available", self.gpus > 0)
        fill(self, "gpu_names", tuple(self.gpu_names) or ("GPU",) * self.gpus)
        fill(self, "gpu_ids", tuple(self.gpu_ids) or tuple(str(i) for i in range(self.gpus)))
        if len(self.gpu_ids) != self.gpus or len(self.gpu_names) != self.gpus:
            raise ValueError(f"gpu_ids and gpu_names need one entry per GPU ({self.gpus}): {self}")
        if self.gpus == 0:
            fill(self, "gpu_bf16", False)

    @classmethod
    def detect(cls) -> Hardware:
        """This machine, as this process sees it; creates no CUDA context (see the module's docstring)."""
        gpus = gpu_count()
        ids = visible_gpu_ids(gpus)
        ids += tuple(str(i) for i in range(len(ids), gpus))  # more GPUs than names: number them
        rows = nvidia_smi_gpus() if gpus else ()
        mine = [_match(i, rows) for i in ids]
        if torch.version.hip:
            bf16 = gpus > 0  # every GPU that ROCm builds of torch support has bf16
        else:  # a GPU nvidia-smi cannot place (a MIG slice): what holds for all of them holds for it
            bf16 = gpus > 0 and all(_bf16([row] if row else rows) for row in mine)
        return cls(
            cores=cpu_cores(),
            gpus=gpus,
            gpu_bf16=bf16,
            gpu_names=tuple(row.name if row else "GPU" for row in mine),
            nccl_available=dist.is_available() and dist.is_nccl_available(),
            gpu_ids=ids,
        )


# ------------------------------------------------------------------ a launch from a notebook


@dataclass(frozen=True)
class Plan:
    """How a launch of ``world_size`` ranks will run on this machine.

    devices: each rank's device, by rank ("cuda:0", "cuda:1" or "cpu", "cpu").
    precision: "bf16" when every rank is on a GPU with bf16 (or when asked for), else "fp32".
    pin_memory: page-locked host buffers pay only for copies to a GPU.
    """

    world_size: int
    backend: str
    device_type: str  # "cpu" or "cuda"
    threads: int
    cores: int
    gpus: int
    devices: tuple[str, ...] = ()
    precision: str = "fp32"
    pin_memory: bool = False

    def describe(self) -> str:
        """One line for the reader (the launcher prints it after ``launch:``), in their language."""
        ranks = tr("1 rank") if self.world_size == 1 else tr("{n} ranks").format(n=self.world_size)
        if self.threads == 1:
            threads = tr("1 intra-op thread per rank")
        else:
            threads = tr("{n} intra-op threads per rank").format(n=self.threads)
        if self.device_type == "cuda":
            text = tr("{ranks}, backend {backend} on one GPU per rank, {threads} ({cores} cores, {gpus} GPUs)")
        else:
            text = tr("{ranks}, backend {backend} on CPU, {threads} ({cores} cores, {gpus} GPUs)")
        return text.format(
            ranks=ranks, backend=self.backend, threads=threads, cores=number(self.cores), gpus=number(self.gpus)
        )


def _check_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(tr("world_size must be an integer, got {value}").format(value=repr(world_size)))
    if world_size < 1:
        raise ValueError(tr("world_size must be at least 1, got {value}").format(value=world_size))
    if world_size > MAX_LOCAL_WORLD_SIZE:
        raise ValueError(
            tr(
                "world_size={world_size} is more processes than one machine should start "
                "(limit {limit}); for multi-node jobs use torchrun (chapter 07)"
            ).format(world_size=world_size, limit=MAX_LOCAL_WORLD_SIZE)
        )


def _choose_backend(world_size: int, backend: str | None, hw: Hardware) -> str:
    """nccl when every rank can have a GPU of its own, else gloo; a request the machine
    cannot serve is a ValueError that says what to change."""
    if backend is None:
        backend = "nccl" if hw.gpus >= world_size and hw.nccl_available else "gloo"
    if backend not in BACKENDS:
        raise ValueError(
            tr("backend must be one of {choices} or None (automatic), got {value}").format(
                choices=BACKENDS, value=repr(backend)
            )
        )
    if backend == "nccl":
        if not hw.nccl_available:
            raise ValueError(tr("backend 'nccl' is not available in this PyTorch build; use 'gloo'"))
        if hw.gpus < world_size:
            raise ValueError(
                tr(
                    "backend 'nccl' needs one GPU per rank: world_size={world_size} but this "
                    "machine has {gpus} GPU(s); use backend='gloo' (CPU) or fewer ranks"
                ).format(world_size=world_size, gpus=hw.gpus)
            )
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError(tr("backend 'gloo' is not available in this PyTorch build"))
    return backend


def _choose_precision(device_type: str, precision: str | None, hw: Hardware) -> str:
    if precision is None:
        return "bf16" if device_type == "cuda" and hw.gpu_bf16 else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(
            tr("precision must be one of {choices} or None (automatic), got {value}").format(
                choices=PRECISIONS, value=repr(precision)
            )
        )
    return precision


def plan(
    world_size: int,
    backend: str | None = None,
    threads: int | None = None,
    hardware: Hardware | None = None,
    precision: str | None = None,
) -> Plan:
    """Validate a launch request and choose backend, devices and precision from the hardware
    (``Hardware.detect()`` unless given). ``precision`` pins it: runs that are compared with
    each other should all name the same one.

    Raises ``ValueError`` with a message that says what to change; nothing is started.
    """
    _check_world_size(world_size)
    hw = Hardware.detect() if hardware is None else hardware
    backend = _choose_backend(world_size, backend, hw)
    if threads is None:
        threads = threads_per_rank(world_size, hw.cores)
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(tr("threads must be a positive integer or None, got {value}").format(value=repr(threads)))
    device_type = "cuda" if backend == "nccl" else "cpu"
    devices = tuple(f"cuda:{r}" for r in range(world_size)) if device_type == "cuda" else ("cpu",) * world_size
    return Plan(
        world_size,
        backend,
        device_type,
        threads,
        hw.cores,
        hw.gpus,
        devices=devices,
        precision=_choose_precision(device_type, precision, hw),
        pin_memory=device_type == "cuda",
    )


def rank_device() -> torch.device:
    """The device of the calling rank: its own GPU under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# ------------------------------------------------------------------ torchrun agents


@dataclass(frozen=True)
class NodePlan:
    """What one torchrun agent's workers use, by ``LOCAL_RANK``.

    devices: each worker's device as the worker names it ("cuda:0" is the first GPU it sees).
    gpus: each worker's GPU as this machine names it (a ``gpu_ids`` entry); () on the CPU.
    visible_devices: the ``CUDA_VISIBLE_DEVICES`` to start the agent with ("" hides every GPU).
    machine: which of the hardware's machines the agent runs on (agents fill them in node-rank order).
    """

    nnodes: int
    nproc_per_node: int
    node_rank: int
    backend: str
    devices: tuple[str, ...]
    gpus: tuple[str, ...]
    visible_devices: str
    precision: str
    pin_memory: bool
    threads: int
    machine: int = 0

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def env(self) -> dict[str, str]:
        """The variables to add to the agent's environment (its workers inherit them)."""
        return {"CUDA_VISIBLE_DEVICES": self.visible_devices}


def _agent_gpus(hw: Hardware, nnodes: int, nproc: int, node_rank: int, visible: str | None) -> tuple[str, ...]:
    """The GPUs this agent's workers take, or () when they must run on the CPU.

    Agents that share a machine all start their workers at LOCAL_RANK 0, so each needs GPUs
    of its own: agents fill the ``hw.nodes`` machines in node-rank order, and the k-th
    agent on a machine takes the k-th block of ``nproc`` GPUs. Every agent computes the
    same verdict from the same numbers: either all use GPUs or none does, never a mix."""
    if not hw.nccl_available:
        return ()
    if visible is not None:  # the caller chose this agent's GPUs
        known = set(hw.gpu_ids)
        seen = []
        for gpu in (v.strip() for v in visible.split(",") if v.strip()):
            if gpu not in known:
                break  # CUDA stops at the first id it does not know
            seen.append(gpu)
        return tuple(seen[:nproc]) if len(seen) >= nproc else ()
    per_machine = math.ceil(nnodes / hw.nodes)
    if hw.gpus < per_machine * nproc:
        return ()
    slot = node_rank % per_machine
    return hw.gpu_ids[slot * nproc : (slot + 1) * nproc]


def node_plan(
    hardware: Hardware | None,
    nnodes: int,
    nproc_per_node: int,
    node_rank: int,
    visible_devices: str | None = None,
) -> NodePlan:
    """How agent ``node_rank`` of ``nnodes`` torchrun agents, ``nproc_per_node`` workers each,
    runs on ``hardware`` (``Hardware.detect()`` if None; ``hardware.nodes`` machines, so
    ``Hardware(..., nodes=1)`` with ``nnodes=2`` is the course's "two nodes on one machine").

    Each worker gets a GPU no other worker has (by giving each agent its own
    ``CUDA_VISIBLE_DEVICES``) when there are enough for every agent on the machine; otherwise
    every worker uses gloo on the CPU and ``CUDA_VISIBLE_DEVICES`` is "". ``visible_devices``:
    the ``CUDA_VISIBLE_DEVICES`` this agent was already given, to be honoured.
    """
    for name, value in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1}, got {node_rank!r}")
    hw = Hardware.detect() if hardware is None else hardware
    gpus = _agent_gpus(hw, nnodes, nproc_per_node, node_rank, visible_devices)
    per_machine = math.ceil(nnodes / hw.nodes)
    on_gpus = bool(gpus)
    return NodePlan(
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        node_rank=node_rank,
        backend="nccl" if on_gpus else "gloo",
        devices=tuple(f"cuda:{i}" for i in range(nproc_per_node)) if on_gpus else ("cpu",) * nproc_per_node,
        gpus=gpus,
        visible_devices=",".join(gpus),
        precision="bf16" if on_gpus and hw.gpu_bf16 else "fp32",
        pin_memory=on_gpus,
        threads=threads_per_rank(per_machine * nproc_per_node, hw.cores),
        machine=node_rank // per_machine,
    )


def agent_env(hardware: Hardware | None, nnodes: int, nproc_per_node: int, node_rank: int) -> dict[str, str]:
    """The variables to add to the environment of torchrun agent ``node_rank`` (see :func:`node_plan`):
    ``{"CUDA_VISIBLE_DEVICES": "1"}`` for the second of two one-worker agents on a 2-GPU
    machine, ``{"CUDA_VISIBLE_DEVICES": ""}`` for both on a machine with fewer GPUs."""
    return node_plan(hardware, nnodes, nproc_per_node, node_rank).env()


# Launcher options that take no value; all others do ("--opt=value" or "--opt value").
_TORCHRUN_SWITCHES = {"--standalone", "--no-python", "--run-path", "--module", "--use-env"}


def torchrun_options(command: Sequence[str]) -> dict[str, str] | None:
    """The launcher's options of a torchrun command line (those before the script or
    ``-m module``), names spelled with dashes; None when ``command`` is not torchrun."""
    args = [str(a) for a in command]
    launchers = ("torch.distributed.run", "torch.distributed.launch")  # python -m ..., or the torchrun script
    starts = [i for i, a in enumerate(args) if a.endswith("torchrun") or a in launchers]
    if not starts:
        return None
    args, options, i = args[starts[0] + 1 :], {}, 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-m":
        name, eq, value = args[i].partition("=")
        name = "--" + name.lstrip("-").replace("_", "-")
        if not eq and name not in _TORCHRUN_SWITCHES and i + 1 < len(args):
            value, i = args[i + 1], i + 1
        options[name] = value
        i += 1
    return options


def torchrun_shape(command: Sequence[str], hardware: Hardware | None = None) -> tuple[int, int, int | None] | None:
    """(nnodes, nproc_per_node, node_rank) of a torchrun command line, None if it is not one;
    node_rank is None when the command does not give it.

    For an elastic ``--nnodes=1:2`` the largest number of agents counts; ``--nproc-per-node``
    ``gpu``, ``cpu`` or ``auto`` count ``hardware``'s GPUs or cores, as torchrun does."""
    options = torchrun_options(command)
    if options is None:
        return None
    nnodes = 1 if "--standalone" in options else int(options.get("--nnodes", "1").split(":")[-1])
    nproc = options.get("--nproc-per-node", "1")
    if not nproc.isdigit():
        hw = Hardware.detect() if hardware is None else hardware
        nproc = {"gpu": hw.gpus, "cpu": hw.cores}.get(nproc, hw.gpus or hw.cores)
    rank = options.get("--node-rank", "")
    return nnodes, int(nproc), int(rank) if rank.isdigit() else None


def torchrun_agent_env(command: Sequence[str], node_rank: int | None = None, hardware: Hardware | None = None) -> dict:
    """:func:`agent_env` for a command line: {} when it is not torchrun. ``node_rank``: the
    agent's position among the agents of its job started together; default its ``--node-rank``."""
    shape = torchrun_shape(command, hardware)
    if shape is None:
        return {}
    nnodes, nproc, given = shape
    rank = given if node_rank is None else node_rank
    return agent_env(hardware, nnodes, nproc, min(rank or 0, nnodes - 1))


def conflicts(plans: Sequence[NodePlan]) -> list[str]:
    """What goes wrong when these agents run together: two workers on one GPU of one machine
    (NCCL refuses it: "Duplicate GPU detected") or agents that chose different backends."""
    problems = []
    users: dict[tuple[int, str], list[str]] = {}
    for p in plans:
        for local_rank, gpu in enumerate(p.gpus):
            users.setdefault((p.machine, gpu), []).append(f"node {p.node_rank} LOCAL_RANK {local_rank}")
    for (machine, gpu), who in users.items():
        if len(who) > 1:
            problems.append(
                f"GPU {gpu} of machine {machine} is used by {' and '.join(who)}: "
                "NCCL refuses it (Duplicate GPU detected)"
            )
    backends = sorted({p.backend for p in plans})
    if len(backends) > 1:
        problems.append(f"the agents chose different backends ({', '.join(backends)}): their workers cannot meet")
    return problems


# ------------------------------------------------------------------ what a page says about its machine


def gpu_names() -> list[str]:
    """The GPUs' names, from ``nvidia-smi``: asking torch would create a CUDA context in this
    process, and ranks forked from a process with a CUDA context cannot use CUDA."""
    return list(Hardware.detect().gpu_names)


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
    return tr("torch {version}, {cores} CPU cores, {gpus} GPU(s)").format(
        version=torch.__version__, cores=number(cpu_cores()), gpus=number(gpu_count())
    )
