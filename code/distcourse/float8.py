"""Float8, chapter 09: what a cast to 8 bits keeps, with one scale per tensor or per row.

A float8 number has 8 bits: ``float8_e4m3fn`` keeps 3 mantissa bits (relative rounding error at
most 2^-4) and reaches 448; ``float8_e5m2`` keeps 2 (2^-3) and reaches 57344. Neither holds
activations as they come, so each tensor is multiplied by a **scale** that brings its largest
magnitude (its *amax*) near the format's maximum, cast, and divided by the scale again after the
matrix product. One scale per tensor ("tensorwise") or one per row ("rowwise"):

- ``quantize``: the round trip bf16 -> float8 -> float32, with power-of-two scales (the
  multiplication is then exact, so every error is the cast's own);
- ``error_bound``: what the format allows for each element, from its mantissa bits and its
  smallest subnormal, never from a measurement;
- ``outlier_activations`` and ``compare``: a tensor whose few outlier rows set the tensorwise
  scale for all the others, and the error of every other row under both granularities;
- ``recipes``: which torchao recipes a GPU runs, as a function of its profile (``runtime.gpus``);
- ``float8_linear``: torchao's ``convert_to_float8_training`` on one Linear, on a GPU with
  float8 tensor cores, against bf16 and a derived bound.
"""

from __future__ import annotations

import math

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRANULARITIES = ("tensorwise", "rowwise")
RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name names
FP8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm89) and Hopper (sm90) onward


def format_facts(dtype: torch.dtype) -> dict:
    """The numbers of a float format that bound its rounding, read from ``torch.finfo``.

    ``rel``: the largest relative error of rounding a normal number, half an ulp, 2^-(m+1) for
    m mantissa bits. ``half_subnormal``: the largest absolute error below the smallest normal
    (half the smallest subnormal, ``tiny * eps / 2``); anything smaller rounds to zero.
    """
    info = torch.finfo(dtype)
    return {
        "max": info.max,
        "mantissa bits": round(-math.log2(info.eps)),
        "rel": info.eps / 2,
        "smallest normal": info.tiny,
        "half_subnormal": info.tiny * info.eps / 2,
    }


def amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """The largest magnitude per tensor (a 1x1 tensor) or per row (a column of them)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    a = x.float().abs()
    return a.amax().reshape(1, 1) if granularity == "tensorwise" else a.amax(dim=-1, keepdim=True)


def scale_for(largest: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest power of two that keeps ``largest * scale`` within the format's maximum
    (torchao's rowwise recipe rounds its scales to powers of two as well)."""
    return torch.exp2(torch.floor(torch.log2(format_facts(dtype)["max"] / largest.clamp(min=1e-30))))


def quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Round trip: scale, cast to ``dtype``, cast back to float32, unscale. Returns (values, scale)."""
    scale = scale_for(amax(x, granularity), dtype)
    limit = format_facts(dtype)["max"]
    stored = (x.float() * scale).clamp(-limit, limit).to(dtype)  # what 8 bits per element keep
    return stored.float() / scale, scale


def error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element, the most a cast with ``scale`` may change ``x``: half an ulp of a normal
    number, or half the smallest subnormal (unscaled) below the normal range. Scales are powers
    of two, so multiplying and dividing by them adds no rounding of its own."""
    facts = format_facts(dtype)
    return facts["rel"] * x.float().abs() + facts["half_subnormal"] / scale


