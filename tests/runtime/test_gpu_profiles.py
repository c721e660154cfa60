"""GPU profiles as data: every GPU-only decision of the course evaluated on every profile, on a CPU.

The CUDA queries are faked (monkeypatch), so ``gpus.current()`` returns what it would on a T4,
an A100 or an RTX 4090; the decisions the GPU-only cells of chapters 09 and 10 make are then
checked on each profile, and the decisions the cells made before are shown to fail.
"""

from __future__ import annotations

import types

import pytest
import torch

from distcourse.runtime import gpus, hardware
from distcourse.runtime.gpus import PROFILES

# What torch.cuda.get_device_name() answers on each profile's GPU.
DEVICE_NAMES = {
    "T4": "Tesla T4",
    "V100-SXM2-32GB": "Tesla V100-SXM2-32GB",
    "A10G": "NVIDIA A10G",
    "L4": "NVIDIA L4",
    "RTX-4090": "NVIDIA GeForce RTX 4090",
    "A100-40GB-SXM": "NVIDIA A100-SXM4-40GB",
    "A100-80GB-SXM": "NVIDIA A100-SXM4-80GB",
    "H100-SXM": "NVIDIA H100 80GB HBM3",
    "H200": "NVIDIA H200",
    "L40S": "NVIDIA L40S",
    "B200": "NVIDIA B200",
}


