"""Which PyTorch releases the course supports, and one clear sentence when a kernel has another.

The pin in ``requirements.txt`` is what CI tests; learners run whatever torch they have
(Colab's, or the newest from ``pip install torch``). Every release in
``SUPPORTED_TORCH`` (first and last minor version, both included) runs the course.
Every chapter's setup cell calls :func:`check_torch`; outside the range it stops the
notebook with one sentence that says what to install, instead of a stack trace
from somewhere deep in a chapter.
"""

from __future__ import annotations

import re

from .i18n import tr

SUPPORTED_TORCH = ("2.11", "2.15")


class UnsupportedTorch(RuntimeError):
    """This torch is outside ``SUPPORTED_TORCH``; the message says what to install."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of a traceback: the sentence is the whole story.
        return [str(self)]


def _minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string: "2.13.0+cpu" -> (2, 13); None if it has none."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def pip_requirement() -> str:
    """The pip requirement for a supported torch: ``torch>=2.11,<2.16``."""
    low, high = SUPPORTED_TORCH
    major, minor = _minor(high)
    return f"torch>={low},<{major}.{minor + 1}"


def torch_problem(version: str | None = None) -> str | None:
    """The sentence to show for torch ``version`` (default: the installed one); None when supported."""
    if version is None:
        import torch

        version = torch.__version__
    low, high = SUPPORTED_TORCH
    found = _minor(version)
    if found is not None and _minor(low) <= found <= _minor(high):
        return None
    return tr(
        "This course needs PyTorch {low} to {high}; this kernel has {version}. "
        "Install a supported one, then restart the kernel: pip install '{requirement}'"
    ).format(low=low, high=high, version=version, requirement=pip_requirement())


def check_torch(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTorch` (one sentence, no traceback in Jupyter) when torch
    ``version`` (default: the installed one) is outside ``SUPPORTED_TORCH``."""
    problem = torch_problem(version)
    if problem:
        raise UnsupportedTorch(problem)
