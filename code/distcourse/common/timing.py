"""Reading a clock around work that may run asynchronously on a GPU.

GPU kernels are queued on a *stream* and run later, so ``time.perf_counter()``
alone measures how fast work was queued. The fix is to wait before reading the
clock, but wait for the right thing:

* ``torch.cuda.synchronize()`` waits for **every** stream of the device. NCCL runs
  its communication on streams of its own, so in a pipeline that posted its
  ``irecv``s up front, a device-wide synchronize also waits for messages that have
  not been sent yet: the timer then measures someone else's schedule.
* ``torch.cuda.current_stream(device).synchronize()`` waits only for the compute
  queued on this rank's current stream. That is what ``wait_for_compute`` does.

On CPU everything is synchronous and both functions only read the clock.
"""

from __future__ import annotations

import time

import torch

Devices = torch.device | str | None | list | tuple


def wait_for_compute(device: Devices = None) -> None:
    """Wait until the compute already queued on ``device``'s current stream has run.

    ``device`` may also be a list: one process that drives several GPUs waits for each.
    """
    if isinstance(device, (list, tuple)):
        for one in dict.fromkeys(map(str, device)):  # each device once, in order
            wait_for_compute(one)
        return
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device is not None and device.type not in ("cpu", "meta"):
        accelerator = getattr(torch, device.type, None)  # xpu, mps...: same idea, their own module
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            accelerator.synchronize()


def clock(device: Devices = None) -> float:
    """``time.perf_counter()`` after the compute queued on ``device`` has finished."""
    wait_for_compute(device)
    return time.perf_counter()


class Stopwatch:
    """Adds up the seconds spent in named phases: ``with watch("backward"): ...``."""

    def __init__(self, device: Devices = None):
        self.device = device
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str):
        return _Phase(self, phase)


class _Phase:
    def __init__(self, watch: Stopwatch, phase: str):
        self.watch, self.phase = watch, phase

    def __enter__(self):
        self.start = clock(self.watch.device)
        return self

    def __exit__(self, *exc):
        elapsed = clock(self.watch.device) - self.start
        self.watch.seconds[self.phase] = self.watch.seconds.get(self.phase, 0.0) + elapsed
        return False


def best_of(fn, repeats: int = 3, device: Devices = None, *, warmup: int = 0, setup=None) -> float:
    """The fastest of ``repeats`` timed calls of ``fn()`` (the least disturbed by the machine).

    ``warmup`` calls run first, untimed (allocations, connections). ``setup``, if given, runs
    untimed before every call and its result is passed to ``fn``: a fresh buffer, a barrier.
    """
    times = []
    for _ in range(warmup + max(1, repeats)):
        args = () if setup is None else (setup(),)
        start = clock(device)
        fn(*args)
        times.append(clock(device) - start)
    return min(times[warmup:])


def median(values) -> float:
    """The middle value (the mean of the two middle ones for an even count)."""
    import statistics

    return statistics.median(values)


def first_and_steady(seconds) -> dict:
    """``{"first": seconds[0], "steady": median of the rest}`` for the seconds of successive steps.

    The first step pays once for what later steps reuse (tracing and compiling, DDP's bucket
    setup, allocations, connections), so it is reported apart. For the steady step the median,
    not the mean or the minimum: on a shared machine a few steps are slowed by other processes,
    which would pull a mean up, while the minimum is a lucky step that a run rarely repeats.
    The median is what a typical step costs.
    """
    seconds = list(seconds)
    if len(seconds) < 2:
        raise ValueError(f"need a first step and at least one more, got {len(seconds)} step(s)")
    return {"first": seconds[0], "steady": median(seconds[1:])}