def outlier_activations(outlier: float, rows: int = 16, cols: int = 256, outlier_rows=(3, 11), seed: int = 0):
    """bf16 activations of unit scale, and ``outlier_rows`` holding a few values of ``outlier``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    for r in outlier_rows:
        x[r, :4] = outlier * torch.tensor([1.0, -1.0, 0.5, -0.5])
    return x.to(torch.bfloat16), [r for r in range(rows) if r not in outlier_rows]


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


def neighbour_errors(x: torch.Tensor, others: list[int], dtype: torch.dtype, granularity: str) -> dict:
    """The cast's error on the rows that are not outliers, measured and bounded.

    ``bound``: the norm of ``error_bound`` over those rows, relative to theirs: an upper bound of
    ``error``. ``flushed``: the part of those rows that must round to zero (below half the
    smallest subnormal after scaling), relative to their norm: a lower bound of ``error``.
    """
    approx, scale = quantize(x, dtype, granularity)
    exact = x.float()
    bound = error_bound(x, scale, dtype).expand_as(exact)
    rows_scale = scale.expand(exact.shape[0], 1)[others]
    kept = exact[others]
    lost = kept * ((kept.abs() * rows_scale) < format_facts(dtype)["half_subnormal"])
    return {
        "error": relative_error(approx[others], kept),
        "bound": (bound[others].norm() / kept.norm()).item(),
        "flushed": (lost.norm() / kept.norm()).item(),
        "within bound everywhere": bool(((approx - exact).abs() <= bound).all()),
        "zeros": int((approx[others] == 0).sum()),
    }


def compare(outliers=(2.0**6, 2.0**12, 2.0**18)) -> dict:
    """``neighbour_errors`` for every outlier size, format and granularity: {(outlier, format, granularity): ...}."""
    table = {}
    for outlier in outliers:
        x, others = outlier_activations(outlier)
        for name, dtype in FORMATS.items():
            for granularity in GRANULARITIES:
                table[(outlier, name, granularity)] = neighbour_errors(x, others, dtype, granularity)
    return table


def recipes(profile) -> tuple[str, ...]:
    """The torchao float8 recipes a GPU can run: both on float8 tensor cores (sm >= 8.9), none
    elsewhere. ``profile``: a ``runtime.gpus.GpuProfile`` or None (no GPU)."""
    if profile is None or not profile.native_fp8:
        return ()
    return RECIPES


def linear_bound(x: torch.Tensor, w: torch.Tensor, dtype=torch.float8_e4m3fn, accumulate_rel: float = 2.0**-10):
    """Per output element, the most a float8 ``x @ w.T`` (both operands cast to ``dtype``,
    accumulated by the GPU, stored in bf16) may differ from the bf16 product.

    Each operand's cast error is bounded with one scale per tensor (a row's scale is at least
    the tensor's, so the bound covers rowwise scaling too); torchao's scales ``max / amax`` need
    not be powers of two (2 more fp32 roundings; rounded down to one, at most a factor 2).
    ``accumulate_rel``: relative error of the GPU's accumulation, taken large (float8 "fast
    accumulation" keeps fewer bits than fp32) and counted once per term of the sum: the worst case.
    """
    facts, bf16 = format_facts(dtype), format_facts(torch.bfloat16)
    u32 = torch.finfo(torch.float32).eps / 2
    x, w = x.float(), w.float()

    def cast_error(t):
        return (facts["rel"] + 2 * u32) * t.abs() + 2 * facts["half_subnormal"] * t.abs().amax() / facts["max"]

    ex, ew = cast_error(x), cast_error(w)
    product = ex @ w.abs().T + x.abs() @ ew.T + ex @ ew.T  # |x^ w^ - x w| term by term
    magnitude = (x.abs() + ex) @ (w.abs() + ew).T  # at least the sum of |x^| |w^|
    accumulation = x.shape[-1] * (accumulate_rel * magnitude + u32 * (x.abs() @ w.abs().T))
    stored = bf16["rel"] * (magnitude + (x @ w.T).abs())  # both results rounded to bf16
    return product + accumulation + stored


def float8_linear(recipe: str, device: str = "cuda", emulate: bool = False) -> dict:
    """torchao's float8 training on one bf16 Linear (512 -> 256): forward against bf16, and a backward.

    ``convert_to_float8_training`` swaps ``nn.Linear`` for ``Float8Linear``, which casts its
    input and weight to float8 with fresh scales at every call and multiplies them with
    ``torch._scaled_mm``; the parameters stay in their own dtype. ``emulate=True`` (torchao's
    option) multiplies in high precision instead, which also runs on a CPU: the tests use it.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    generator = torch.Generator().manual_seed(0)
    reference = torch.nn.Linear(512, 256, bias=False)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(256, 512, generator=generator) / 512**0.5)
    reference = reference.to(device, torch.bfloat16)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256, bias=False)).to(device, torch.bfloat16)
    model[0].load_state_dict(reference.state_dict())
    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    convert_to_float8_training(model, config=config)
    x, _ = outlier_activations(2.0**6, rows=64, cols=512)
    x = x.to(device).requires_grad_()
    y8, y = model(x), reference(x)
    bound = linear_bound(x.detach(), reference.weight.detach())
    y8.float().pow(2).mean().backward()
    return {
        "module": type(model[0]).__name__,
        "weight dtype": str(model[0].weight.dtype),
        "relative gap": relative_error(y8.detach().float(), y.detach().float()),
        "within bound": bool(((y8.detach().float() - y.detach().float()).abs() <= bound).all()),
        "grads finite": bool(torch.isfinite(model[0].weight.grad).all() and torch.isfinite(x.grad).all()),
    }


def float8_on_this_gpu() -> dict:
    """Rank function (one rank, one GPU): this GPU's profile, the recipes it runs, and
    ``float8_linear`` for each. Runs in a rank so that the notebook's own process never
    initialises CUDA. Without torchao installed, says what to install instead of failing."""
    from .runtime import gpus
    from .runtime.hardware import rank_device

    profile = gpus.current()
    chosen = recipes(profile)
    result = {"gpu": None if profile is None else profile.key, "recipes": chosen, "runs": {}, "missing": None}
    if result["gpu"] is not None:
        result["capability"] = profile.capability
    try:
        import torchao  # noqa: F401
    except ImportError:
        result["missing"] = "pip install torchao==0.18.0"
        return result
    result["runs"] = {recipe: float8_linear(recipe, device=str(rank_device())) for recipe in chosen}
    return result
