"""What this machine gives the course: ``python -m distcourse doctor``.

Checks what decides whether the chapters run here, and how: torch and torchvision (and
whether they pair), the range of torch releases the course supports, CPU or CUDA build,
GPUs and bf16, what a 2- and a 4-rank launch will use, the size of ``/dev/shm``, a TCP
store on 127.0.0.1, fonts for Chinese and Korean figures, Colab. :func:`summary` is the
one line every chapter's setup cell prints.

Nothing here creates a CUDA context (ranks are forked from this process later, and a
forked child of a process that initialised CUDA cannot use it): the hardware comes from
:meth:`Hardware.detect`, which counts GPUs through NVML and asks ``nvidia-smi`` the rest.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import os
import re
import socket
from dataclasses import dataclass

import torch

from . import hardware, support
from .i18n import number, pad, tr

SHM = "/dev/shm"
# Docker gives a container 64 MB of /dev/shm. DataLoader workers pass every batch through it
# and NCCL its buffers between GPUs of one machine; below about 1 GB both fail (bus errors).
SHM_ENOUGH = 2**30
LAUNCHES = (2, 4)  # the world sizes the chapters launch most


@dataclass(frozen=True)
class Check:
    """One line of the report. ok: True fine, False a problem to fix, None for information."""

    topic: str
    ok: bool | None
    text: str

    def line(self) -> str:
        mark = {True: "ok", False: "!!", None: "--"}[self.ok]
        return f"[{mark}] {pad(_topic(self.topic), 12)} {self.text}"


def _topic(topic: str) -> str:
    """A topic as the report shows it: words in the reader's language, names as they are."""
    words = {"devices": tr("devices"), "two nodes": tr("two nodes"), "fonts": tr("fonts")}
    return words.get(topic, topic)


