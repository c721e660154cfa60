"""``python -m distcourse doctor``, the torch range check and the setup cell that uses both."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import nbformat
import pytest
import torch

import headers
from distcourse.runtime import doctor, hardware, i18n, support
from distcourse.runtime.hardware import Hardware

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU = Hardware(cores=2)
T4 = Hardware(cores=2, gpus=1, gpu_bf16=False, gpu_names=("Tesla T4",), nccl_available=True)
H100S = Hardware(cores=32, gpus=2, gpu_bf16=True, gpu_names=("NVIDIA H100 80GB HBM3",) * 2)


@pytest.fixture
def quick(monkeypatch):
    """The checks that ask the system answer at once: a big /dev/shm, a working store, no fonts."""
    monkeypatch.setattr(doctor, "shm_bytes", lambda path=doctor.SHM: 8 * 2**30)
    monkeypatch.setattr(doctor, "loopback_store", lambda timeout=5.0: None)
    monkeypatch.setattr(doctor, "cjk_font", lambda: None)
    return monkeypatch


# ------------------------------------------------------------------ the supported range of torch


@pytest.mark.parametrize("version", ["2.9.1", "2.16.0", "2.10.0+cu128", "3.0.0", "nightly"])
def test_a_torch_outside_the_range_gets_one_sentence(version):
    sentence = support.torch_problem(version)
    assert sentence == (
        f"This course needs PyTorch 2.11 to 2.15; this kernel has {version}. "
        "Install a supported one, then restart the kernel: pip install 'torch>=2.11,<2.16'"
    )
    with pytest.raises(support.UnsupportedTorch) as raised:
        support.check_torch(version)
    assert raised.value._render_traceback_() == [sentence]  # what Jupyter shows instead of a traceback
    check = doctor.check_torch(version)
    assert check.ok is False and check.text == sentence


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.15.0", "2.15.3+cu130", "2.12.0a0+git1234"])
def test_a_torch_inside_the_range_passes(version):
    assert support.torch_problem(version) is None
    support.check_torch(version)
    assert doctor.check_torch(version).ok is True


def test_the_installed_torch_is_supported():
    support.check_torch()
    assert support.SUPPORTED_TORCH == ("2.11", "2.15") and support.pip_requirement() == "torch>=2.11,<2.16"


def test_the_sentence_follows_the_language():
    i18n.use("ru")
    try:
        sentence = support.torch_problem("2.9.1")
    finally:
        i18n.use("en")
    assert "2.9.1" in sentence and "torch>=2.11,<2.16" in sentence and "This course" not in sentence


# ------------------------------------------------------------------ the report


def test_report_on_a_cpu_machine(quick):
    text = doctor.report(doctor.checks(CPU))
    assert "2 CPU cores, no GPU." in text
    assert "2 ranks: gloo on the CPU, fp32, 1 thread(s) per rank." in text
    assert "4 ranks: gloo on the CPU, fp32, 1 thread(s) per rank." in text
    assert "Two torchrun agents here (one worker each): gloo on the CPU." in text
    assert "/dev/shm has 8 GB." in text and "--shm-size" not in text
    assert "fonts-noto-cjk" in text and "ranks can meet" in text


def test_report_on_two_h100s(quick):
    text = doctor.report(doctor.checks(H100S))
    assert "32 CPU cores, 2 × NVIDIA H100 80GB HBM3, with bf16." in text
    assert "2 ranks: nccl, one GPU per rank (cuda:0, cuda:1), bf16, 16 thread(s) per rank." in text
    assert "4 ranks: gloo on the CPU, fp32, 8 thread(s) per rank." in text  # more ranks than GPUs
    assert "nccl, one GPU each (CUDA_VISIBLE_DEVICES=0 and 1)" in text


def test_report_on_a_colab_t4(quick):
    text = doctor.report(doctor.checks(T4))
    assert "2 CPU cores, 1 × Tesla T4, without bf16." in text
    assert "2 ranks: gloo on the CPU, fp32" in text


def test_small_shm_is_a_problem_with_a_fix(quick):
    quick.setattr(doctor, "shm_bytes", lambda path=doctor.SHM: 64 * 2**20)  # Docker's default
    check = doctor.check_shm()
    assert check.ok is False and "64 MB" in check.text and "--shm-size=2g or --ipc=host" in check.text
    assert "/dev/shm only 64 MB: start the container with --shm-size=2g" in doctor.summary(CPU)
    quick.setattr(doctor, "shm_bytes", lambda path=doctor.SHM: None)  # macOS
    assert doctor.check_shm().ok is None


def test_a_store_that_cannot_listen_is_a_problem(quick):
    quick.setattr(doctor, "loopback_store", lambda timeout=5.0: "OSError: no loopback")
    check = doctor.check_store()
    assert check.ok is False and "no loopback" in check.text


def test_the_store_check_really_meets_a_client():
    assert doctor.loopback_store(timeout=10) is None


def test_shm_size_of_a_real_folder(tmp_path):
    assert doctor.shm_bytes(str(tmp_path)) > 0 and doctor.shm_bytes(str(tmp_path / "missing")) is None


def test_summary_is_one_line(quick):
    line = doctor.summary(CPU)
    build = f"torch {torch.__version__} ({doctor.torch_build()})"
    assert line == f"{build} · 2 cores, no GPU · 2 ranks: gloo on CPU, fp32 · /dev/shm 8 GB"
    assert "2 ranks: nccl, one GPU each, bf16" in doctor.summary(H100S)


def test_torchvision_pairing_comes_from_its_metadata():
    assert doctor._required_torch(["numpy", "torch (==2.13.0)", "pillow"]) == "2.13.0"
    assert doctor._required_torch(["torch==2.15.0; extra == 'x'"]) == "2.15.0"
    assert doctor._required_torch(["torchaudio"]) is None
    check = doctor.check_torchvision()[0]
    assert check.topic == "torchvision" and check.ok is not False


def test_doctor_never_initialises_cuda(quick):
    """Ranks are forked later: the doctor must not initialise CUDA, even on a GPU machine."""

    def initialises_cuda(*args, **kwargs):
        raise AssertionError("this initialises CUDA in the calling process")

    for name in ("is_available", "get_device_properties", "is_bf16_supported", "init", "current_device"):
        quick.setattr(torch.cuda, name, initialises_cuda)
    quick.setattr(torch.cuda, "device_count", lambda: 2)
    rows = tuple(hardware.SmiGpu(str(i), f"GPU-{i}", "NVIDIA A100", 8.0) for i in range(2))
    quick.setattr(hardware, "nvidia_smi_gpus", lambda: rows)
    quick.setattr(hardware.dist, "is_nccl_available", lambda: True)
    text = doctor.report(doctor.checks())
    assert "2 ranks: nccl, one GPU per rank (cuda:0, cuda:1), bf16" in text
    assert "2 × NVIDIA A100" in doctor.summary()
    assert not torch.cuda.is_initialized()


def test_python_m_distcourse_doctor():
    out = subprocess.run(
        [sys.executable, "-m", "distcourse", "doctor"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode in (0, 1), out.stderr  # 1: something on this machine needs fixing, said so
    assert "What this machine gives the course:" in out.stdout and "2 ranks:" in out.stdout
    assert f"PyTorch {torch.__version__}" in out.stdout
    usage = subprocess.run([sys.executable, "-m", "distcourse"], capture_output=True, text=True, cwd=ROOT)
    assert usage.returncode == 0 and "doctor" in usage.stdout


# ------------------------------------------------------------------ the setup cell


def test_every_setup_cell_checks_torch_and_prints_the_summary(tmp_path):
    (tmp_path / "chapters" / "en").mkdir(parents=True)
    shutil.copy(ROOT / "_config.yml", tmp_path)
    notebook = tmp_path / "chapters" / "en" / "01-dataloader-workers.ipynb"
    shutil.copy(ROOT / "chapters" / "en" / notebook.name, notebook)
    headers.update(notebook, tmp_path)
    setup = nbformat.read(notebook, as_version=4).cells[1].source
    assert setup == headers.setup_source(*headers.repository(tmp_path))
    lines = setup.splitlines()
    position = {
        key: next(i for i, line in enumerate(lines) if key in line)
        for key in ("import distcourse", "check_torch()", "doctor.summary()")
    }
    assert position["import distcourse"] < position["check_torch()"] < position["doctor.summary()"]


def _run_setup_cell(version: str | None) -> subprocess.CompletedProcess:
    """The setup cell in an IPython shell, as a notebook runs it (optionally with a fake torch version)."""
    cell = headers.setup_source(*headers.repository())
    fake = f"import torch; torch.__version__ = {version!r}\n" if version else ""
    script = (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        f"{fake}shell = InteractiveShell.instance()\n"
        f"result = shell.run_cell({cell!r})\n"
        "raise SystemExit(0 if result.success else 3)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT / "chapters" / "en", timeout=120
    )


def test_the_setup_cell_prints_the_summary():
    out = _run_setup_cell(None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"torch {torch.__version__} (" in out.stdout and "2 ranks: " in out.stdout


def test_the_setup_cell_stops_an_old_torch_with_one_sentence():
    out = _run_setup_cell("2.9.1")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "This course needs PyTorch 2.11 to 2.15; this kernel has 2.9.1." in out.stdout
    assert "Traceback" not in out.stdout + out.stderr and "2 ranks: " not in out.stdout
