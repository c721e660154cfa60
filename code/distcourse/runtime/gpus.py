"""What differs between GPUs, as data: one profile per GPU model, from NVIDIA's data sheets.

A cell that runs only on a GPU cannot decide what to expect from the compute capability alone:
whether TF32 is much faster than fp32 is a product decision (8x on an A100, 1x on an RTX 4090,
both sm >= 80), and which attention kernels take bf16 depends on the architecture. So the
decision is a function of a :class:`GpuProfile`, and a test on a laptop evaluates it on every
profile in :data:`PROFILES` by faking the CUDA queries.

Figures are the DENSE peaks, in TFLOP/s. Data sheets of Ampere and later data-centre parts print
the tensor-core rates "with sparsity" (marked with an asterisk): 2:4 structured sparsity doubles
them, and training does not use it, so every such figure here is the printed one divided by 2.
``None`` means the data sheet gives no figure (no such unit, or no data sheet at all).
fp16 and bf16 are the rates with fp32 accumulation, the mode PyTorch's matrix products use.

``current()`` asks ``torch.cuda`` and so initialises CUDA: call it in a GPU cell, never in code
that forks afterwards (see ``hardware``, which never does).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
BF16_CAPABILITY = (8, 0)  # bf16 and TF32 tensor cores arrived with Ampere (A100)
FP8_CAPABILITY = (8, 9)  # fp8 tensor cores arrived with Ada (sm89) and Hopper (sm90)
# Below this dense tf32/fp32 ratio, TF32's speed-up over fp32 is small enough (2x on paper for
# A10/L4/L40S, 1x on GeForce and L40) that a measured ratio can fall either side of any threshold.
CLEAR_TF32_SPEEDUP = 4.0


@dataclass(frozen=True)
class GpuProfile:
    key: str  # "A100-80GB-SXM", "T4", "H100-SXM", ...
    names: tuple[str, ...]  # matched as whole words in torch.cuda.get_device_name()
    capability: tuple[int, int]
    memory_gib: float  # as the data sheet prints it (GB)
    native_bf16: bool  # bf16 tensor cores
    native_tf32: bool
    native_fp8: bool
    peak_tflops: Mapping[str, float | None]  # dense peaks: fp32, tf32, bf16, fp16, fp8
    nvlink_gb_s: float | None  # per-GPU NVLink bandwidth; None for PCIe-only parts
    source: str  # data sheet URL for the figures


def _peaks(fp32=None, tf32=None, bf16=None, fp16=None, fp8=None) -> Mapping[str, float | None]:
    return MappingProxyType({"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8})


def _profile(key, names, capability, memory, peaks, nvlink, source) -> GpuProfile:
    """The native-unit flags follow from the capability (sm80: bf16/TF32, sm89: fp8)."""
    return GpuProfile(
        key=key,
        names=tuple(names),
        capability=capability,
        memory_gib=memory,
        native_bf16=capability >= BF16_CAPABILITY,
        native_tf32=capability >= BF16_CAPABILITY,
        native_fp8=capability >= FP8_CAPABILITY,
        peak_tflops=peaks,
        nvlink_gb_s=nvlink,
        source=source,
    )


# Compute capabilities: https://developer.nvidia.com/cuda-gpus
_ALL = (
    # Turing. No sparsity on this data sheet: 65 TFLOP/s is "mixed precision (FP16/FP32)".
    _profile(
        "T4",
        ["T4"],
        (7, 5),
        16,
        _peaks(fp32=8.1, fp16=65),
        None,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
    ),
    # Volta SXM2: "Tensor Performance 125 TFLOPS" is fp16 in, fp32 accumulate; no sparsity.
    _profile(
        "V100-SXM2-32GB",
        ["V100-SXM2-32GB"],
        (7, 0),
        32,
        _peaks(fp32=15.7, fp16=125),
        300,
        "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
    ),
    # An AWS-only variant of the A10 with its own clocks: NVIDIA publishes no data sheet for it, and
    # its rates differ from the A10's (31.2 / 62.5 / 125), so the peaks stay unknown here.
    _profile(
        "A10G",
        ["A10G"],
        (8, 6),
        24,
        _peaks(),
        None,
        "https://aws.amazon.com/ec2/instance-types/g5/ (memory; no NVIDIA data sheet for the A10G)",
    ),
    # Ada. Printed with sparsity: TF32 120*, FP16/BF16 242*, FP8 485*; dense = half.
    _profile(
        "L4",
        ["L4"],
        (8, 9),
        24,
        _peaks(fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5),
        None,
        "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet",
    ),
    # GeForce: no data sheet with tensor rates; the Ada architecture whitepaper (appendix A) prints
    # dense and sparse rates: FP32 82.6, TF32 82.6, FP16/BF16 with FP32 accumulate 165.2, FP8 with
    # FP32 accumulate 330.3 (GeForce runs FP32 accumulation at half the FP16-accumulate rate).
    _profile(
        "RTX-4090",
        ["GeForce RTX 4090"],
        (8, 9),
        24,
        _peaks(fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2, fp8=330.3),
        None,
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
    ),
    # Ampere. Printed: TF32 156 | 312*, BF16/FP16 312 | 624*: the first figure is dense.
    _profile(
        "A100-40GB-SXM",
        ["A100-SXM4-40GB"],
        (8, 0),
        40,
        _peaks(fp32=19.5, tf32=156, bf16=312, fp16=312),
        600,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    ),
    _profile(
        "A100-80GB-SXM",
        ["A100-SXM4-80GB"],
        (8, 0),
        80,
        _peaks(fp32=19.5, tf32=156, bf16=312, fp16=312),
        600,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    ),
    # Hopper SXM. Printed with sparsity: TF32 989*, BF16/FP16 1,979*, FP8 3,958*; dense = half.
    _profile(
        "H100-SXM",
        ["H100 80GB HBM3", "H100 SXM"],
        (9, 0),
        80,
        _peaks(fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979),
        900,
        "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
    ),
    # Same compute as H100 SXM, more and faster memory (141 GB HBM3e).
    _profile(
        "H200",
        ["H200"],
        (9, 0),
        141,
        _peaks(fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979),
        900,
        "https://www.nvidia.com/en-us/data-center/h200/ (specifications table)",
    ),
    # Ada. Printed with sparsity: TF32 366*, BF16/FP16 733*, FP8 1,466*; dense = half.
    _profile(
        "L40S",
        ["L40S"],
        (8, 9),
        48,
        _peaks(fp32=91.6, tf32=183, bf16=366.5, fp16=366.5, fp8=733),
        None,
        "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413",
    ),
    # Blackwell, HGX B200 per GPU. Printed with sparsity: TF32 2.2*, FP16/BF16 4.5*, FP8 9* PFLOP/s.
    _profile(
        "B200",
        ["B200"],
        (10, 0),
        180,
        _peaks(fp32=75, tf32=1100, bf16=2250, fp16=2250, fp8=4500),
        1800,
        "https://www.nvidia.com/en-us/data-center/hgx/",
    ),
)
PROFILES: dict[str, GpuProfile] = {p.key: p for p in _ALL}


def _matches(pattern: str, device_name: str) -> bool:
    """``pattern`` as whole words: "L4" matches "NVIDIA L4", not "NVIDIA L40S"."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])", device_name) is not None


