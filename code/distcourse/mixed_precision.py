"""Mixed precision in chapter 09: number formats, autocast, loss scaling, DDP and FSDP2.

1. ``format_table``: what fp32, fp16 and bf16 can represent (range vs precision);
2. ``autocast_dtypes``: which dtype each operation produces inside ``torch.autocast``;
3. ``underflow`` and ``scaler_skips_inf``: why fp16 gradients need loss scaling, and what
   ``GradScaler`` does when a scaled gradient overflows;
4. ``ring_sum``: why gradients are reduced in fp32: a bf16 sum over many ranks loses digits;
5. ``matmul_precision``: what ``torch.set_float32_matmul_precision`` changes (TF32 on GPUs),
   timed against bf16; ``tf32_expectations``: what that timing may assert on a given GPU,
   decided from its profile (``runtime.gpus``), not from its compute capability alone;
6. rank functions: ``ddp_train`` (DDP with fp32, bf16 autocast or fp16 autocast + GradScaler)
   and ``fsdp_policy`` / ``fsdp_policies`` (FSDP2's ``MixedPrecisionPolicy``: the dtypes it
   really uses, and whether the gradients were reduced in bf16).

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .common.datasets import digits_batch
from .common.models import mlp
from .common.numerics import relative_gap
from .common.sharded import make_model, shard_model
from .common.timing import best_of, clock
from .common.training import global_mean, wrap_ddp
from .runtime import gpus
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr

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


def label(key: str) -> str:
    """A key of this module's results as the reader sees it: format names as they are, words translated."""
    words = {
        "fp16, scaled": tr("fp16, scaled"),
        "fp16, scaled then unscaled in fp32": tr("fp16, scaled then unscaled in fp32"),
        "weight (parameter)": tr("weight (parameter)"),
        "sharded parameter": tr("sharded parameter"),
        "gathered parameter": tr("gathered parameter"),
        "layer output": tr("layer output"),
        "sharded gradient": tr("sharded gradient"),
        "summed in bf16": tr("summed in bf16"),
        "summed in fp32": tr("summed in fp32"),
        "exact sum, rounded once to bf16": tr("exact sum, rounded once to bf16"),
        "fp32, highest": tr('fp32, "highest" (default)'),
        "fp32, high": tr('fp32, "high" (TF32 where available)'),
    }
    return words.get(key, key)


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