def _size(n: int) -> str:
    """Bytes as Docker's --shm-size writes them: "64 MB", "2 GB", "12.5 GB" (numbers the reader's way)."""
    if n >= 2**30:
        return tr("{size} GB").format(size=number(round(n / 2**30, 1)))
    return tr("{size} MB").format(size=number(n // 2**20))


def torch_build() -> str:
    """What this torch was compiled for: "CPU build", "CUDA 13.0 build" or "ROCm 7.1 build"."""
    if torch.version.cuda:
        return tr("CUDA {cuda} build").format(cuda=torch.version.cuda)
    if torch.version.hip:
        return tr("ROCm {hip} build").format(hip=torch.version.hip)
    return tr("CPU build")


def check_torch(version: str | None = None) -> Check:
    version = torch.__version__ if version is None else version
    problem = support.torch_problem(version)
    if problem:
        return Check("torch", False, problem)
    low, high = support.SUPPORTED_TORCH
    text = tr("PyTorch {version} ({build}), inside the range this course supports ({low} to {high}).")
    return Check("torch", True, text.format(version=version, build=torch_build(), low=low, high=high))


def _required_torch(requires: list[str]) -> str | None:
    """The torch version a torchvision wheel was built for: its ``Requires-Dist: torch==X``."""
    for line in requires:
        found = re.match(r"torch\s*\(?\s*==\s*([\w.+]+)", line)
        if found:
            return found.group(1)
    return None


def check_torchvision(import_it: bool = False) -> list[Check]:
    """Whether torchvision's release is the one built for this torch; with ``import_it``, also
    what importing it does (see vision_compat: a CPU torch next to a CUDA torchvision)."""
    try:
        dist = importlib.metadata.distribution("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return [
            Check(
                "torchvision",
                None,
                tr("torchvision is not installed; only the CIFAR-10 example of chapter 01 needs it."),
            )
        ]
    required = _required_torch(dist.requires or [])
    have = torch.__version__.split("+")[0]
    if required is None or required.split("+")[0] == have:
        text = tr("torchvision {version}, built for torch {required}: it pairs with this torch.")
        checks = [Check("torchvision", True, text.format(version=dist.version, required=required or have))]
    else:
        text = tr(
            "torchvision {version} was built for torch {required}, this kernel has {torch}. "
            "Install the two together: pip install torch torchvision"
        )
        checks = [Check("torchvision", False, text.format(version=dist.version, required=required, torch=have))]
    if import_it:
        checks.append(_import_torchvision())
    return checks


def _import_torchvision() -> Check:
    """What ``import torchvision`` does here: vision_compat stands in when its operators cannot load."""
    from . import vision_compat

    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # a broken install: report it, the other checks still run
        return Check("torchvision", False, tr("import torchvision failed: {error}").format(error=f"{exc}"[:200]))
    if vision_compat.fallback_defined():
        text = tr(
            "torchvision's compiled operators do not load with this torch build; the course's CPU "
            "replacement stands in (models, transforms and datasets work, torchvision.ops and torchvision.io "
            "do not). Matching builds: pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
        )
        return Check("torchvision", None, text)
    return Check("torchvision", True, tr("import torchvision: its own compiled operators loaded."))


def check_devices(hw: hardware.Hardware) -> Check:
    if not hw.gpus:
        return Check("devices", None, tr("{cores} CPU cores, no GPU.").format(cores=hw.cores))
    counts = {name: hw.gpu_names.count(name) for name in dict.fromkeys(hw.gpu_names)}
    gpus = ", ".join(f"{n} × {name}" for name, n in counts.items())
    if hw.gpu_bf16:
        text = tr("{cores} CPU cores, {gpus}, with bf16.")
    else:  # a T4 or older: automatic precision stays fp32
        text = tr("{cores} CPU cores, {gpus}, without bf16.")
    return Check("devices", True, text.format(cores=hw.cores, gpus=gpus))


def check_launch(world_size: int, hw: hardware.Hardware) -> Check:
    p = hardware.plan(world_size, hardware=hw)
    if p.device_type == "cuda":
        text = tr("{n} ranks: {backend}, one GPU per rank ({devices}), {precision}, {threads} thread(s) per rank.")
    else:
        text = tr("{n} ranks: {backend} on the CPU, {precision}, {threads} thread(s) per rank.")
    values = {"n": world_size, "backend": p.backend, "precision": p.precision, "threads": p.threads}
    return Check("launch", None, text.format(devices=", ".join(p.devices), **values))


def check_two_nodes(hw: hardware.Hardware) -> Check:
    """The course's "two nodes on one machine": two torchrun agents, one worker each."""
    agents = [hardware.node_plan(hw, 2, 1, rank) for rank in range(2)]
    if agents[0].backend == "nccl":
        text = tr("Two torchrun agents here (one worker each): nccl, one GPU each (CUDA_VISIBLE_DEVICES={a} and {b}).")
        return Check("two nodes", None, text.format(a=agents[0].visible_devices, b=agents[1].visible_devices))
    return Check("two nodes", None, tr("Two torchrun agents here (one worker each): gloo on the CPU."))


def shm_bytes(path: str = SHM) -> int | None:
    """Size of the shared-memory file system; None where there is none (macOS)."""
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return stat.f_frsize * stat.f_blocks


def check_shm() -> Check:
    size = shm_bytes()
    if size is None:
        return Check("/dev/shm", None, tr("No /dev/shm on this system."))
    if size < SHM_ENOUGH:
        text = tr(
            "/dev/shm has only {size}: DataLoader workers and NCCL need more. "
            "Start the container with --shm-size=2g or --ipc=host."
        )
        return Check("/dev/shm", False, text.format(size=_size(size)))
    return Check("/dev/shm", True, tr("/dev/shm has {size}.").format(size=_size(size)))


def loopback_store(timeout: float = 5.0) -> str | None:
    """Start a TCP store on 127.0.0.1 (a port the OS picks) and talk to it from a client, as
    ranks do when they meet; None when that works, else what went wrong."""
    import torch.distributed as dist

    if not dist.is_available():
        return tr("torch.distributed is not available in this build")
    wait = datetime.timedelta(seconds=timeout)
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # loopback only, never every interface
        sock.listen(8)
        port = sock.getsockname()[1]
        server = dist.TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=wait, master_listen_fd=sock.detach()
        )
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
        client.set("doctor", "ok")
        answer = server.get("doctor")
        del client, server
    except Exception as exc:  # any failure is the answer: ranks could not meet here either
        return f"{type(exc).__name__}: {exc}"
    return None if answer == b"ok" else tr("the store answered {answer}").format(answer=repr(answer))


def check_store() -> Check:
    error = loopback_store()
    if error is None:
        return Check("TCP store", True, tr("A TCP store on 127.0.0.1 answers: ranks can meet."))
    text = tr("No TCP store on 127.0.0.1 ({error}): ranks cannot meet. Is the loopback interface up?")
    return Check("TCP store", False, text.format(error=error))


def cjk_font() -> str | None:
    """An installed font that draws Chinese and Korean figure text, or None."""
    from . import i18n

    return next((font for code in i18n.CJK_FONTS if (font := i18n.cjk_font(code, install=False))), None)


def check_fonts() -> Check:
    font = cjk_font()
    if font:
        return Check("fonts", True, tr("Chinese and Korean figures use the font {font}.").format(font=font))
    text = tr(
        "No Chinese or Korean font: those figures keep their English text. "
        "Install one with apt-get install fonts-noto-cjk (Debian, Ubuntu, Colab)."
    )
    return Check("fonts", None, text)


def in_colab() -> bool:
    try:
        return importlib.util.find_spec("google.colab") is not None
    except (ImportError, ValueError):  # no "google" package at all
        return False


def check_colab() -> Check:
    return Check("Colab", None, tr("Running in Google Colab.") if in_colab() else tr("Not running in Google Colab."))


def checks(hw: hardware.Hardware | None = None, import_torchvision: bool = False) -> list[Check]:
    """Every check, in the order of the report (``hw``: the machine, ``Hardware.detect()`` by default)."""
    hw = hardware.Hardware.detect() if hw is None else hw
    found = [check_torch(), *check_torchvision(import_torchvision), check_devices(hw)]
    found += [check_launch(n, hw) for n in LAUNCHES]
    return found + [check_two_nodes(hw), check_shm(), check_store(), check_fonts(), check_colab()]


def report(found: list[Check] | None = None) -> str:
    """The report ``python -m distcourse doctor`` prints (of ``checks()`` unless given)."""
    found = checks() if found is None else found
    return "\n".join([tr("What this machine gives the course:")] + [c.line() for c in found])


def summary(hw: hardware.Hardware | None = None) -> str:
    """One line for a chapter's setup cell, e.g.
    "torch 2.13.0+cpu (CPU build) · 2 cores, no GPU · 2 ranks: gloo on CPU, fp32 · /dev/shm 12 GB"."""
    hw = hardware.Hardware.detect() if hw is None else hw
    if hw.gpus:
        names = ", ".join(f"{hw.gpu_names.count(n)} × {n}" for n in dict.fromkeys(hw.gpu_names))
        machine = tr("{cores} cores, {gpus}").format(cores=hw.cores, gpus=names)
    else:
        machine = tr("{cores} cores, no GPU").format(cores=hw.cores)
    p = hardware.plan(2, hardware=hw)
    if p.device_type == "cuda":
        ranks = tr("2 ranks: {backend}, one GPU each, {precision}")
    else:
        ranks = tr("2 ranks: {backend} on CPU, {precision}")
    ranks = ranks.format(backend=p.backend, precision=p.precision)
    parts = [f"torch {torch.__version__} ({torch_build()})", machine, ranks]
    size = shm_bytes()
    if size is not None and size < SHM_ENOUGH:
        parts.append(tr("/dev/shm only {size}: start the container with --shm-size=2g").format(size=_size(size)))
    elif size is not None:
        parts.append(f"/dev/shm {_size(size)}")
    return " · ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m distcourse doctor``: print the report; exit status 1 if something needs fixing."""
    import argparse

    from . import i18n

    parser = argparse.ArgumentParser(prog="python -m distcourse doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--lang", default=os.environ.get("DISTCOURSE_LANG", "en"), help="language of the report")
    parser.add_argument("--summary", action="store_true", help="only the one line of the setup cell")
    args = parser.parse_args(argv)
    i18n.use(args.lang)
    if args.summary:
        print(summary())
        return 0
    found = checks(import_torchvision=True)
    print(report(found), flush=True)
    return 1 if any(c.ok is False for c in found) else 0
