"""What a chapter says about the machine that produced its outputs."""

import torch

from distcourse.runtime import hardware
from distcourse.runtime.hardware import Hardware

TEXT, CPU = "PyTorch {torch} on {device}.", "a CPU with {cores} cores"


def test_run_summary_names_the_cpu_without_gpus(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_names", lambda: [])
    monkeypatch.setattr(hardware, "cpu_cores", lambda: 6)
    assert hardware.run_summary(TEXT, CPU) == f"PyTorch {torch.__version__} on a CPU with 6 cores."


def test_run_summary_counts_gpus_by_name(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_names", lambda: ["NVIDIA H100", "NVIDIA H100", "NVIDIA A10"])
    assert hardware.run_summary(TEXT, CPU) == f"PyTorch {torch.__version__} on 2 × NVIDIA H100, 1 × NVIDIA A10."


def test_gpu_names_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_count", lambda: 2)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi to ask: placeholders, no CUDA context
    hardware.nvidia_smi_gpus.cache_clear()  # what an earlier test (or this machine's nvidia-smi) answered
    try:
        assert hardware.gpu_names() == ["GPU", "GPU"]
        assert not Hardware.detect().gpu_bf16  # unknown compute capability: no bf16 promised
    finally:
        hardware.nvidia_smi_gpus.cache_clear()
    assert not torch.cuda.is_initialized()


def test_gpu_count_asks_nvml_not_the_cuda_runtime(monkeypatch):
    """torch.cuda.is_available() initialises the CUDA driver, after which forked processes
    (DataLoader workers) cannot use CUDA; device_count() goes through NVML."""

    def poisons_fork():
        raise AssertionError("torch.cuda.is_available() would initialise CUDA in this process")

    monkeypatch.setattr(torch.cuda, "is_available", poisons_fork)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert hardware.gpu_count() == 3


def test_describe_is_unchanged_for_the_launchers_line():
    p = hardware.plan(2, hardware=Hardware(cores=4))
    assert p.describe() == "2 ranks, backend gloo on CPU, 2 intra-op threads per rank (4 cores, 0 GPUs)"
    assert (
        hardware.plan(1, hardware=Hardware(cores=1))
        .describe()
        .startswith("1 rank, backend gloo on CPU, 1 intra-op thread ")
    )
