"""Mixed precision in chapter 09: number formats, autocast, loss scaling, DDP and FSDP2.

1. ``format_table``: what fp32, fp16 and bf16 can represent (range vs precision);
2. ``autocast_dtypes``: which dtype each operation produces inside ``torch.autocast``;
3. ``underflow`` and ``scaler_skips_inf``: why fp16 gradients need loss scaling, and what
   ``GradScaler`` does when a scaled gradient overflows;
4. rank functions: ``ddp_train`` (DDP with fp32, bf16 autocast or fp16 autocast + GradScaler)
   and ``fsdp_policy`` (FSDP2's ``MixedPrecisionPolicy``: the dtypes it really uses).

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .common.datasets import digits_batch
from .common.models import mlp
from .common.sharded import make_model, shard_model
from .common.timing import clock
from .common.training import global_mean, wrap_ddp
from .runtime.hardware import rank_device

FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISIONS = ("fp32", "bf16", "fp16")


def format_table() -> dict:
    """Bits and limits of each format, read from ``torch.finfo`` rather than typed in."""
    table = {}
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        mantissa = round(-math.log2(info.eps))  # eps = 2^-mantissa bits: the step after 1
        table[name] = {
            "bits": info.bits,
            "exponent_bits": info.bits - 1 - mantissa,
            "mantissa_bits": mantissa,
            "max": info.max,
            "smallest_normal": info.tiny,
            "eps": info.eps,  # the gap between 1 and the next number: relative precision
        }
    return table


def autocast_dtypes(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Run a few typical operations inside ``torch.autocast`` and record the dtype of each result.

    Autocast keeps a list per device: matrix products go to ``dtype``; operations that
    need range or accumulate many terms (losses, some reductions) stay in fp32. The lists
    of CPU and CUDA differ, so this asks the device at hand instead of quoting a list.
    """
    device = torch.device(device_type)
    layer = nn.Linear(8, 8).to(device)
    x = torch.randn(4, 8, device=device)
    target = torch.zeros(4, dtype=torch.long, device=device)
    with torch.autocast(device_type, dtype=dtype):
        y = layer(x)
        results = {
            "linear": y,
            "matmul": x @ x.T,
            "relu": F.relu(y),
            "gelu": F.gelu(y),
            "softmax": F.softmax(y, dim=-1),
            "layer_norm": F.layer_norm(y, (8,)),
            "sum": y.sum(),
            "cross_entropy": F.cross_entropy(y, target),
        }
    results["cross_entropy"].backward()
    dtypes = {name: t.dtype for name, t in results.items()}
    dtypes["weight (parameter)"] = layer.weight.dtype
    dtypes["weight.grad"] = layer.weight.grad.dtype
    return dtypes


def underflow(gradient: float = 2e-8, scale: float = 65536.0) -> dict:
    """A small gradient value stored in fp16 and bf16, with and without loss scaling."""
    g = torch.tensor(gradient)
    return {
        "fp32": g.item(),
        "fp16": g.half().item(),
        "bf16": g.bfloat16().item(),
        "fp16, scaled": (g * scale).half().item(),
        "fp16, scaled then unscaled in fp32": ((g * scale).half().float() / scale).item(),
    }


def scaler_skips_inf(device_type: str = "cpu", init_scale: float = 1024.0) -> dict:
    """One GradScaler step whose gradients overflowed: the step is skipped, the scale halved."""
    weight = nn.Parameter(torch.ones(3, device=device_type))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
    before = weight.detach().clone()
    loss = (weight * torch.tensor([1.0, float("inf"), 1.0], device=device_type)).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # finds inf in the (unscaled) gradients: does not call optimizer.step()
    scaler.update()  # ...and lowers the scale for the next step
    return {
        "weight unchanged": torch.equal(weight.detach(), before),
        "scale before": init_scale,
        "scale after": scaler.get_scale(),
    }


# --------------------------------------------------------------------------------------
# Rank functions
# --------------------------------------------------------------------------------------


def _batch(step: int, rank: int, world_size: int, batch: int = 64):
    """This rank's share of global batch ``step`` of the digits (the same in every run)."""
    x, y = digits_batch(batch * world_size, seed=step)
    part = slice(rank * batch, (rank + 1) * batch)
    return x[part], y[part]


def ddp_train(precision: str = "fp32", steps: int = 30, width: int = 256, lr: float = 0.3) -> dict:
    """Rank function: DDP training of an MLP on digits in fp32, bf16 autocast or fp16 autocast.

    fp16 uses a ``GradScaler``: the loss is multiplied before backward so that small
    gradients survive in fp16, and the gradients are divided again before the step.
    Returns the global loss of every step and the seconds per step. A timed step includes
    the all-reduce of its loss and the ``.item()`` that reads it, which waits for the GPU:
    every precision pays the same small extra, and the clock never reads queued work.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    device = rank_device()
    model = wrap_ddp(mlp(width=width, depth=2, seed=0), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, started = [], None
    for step in range(steps):
        if step == 1:
            started = clock(device)  # the first step pays for warm-up: not timed
        x, y = (t.to(device) for t in _batch(step, rank, world))
        with torch.autocast(device.type, dtype=FORMATS[precision], enabled=precision != "fp32"):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        losses.append(global_mean(loss))  # all ranks' mean: the loss of the whole global batch
    seconds = (clock(device) - started) / (steps - 1)
    if rank == 0:
        print(f"{precision}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {seconds * 1e3:.2f} ms/step")
    return {"losses": losses, "seconds_per_step": seconds}


def fsdp_policy(param_dtype: str | None = "bf16", reduce_dtype: str | None = "fp32", steps: int = 5) -> dict:
    """Rank function: FSDP2 with a ``MixedPrecisionPolicy``; which dtype lives where.

    Records the dtype of the sharded parameter (what the optimizer updates), of the
    gathered parameter while a layer computes, of the layer's output, and of the sharded
    gradient after backward, then trains ``steps`` steps and returns the losses.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device = rank_device()
    policy = MixedPrecisionPolicy(
        param_dtype=FORMATS.get(param_dtype), reduce_dtype=FORMATS.get(reduce_dtype)
    )  # None: keep the parameter's own dtype
    model = shard_model(make_model().to(device), mp_policy=policy)  # chapter 08's model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)

    seen = {"sharded parameter": model[0].weight.dtype}
    first = model[0]

    def record(key, dtype):
        seen.setdefault(key, dtype)  # the first step's: every later step repeats it

    # Hooks registered after fully_shard run after FSDP's own: the weight is gathered by then.
    first.register_forward_pre_hook(lambda m, args: record("gathered parameter", m.weight.dtype))
    first.register_forward_hook(lambda m, args, out: record("layer output", out.dtype))
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in _batch(step, rank, world))
        loss = F.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        record("sharded gradient", model[0].weight.grad.dtype)
        optimizer.step()
        losses.append(global_mean(loss))
    return {"dtypes": seen, "losses": losses}
