"""Self-checks for the chapters' exercises, one module per chapter (``ch01`` ... ``ch12``).

Each check prints a verdict a learner can act on, in the notebook's language (``tr``),
and returns True or False.
"""

from __future__ import annotations

from ..runtime.i18n import tr


def verdict(problems: list[str], success: str) -> bool:
    """Print what is still wrong (or the success message); True when nothing is."""
    if problems:
        print(tr("Not yet:") + "\n  - " + "\n  - ".join(problems))
        return False
    print(success)
    return True
