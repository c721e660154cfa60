"""Companion package of the course *Distributed Training with PyTorch*.

Notebooks call it to start real multi-process runs; see :func:`launch`.
"""

from .runtime import vision_compat

vision_compat.install()  # before anything imports torchvision; see vision_compat.py

from .runtime import doctor  # noqa: E402  (python -m distcourse doctor; doctor.summary() in setup cells)
from .runtime.hardware import (  # noqa: E402
    Hardware,
    agent_env,
    cpu_cores,
    describe_machine,
    gpu_count,
    node_plan,
    plan,
    rank_device,
    run_summary,
)
from .runtime.i18n import language, number, pad, set_language, tr  # noqa: E402
from .runtime.launcher import LaunchError, LaunchTimeout, RankFailed, Results, launch, warm_up  # noqa: E402
from .runtime.support import SUPPORTED_TORCH, UnsupportedTorch, check_torch  # noqa: E402


def show_run(text: str, cpu: str) -> None:
    """Under a chapter's title: which PyTorch and which device produced the outputs below."""
    from IPython.display import Markdown, display

    display(Markdown(f"*{run_summary(text, cpu)}*"))


__version__ = "0.1.0"
__all__ = [
    "SUPPORTED_TORCH",
    "Hardware",
    "UnsupportedTorch",
    "agent_env",
    "check_torch",
    "doctor",
    "node_plan",
    "LaunchError",
    "LaunchTimeout",
    "RankFailed",
    "Results",
    "cpu_cores",
    "describe_machine",
    "gpu_count",
    "launch",
    "plan",
    "rank_device",
    "run_summary",
    "show_run",
    "warm_up",
    "language",
    "number",
    "pad",
    "set_language",
    "tr",
]