def ring_sum(ranks: int = 256, size: int = 4096, seed: int = 0) -> dict:
    """The sum of ``ranks`` bf16 gradients, added one rank at a time in bf16 and in fp32.

    A ring all-reduce adds one rank's contribution per step and passes the partial sum on in
    the reduction's dtype, so it is rounded to that dtype after every addition (chapter 03's
    ring). Each gradient is the same true value plus noise of the same size, as gradients of
    one parameter on different ranks are. Returns the relative gap of each sum to the exact
    one (float64, of the same bf16 inputs) and the gap of the exact sum rounded once to bf16.
    """
    generator = torch.Generator().manual_seed(seed)
    true = torch.randn(size, generator=generator) * 1e-3
    grads = (true + torch.randn(ranks, size, generator=generator) * 1e-3).bfloat16()
    exact = grads.double().sum(0)
    sums = {}
    for name in ("bf16", "fp32"):
        partial = torch.zeros(size, dtype=FORMATS[name])
        for g in grads:  # one step of the ring: add this rank's part, round to the dtype
            partial = partial + g.to(FORMATS[name])
        sums[f"summed in {name}"] = partial
    sums["exact sum, rounded once to bf16"] = exact.bfloat16()
    gaps = {how: relative_gap(total, exact) for how, total in sums.items()}
    return {"ranks": ranks, "gaps": gaps, "sums": sums, "exact": exact}


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    """``torch.set_float32_matmul_precision(precision)`` inside the block, the previous setting after it."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def precision_switches(precision: str) -> dict:
    """The backend switches that ``set_float32_matmul_precision(precision)`` turns, read back."""
    with float32_matmul_precision(precision):
        switches = {"torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32}
        # Convolutions are cuDNN's: TF32 by default, whatever the matmul setting says.
        switches["torch.backends.cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
        for backend in ("cuda", "mkldnn"):  # the per-backend settings of torch 2.9 and later
            matmul = getattr(getattr(torch.backends, backend), "matmul", None)
            if matmul is not None and hasattr(matmul, "fp32_precision"):
                switches[f"torch.backends.{backend}.matmul.fp32_precision"] = matmul.fp32_precision
    return switches


def matmul_precision(device_type: str = "cpu", size: int = 4096, repeats: int = 5) -> dict:
    """One fp32 matrix product under "highest" and "high", and the same product in bf16.

    For each: the fastest of ``repeats`` synchronised runs after a warm-up, and the relative
    gap to the product in float64. The product's dtype stays fp32 under every setting; only
    how the hardware computes it changes. The setting is restored afterwards.
    """
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device_type) for _ in range(2))
    exact = a.double() @ b.double()
    runs = {}
    for name, (x, y, precision) in {
        "fp32, highest": (a, b, "highest"),
        "fp32, high": (a, b, "high"),
        "bf16": (a.bfloat16(), b.bfloat16(), "highest"),
    }.items():
        with float32_matmul_precision(precision):
            out = x @ y
            seconds = best_of(lambda x=x, y=y: x @ y, repeats, device_type, warmup=1)
        runs[name] = {"seconds": seconds, "gap": relative_gap(out, exact), "dtype": out.dtype}
    return runs


def tf32_expectations(profile: gpus.GpuProfile | None) -> dict:
    """What the TF32 timing may assert on this GPU (``profile``; None on a CPU), from its data sheet.

    "tf32": "high" lets fp32 products use TF32 tensor cores (sm >= 80), so the three products
        differ in exactness in the order bf16, TF32, fp32;
    "bf16 faster": bf16 products beat TF32 ones (every part with bf16 tensor cores: 2x on paper);
    "min speedup": the fp32/TF32 time ratio to assert, or None. The ratio of dense peaks is a
        product decision (8x on an A100, 2x on an L4, 1x on an RTX 4090), and a measured ratio
        reaches only part of it, so a speed-up is asserted only where the data sheet promises
        at least ``gpus.CLEAR_TF32_SPEEDUP`` and then only half of that (2x).
    """
    ratio = gpus.tf32_speedup(profile)
    clear = ratio is not None and ratio >= gpus.CLEAR_TF32_SPEEDUP
    return {
        "tf32": profile is not None and profile.native_tf32,
        "bf16 faster": profile is not None and profile.native_bf16,
        "data sheet ratio": ratio,
        "min speedup": gpus.CLEAR_TF32_SPEEDUP / 2 if clear else None,
    }


def describe_tf32(profile: gpus.GpuProfile | None, expect: dict) -> str:
    """One sentence, before the timing runs: what it will show on this GPU and why."""
    if profile is None:
        return tr("No GPU: this cell only checks that the products stay fp32.")
    name, ratio = profile.key, expect["data sheet ratio"]
    if not expect["tf32"]:
        return tr('{gpu} has no TF32 tensor cores: "high" changes nothing there; bf16 is timed for comparison.').format(
            gpu=name
        )
    if expect["min speedup"]:
        return tr(
            "{gpu}: the data sheet's dense TF32/fp32 ratio is {ratio}, "
            "so the cell asserts TF32 at least {least}x faster."
        ).format(gpu=name, ratio=number(ratio, 1), least=number(expect["min speedup"], 0))
    sheet = number(ratio, 1) if ratio else tr("not known")
    return tr(
        "{gpu}: the data sheet's dense TF32/fp32 ratio is {ratio}; too small to assert a speed-up, so the cell "
        "only prints the measured ratio."
    ).format(gpu=name, ratio=sheet)


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
        print(
            tr("{precision}: loss {first} -> {last}, {ms} ms per step").format(
                precision=precision, first=number(losses[0], 4), last=number(losses[-1], 4), ms=number(seconds * 1e3, 2)
            )
        )
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
        grad = model[0].weight.grad
        record("sharded gradient", grad.dtype)
        if step == 0:  # reduced in bf16, then stored as fp32: every value is a bf16 number
            local = grad.to_local()
            bf16_exact = (local == local.bfloat16().float()).float().mean().item()
        optimizer.step()
        losses.append(global_mean(loss))
    return {"dtypes": seen, "losses": losses, "bf16-exact gradients": bf16_exact}


def fsdp_policies(policies: dict, steps: int = 5) -> dict:
    """Rank function: ``fsdp_policy`` for each ``{name: (param_dtype, reduce_dtype)}``, in one launch."""
    return {name: fsdp_policy(param, reduce, steps) for name, (param, reduce) in policies.items()}