def fake_cuda(monkeypatch, name: str | None, capability=(8, 0), memory_gib: float = 40.0):
    """Make torch.cuda answer as a machine with this GPU (None: no CUDA at all)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    props = types.SimpleNamespace(
        name=name, total_memory=int(memory_gib * 2**30), major=capability[0], minor=capability[1]
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_every_required_gpu_has_a_profile():
    required = {"T4", "V100-SXM2-32GB", "A10G", "L4", "RTX-4090", "A100-40GB-SXM", "A100-80GB-SXM"}
    required |= {"H100-SXM", "H200", "L40S", "B200"}
    assert required <= set(PROFILES)
    assert set(DEVICE_NAMES) == set(PROFILES)


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_profile_is_consistent(key):
    p = PROFILES[key]
    assert p.key == key and p.source.startswith("http")
    assert set(p.peak_tflops) == set(gpus.DTYPES)
    assert p.native_bf16 == p.native_tf32 == (p.capability >= (8, 0))
    assert p.native_fp8 == (p.capability >= (8, 9))
    peaks = p.peak_tflops
    # No peak for a unit the GPU does not have; a tensor-core rate is never below the fp32 rate.
    for unit, native in (("bf16", p.native_bf16), ("tf32", p.native_tf32), ("fp8", p.native_fp8)):
        if not native:
            assert peaks[unit] is None, (key, unit)
    for unit in ("tf32", "bf16", "fp16", "fp8"):
        if peaks[unit] is not None:
            assert peaks[unit] >= peaks["fp32"], (key, unit)


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_current_finds_the_profile_by_device_name(monkeypatch, key):
    p = PROFILES[key]
    fake_cuda(monkeypatch, DEVICE_NAMES[key], p.capability, p.memory_gib)
    assert gpus.current() is p


def test_similar_names_do_not_collide():
    assert gpus.by_name("NVIDIA L40S").key == "L40S"
    assert gpus.by_name("NVIDIA L40") is None  # not an L4
    assert gpus.by_name("NVIDIA A100-SXM4-40GB").key == "A100-40GB-SXM"
    assert gpus.by_name("NVIDIA H100 PCIe") is None  # other clocks than the SXM part


def test_current_without_cuda_is_none(monkeypatch):
    fake_cuda(monkeypatch, None)
    assert gpus.current() is None
    assert gpus.training_precision(None) == "fp32"
    assert gpus.peak_tflops(None, "bf16") is None
    assert gpus.tf32_speedup(None) is None


def test_unknown_gpu_gets_a_profile_from_its_capability(monkeypatch):
    fake_cuda(monkeypatch, "NVIDIA RTX A6000", capability=(8, 6), memory_gib=48)
    p = gpus.current()
    assert p.key == "NVIDIA RTX A6000" and p.capability == (8, 6)
    assert p.memory_gib == pytest.approx(48, abs=0.1)
    assert p.native_bf16 and p.native_tf32 and not p.native_fp8
    assert all(v is None for v in p.peak_tflops.values())
    assert gpus.tf32_speedup(p) is None and gpus.training_precision(p) == "bf16"
    fake_cuda(monkeypatch, "Quadro RTX 8000", capability=(7, 5), memory_gib=48)
    assert gpus.training_precision(gpus.current()) == "fp16"


@pytest.mark.parametrize(
    "key, precision",
    [("T4", "fp16"), ("V100-SXM2-32GB", "fp16")]
    + [
        (k, "bf16")
        for k in ("A10G", "L4", "RTX-4090", "A100-40GB-SXM", "A100-80GB-SXM", "H100-SXM", "H200", "L40S", "B200")
    ],
)
def test_training_precision(key, precision):
    assert gpus.training_precision(PROFILES[key]) == precision


def test_peaks_from_the_data_sheets():
    a100, h100, t4 = PROFILES["A100-80GB-SXM"], PROFILES["H100-SXM"], PROFILES["T4"]
    assert gpus.peak_tflops(a100, "tf32") == 156 and gpus.peak_tflops(a100, torch.bfloat16) == 312
    assert gpus.peak_tflops(h100, "bf16") == pytest.approx(1979 / 2)  # printed with sparsity
    assert gpus.peak_tflops(h100, torch.float32) == 67
    assert gpus.peak_tflops(t4, "bf16") is None and gpus.peak_tflops(t4, torch.float16) == 65
    assert gpus.tf32_speedup(a100) == pytest.approx(8.0, rel=0.01)
    assert gpus.tf32_speedup(PROFILES["RTX-4090"]) == pytest.approx(1.0)
    assert gpus.tf32_speedup(PROFILES["L4"]) == pytest.approx(2.0, rel=0.02)
    assert gpus.tf32_speedup(t4) is None
    with pytest.raises(ValueError):
        gpus.peak_tflops(a100, "int8")


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_sdpa_kernels(key):
    p = PROFILES[key]
    bf16, fp16, fp32 = (gpus.sdpa_kernels(p, d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert "math" in bf16 and "math" in fp16 and "math" in fp32
    assert "flash" not in fp32 and "efficient" in fp32 and "efficient" in fp16
    if p.capability < (8, 0):
        assert "flash" not in fp16 and "flash" not in bf16
        assert "efficient" not in bf16  # mem-efficient attention takes half/float below sm80
    else:
        assert {"flash", "efficient"} <= bf16 and {"flash", "efficient"} <= fp16
    assert gpus.sdpa_kernels(None, torch.bfloat16) == {"math"}


@pytest.mark.parametrize(
    "name, capability, bf16",
    [("Tesla T4", 7.5, False), ("Tesla V100-SXM2-32GB", 7.0, False), ("NVIDIA A100-SXM4-80GB", 8.0, True)]
    + [("NVIDIA GeForce RTX 4090", 8.9, True), ("NVIDIA H100 80GB HBM3", 9.0, True)]
    + [("NVIDIA RTX A6000", 8.6, True), ("Quadro RTX 8000", 7.5, False), ("GPU", None, False)],
)
def test_hardware_bf16_agrees_with_the_profiles(name, capability, bf16):
    row = hardware.SmiGpu("0", "GPU-0", name, capability)
    assert hardware._bf16([row]) is bf16
    known = gpus.by_name(name)
    if known is not None:
        assert known.native_bf16 is bf16 and gpus.training_precision(known) == ("bf16" if bf16 else "fp16")


# ------------------------------------------------------------------ the GPU-only cells' decisions
# Each decision below is what a GPU-only cell of chapter 09 or 10 computes before it runs; here it
# is evaluated on every profile, with the CUDA queries faked so that gpus.current() finds it.

SPEED_MARGIN = 2.0  # a measured time ratio reaches only part of the peak ratio: assert at most half of it


def old_tf32_decision(p):
    """Chapter 09 before: a 2x TF32 speed-up asserted on every sm >= 80 GPU."""
    return 2.0 if p.capability >= (8, 0) else None


def old_cp_dtype(p):
    """Chapter 10 before: bf16 with flash or memory-efficient attention, whatever the GPU."""
    return "bf16"


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_tf32_cell_asserts_only_what_the_data_sheet_promises(monkeypatch, key):
    from distcourse import mixed_precision

    p = PROFILES[key]
    fake_cuda(monkeypatch, DEVICE_NAMES[key], p.capability, p.memory_gib)
    expect = mixed_precision.tf32_expectations(gpus.current())
    ratio = gpus.tf32_speedup(p)
    if expect["min speedup"] is not None:  # a speed-up is asserted: the data sheet must leave room for it
        assert ratio >= gpus.CLEAR_TF32_SPEEDUP and expect["min speedup"] * SPEED_MARGIN <= ratio
    if key in ("A100-40GB-SXM", "A100-80GB-SXM", "H100-SXM", "H200", "B200"):
        assert expect["min speedup"] == 2.0  # the A100/H100 class: 7-8x on paper, 2x asserted
    else:  # RTX 4090 (1x), L4 / L40S (2x), A10G (unknown), T4 / V100 (no TF32): nothing about speed
        assert expect["min speedup"] is None
    assert expect["tf32"] == expect["bf16 faster"] == (p.capability >= (8, 0))
    text = mixed_precision.describe_tf32(p, expect)  # printed before the cell runs
    assert p.key in text


def test_old_tf32_decision_fails_on_one_to_one_parts():
    bad = {
        k
        for k, p in PROFILES.items()
        if old_tf32_decision(p) and old_tf32_decision(p) * SPEED_MARGIN > (gpus.tf32_speedup(p) or 0)
    }
    assert {"RTX-4090", "L4", "L40S", "A10G"} <= bad  # asserted 2x where the data sheet gives 1x, 2x or nothing
    assert not {"A100-80GB-SXM", "H100-SXM"} & bad


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_cp_cell_picks_a_dtype_some_kernel_takes(monkeypatch, key):
    from distcourse import tensor_parallel as tp

    p = PROFILES[key]
    fake_cuda(monkeypatch, DEVICE_NAMES[key], p.capability, p.memory_gib)
    dtype = tp.cp_dtype(gpus.current())
    assert dtype == ("bf16" if p.capability >= (8, 0) else "fp16")
    kernels = tp.cp_kernels(p, dtype)
    assert kernels and set(kernels) <= gpus.sdpa_kernels(p, tp.CP_DTYPES[dtype]) & {"flash", "efficient"}
    assert p.key in tp.describe_cp(p, dtype)


def test_old_cp_decision_fails_below_sm80():
    from distcourse import tensor_parallel as tp

    for key in ("T4", "V100-SXM2-32GB"):  # Kaggle's 2 x T4, V100 nodes: "No available kernel"
        p = PROFILES[key]
        assert not gpus.sdpa_kernels(p, tp.CP_DTYPES[old_cp_dtype(p)]) & {"flash", "efficient"}
    assert tp.cp_dtype(None) is None and tp.cp_kernels(None, "bf16") == ()


@pytest.mark.parametrize("gpu_count, world", [(0, None), (1, 1), (2, 2), (8, 2)])
def test_memory_cell_compares_at_world_size_two_when_it_can(gpu_count, world):
    from distcourse import activations

    check = activations.memory_check(gpu_count)
    assert check["world size"] == world and check["compare"] == "active" and check["tolerance"] == 0.1


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_memory_cell_fits_on_every_profile(key):
    """The GPU cell's model (section 9's `larger`) at world size 1 fits every profile, with room."""
    from distcourse import activations

    calc = activations.calculator(
        layers=4, hidden=1024, heads=16, batch=8, seq=512, ranks=1, stage=3, abytes=4, flash=False
    )
    assert 4 * calc["total"] < PROFILES[key].memory_gib * 1e9
