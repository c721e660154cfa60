"""Slow ranks and profiling, chapter 11 (second part).

- ``straggler_times`` (rank function): every rank measures, per step, the time it spends
  loading its batch, computing, and waiting in the gradient all-reduce; one rank, unknown to
  the reader, is slower. ``find_straggler`` finds it from the gathered numbers alone;
- ``profile_ddp`` (rank function): ``torch.profiler`` around DDP steps; the backward
  operations on the main thread and the all-reduces on gloo's threads, as intervals, their
  overlap, and a trace file for Perfetto or ``chrome://tracing``.

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .common.models import mlp
from .common.timing import clock
from .common.training import average_gradients, wrap_ddp
from .runtime.hardware import rank_device

PHASES = ("data", "compute", "all-reduce")


def straggler_times(slow_rank: int = 1, extra: float = 0.02, steps: int = 6) -> dict:
    """Rank function: seconds per phase and step on this rank; ``slow_rank`` loads data ``extra`` s slower.

    The gradients are averaged by an explicit all-reduce after ``backward`` (``no_sync``
    keeps DDP's own out of the way), so that computing and waiting are timed apart. A rank
    that arrives late at the all-reduce waits least; the others wait for it.
    Every clock reading first waits for the work queued on the device (``common.timing``):
    on a GPU, ``backward`` and NCCL's all-reduce return before they have run, and a bare
    clock would put the wait into whichever phase next waits for the GPU.
    The slow rank starts its extra loading only once every other rank has computed its
    gradients (a barrier on a gloo group of its own, counted in the others' wait): it then
    arrives last at the all-reduce, ``extra`` seconds at least after the others, however the
    machine schedules the processes. A sleep alone makes that likely, not certain.
    Returns {phase: [seconds per step]} of every rank, gathered on all.
    """
    device, slow = rank_device(), dist.get_rank() == slow_rank
    model = wrap_ddp(mlp(width=256, depth=2, seed=0), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    gate = dist.new_group(backend="gloo")  # CPU-side, whatever the backend of the gradients
    mine = {phase: [] for phase in PHASES}
    for step in range(steps + 1):  # step 0 warms up: not recorded
        t0 = clock(device)
        x, y = torch.randn(128, 64, generator=generator), torch.randint(0, 10, (128,), generator=generator)
        if slow:
            dist.barrier(group=gate)  # the others have computed this step's gradients
            time.sleep(extra)  # a slower disk, a busier node, a longer sequence
        t1 = clock(device)
        with model.no_sync():
            optimizer.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        t2 = clock(device)
        if not slow:
            dist.barrier(group=gate)  # lets the slow rank start its extra work
        average_gradients(model)  # one all-reduce for all, as one DDP bucket
        t3 = clock(device)  # the averaged gradients' copy waits for NCCL on this stream: so does the clock
        optimizer.step()
        if step:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                mine[phase].append(seconds)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"per rank": everyone}


def find_straggler(per_rank: list[dict]) -> dict:
    """The rank that makes the others wait: the one that waits least in the all-reduce.

    Every rank leaves the all-reduce at about the same moment, so the time a rank spends in
    it is how early it arrived. The straggler arrives last and barely waits.
    """
    waits = [sum(r["all-reduce"]) / len(r["all-reduce"]) for r in per_rank]
    work = [sum(sum(r[p]) for p in ("data", "compute")) / len(r["data"]) for r in per_rank]
    slowest = min(range(len(waits)), key=waits.__getitem__)
    return {"rank": slowest, "mean wait": waits, "mean work": work}


def _merge(intervals):
    """The union of (start, end) intervals, as sorted disjoint intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(a, b) -> float:
    """Total length of the intersection of two unions of intervals."""
    total = 0.0
    for start, end in a:
        for s, e in b:
            total += max(0.0, min(end, e) - max(start, s))
    return total


# What chapter 11 asserts of the overlap share, per device type: with one bucket at most
# "one bucket", with small buckets at least "margin" more. On a CPU gloo's threads compete
# with backward for the same cores, so small buckets overlap by an amount that depends on
# the machine. On a GPU NCCL's stream waits for the last gradient before a single bucket's
# all-reduce (no overlap, up to the clock's resolution), while all buckets but the last
# (the first layer's 256 KB of 12.8 MB) are launched in the backward window.
OVERLAP_RULES = {"cpu": {"one bucket": 0.05, "margin": 0.05}, "cuda": {"one bucket": 0.02, "margin": 0.2}}


def _in_backward(op) -> bool:
    """Whether a CPU operation ran inside a backward function of the autograd engine.

    ``AccumulateGrad`` is left out: DDP's hooks run there, copying gradients into buckets.
    """
    while op is not None:
        if op.name.startswith("autograd::engine::evaluate_function") and "AccumulateGrad" not in op.name:
            return True
        op = op.cpu_parent
    return False


def _gpu_intervals(events, steps, ms) -> tuple[list, list]:
    """On a GPU: per step, the backward window (first to last backward kernel), and NCCL's kernels.

    The CPU only queues kernels; what runs when is in the kernels' own intervals. A small
    model's backward kernels last microseconds with gaps between them, where the GPU waits
    for the CPU to queue the next: their union would make an all-reduce that runs during
    backward look exposed. The window is what communication can hide behind. A kernel
    belongs to backward if the operation that queued it ran in a backward function: DDP's
    copies of reduced buckets back into ``.grad`` run after the all-reduce and do not count.
    """
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernels = [e for e in events if e.device_type == cuda]
    # Operations, by the id their kernels link to (runtime calls such as cudaLaunchKernel link too: left out).
    launched_by = {e.id: e for e in events if e.device_type == cpu and not e.linked_correlation_id}
    comm = sorted((ms(k.time_range.start), ms(k.time_range.end)) for k in kernels if "nccl" in k.name.lower())
    backward = [
        (launched_by[k.linked_correlation_id], k)
        for k in kernels
        if "nccl" not in k.name.lower() and _in_backward(launched_by.get(k.linked_correlation_id))
    ]
    windows = []
    for step in steps:  # the kernels the CPU queued during the step's CPU time
        mine = [k for op, k in backward if step.time_range.start <= op.time_range.start <= step.time_range.end]
        if mine:
            windows.append((ms(min(k.time_range.start for k in mine)), ms(max(k.time_range.end for k in mine))))
    return windows, comm


def _cpu_intervals(events, steps_cpu, ms) -> tuple[list, list]:
    """Backward compute on the main thread and gloo's all-reduces on its threads, as (start, end) ms."""
    compute = _merge(
        (ms(e.time_range.start), ms(e.time_range.end))
        for e in events
        if e.name.startswith("autograd::engine::evaluate_function") and "AccumulateGrad" not in e.name
    )
    comm = sorted((ms(e.time_range.start), ms(e.time_range.end)) for e in events if e.name == "gloo:all_reduce")
    return compute, comm


def profile_ddp(bucket_cap_mb: float = 1.0, steps: int = 3, trace_dir: str | None = None) -> dict:
    """Rank function: profile ``steps`` DDP steps of a 3.2M-parameter MLP.

    Compute: on a CPU, the backward operations the autograd engine runs on the main thread;
    on a GPU, each step's backward window (see ``_gpu_intervals``). Communication: the
    all-reduces gloo runs on its own threads, one per gradient bucket (on a GPU: NCCL's kernels).
    Returns both as (start, end) intervals in ms from the first step's start, the share of
    communication time that overlaps backward compute, the number of buckets per step, the
    device type (``OVERLAP_RULES`` says what to expect there), and the path of the Chrome
    trace if ``trace_dir`` is given.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    device = rank_device()
    model = wrap_ddp(mlp(width=1024, depth=4, seed=0), device, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = (
        torch.randn(256, 64, generator=generator).to(device),
        torch.randint(0, 10, (256,), generator=generator).to(device),
    )

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(2):  # warm-up: DDP re-forms its buckets after the first step
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("train step"):
                step()
    events = prof.events()
    # The steps' CPU ranges (on a GPU the profiler adds a GPU annotation of the same name).
    steps_cpu = [e for e in events if e.name == "train step" and e.device_type == torch.autograd.DeviceType.CPU]
    start = min(e.time_range.start for e in steps_cpu)
    ms = lambda us: (us - start) / 1e3  # noqa: E731  (profiler times are in microseconds)
    compute, comm = (_gpu_intervals if device.type == "cuda" else _cpu_intervals)(events, steps_cpu, ms)
    comm_total = sum(e - s for s, e in comm)
    trace = None
    if trace_dir is not None:
        trace = str(Path(trace_dir) / f"ddp_bucket{bucket_cap_mb:g}MB_rank{dist.get_rank()}.json")
        prof.export_chrome_trace(trace)
    return {
        "compute": compute,
        "communication": comm,
        "overlap": _overlap(compute, _merge(comm)) / comm_total if comm_total else 0.0,
        "buckets per step": len(comm) / steps,
        "device": device.type,
        "step ms": [ms(e.time_range.end) - ms(e.time_range.start) for e in steps_cpu],
        "trace": trace,
    }