def by_name(device_name: str) -> GpuProfile | None:
    """The profile whose name matches ``device_name`` (the longest match wins); None if none does."""
    hits = [(len(n), p) for p in _ALL for n in p.names if _matches(n, device_name)]
    return max(hits, key=lambda hit: hit[0])[1] if hits else None


def unknown(name: str, capability: tuple[int, int], memory_bytes: int) -> GpuProfile:
    """A GPU without a profile: what the capability implies, and no peaks."""
    return _profile(
        name,
        [name],
        tuple(capability),
        round(memory_bytes / 2**30, 1),
        _peaks(),
        None,
        "torch.cuda.get_device_properties (no data sheet figures for this GPU)",
    )


def current(device=None) -> GpuProfile | None:
    """The profile of this process's CUDA device; None without CUDA (initialises CUDA)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    known = by_name(name)
    if known is not None:
        return known
    props = torch.cuda.get_device_properties(device)
    return unknown(name, torch.cuda.get_device_capability(device), props.total_memory)


def training_precision(p: GpuProfile | None) -> str:
    """The precision to train in: "bf16" with bf16 tensor cores, "fp16" (with a gradient scaler)
    on an older GPU, "fp32" on a CPU.

    A T4 or V100 can store bf16 (``torch.cuda.is_bf16_supported()`` says True by emulation) but
    has no bf16 matrix units: there fp16 with a GradScaler is the fast path."""
    if p is None:
        return "fp32"
    return "bf16" if p.native_bf16 else "fp16"


_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def peak_tflops(p: GpuProfile | None, dtype) -> float | None:
    """Dense peak of ``p`` for ``dtype`` ("fp32", "tf32", "bf16", "fp16", "fp8" or a torch dtype)."""
    if p is None:
        return None
    key = _NAMES.get(dtype, dtype)
    if key not in DTYPES:
        raise ValueError(f"no peak for {dtype!r}; one of {DTYPES}")
    return p.peak_tflops.get(key)


def tf32_speedup(p: GpuProfile | None) -> float | None:
    """Dense tf32 / fp32 peak ratio from the data sheet (None when either is unknown)."""
    fp32, tf32 = peak_tflops(p, "fp32"), peak_tflops(p, "tf32")
    return tf32 / fp32 if fp32 and tf32 else None


def sdpa_kernels(p: GpuProfile | None, dtype: torch.dtype) -> frozenset[str]:
    """Which scaled_dot_product_attention back ends can take ``dtype`` on ``p``.

    The rules of ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: flash attention needs
    sm >= 80 and fp16/bf16; memory-efficient attention takes fp16/fp32 everywhere and bf16 only
    from sm80 (``less_than_sm80_mem_efficient_dtypes``); cuDNN attention needs sm >= 80 and
    fp16/bf16 (and a recent enough cuDNN, which this does not check). ``math`` always works.
    ``p=None`` (a CPU) gets the math kernel only."""
    kernels = {"math"}
    if p is None:
        return frozenset(kernels)
    ampere = p.capability >= BF16_CAPABILITY
    if dtype in (torch.float16, torch.float32) or (dtype == torch.bfloat16 and ampere):
        kernels.add("efficient")
    if ampere and dtype in (torch.float16, torch.bfloat16):
        kernels |= {"flash", "cudnn"}
    return frozenset(kernels)
