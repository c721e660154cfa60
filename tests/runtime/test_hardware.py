"""What a chapter says about the machine that produced its outputs."""

import torch

from distcourse.runtime import hardware

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
    assert hardware.gpu_names() == ["GPU", "GPU"]
    assert not torch.cuda.is_initialized()
