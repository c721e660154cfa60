"""What the ranks print, shown in the notebook cell: live while they run, grouped when done.

In Jupyter the cell gets one display area that is updated in place (IPython's
``display(..., display_id=True)``): while the ranks run it shows their latest lines as
they arrive, and a progress bar (``tqdm`` writes ``\\r`` and redraws its line) as one
updating line per rank. When the launch ends the same area is replaced by the whole
output grouped by rank, in rank order, with every bar in its final state: that is what
a saved notebook and the rendered book show, the same on every run.

Outside Jupyter (a terminal, a test) lines are printed grouped at the end, or as they
arrive with ``stream=True``.
"""

from __future__ import annotations

import sys
import time

from .i18n import tr

LIVE_LINES = 12  # lines of the live view; the final view has everything
REFRESH_S = 0.25  # the live view is redrawn at most this often


def _in_jupyter() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def final_state(line: str) -> str:
    """A line as a terminal would leave it: what follows the last carriage return."""
    parts = [part for part in line.split("\r") if part]
    return parts[-1] if parts else ""


def labelled(rank: int, lines: list[str]) -> str:
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


class RankOutput:
    def __init__(self, world_size: int, quiet: bool = False, stream: bool = False):
        self.quiet, self.stream = quiet, stream
        self.lines: dict[int, list[str]] = {rank: [] for rank in range(world_size)}  # complete lines
        self.partial: dict[int, str] = {rank: "" for rank in range(world_size)}  # text after the last \n
        self.recent: list[str] = []  # labelled complete lines in arrival order, for the live view
        self.handle = None
        self.live = not quiet and _in_jupyter()
        self.drawn_at = 0.0

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, end="", flush=True)

    def feed(self, rank: int, chunk: bytes) -> None:
        text = self.partial[rank] + chunk.decode(errors="replace")
        *complete, self.partial[rank] = text.split("\n")
        done = [final_state(line) for line in complete]
        self.lines[rank].extend(done)
        if self.live:
            self.recent = (self.recent + [labelled(rank, [line]) for line in done])[-LIVE_LINES:]
        elif self.stream and not self.quiet:
            self.say(labelled(rank, done))

    def refresh(self, force: bool = False) -> None:
        """Redraw the live view (in Jupyter), at most every REFRESH_S seconds."""
        if not self.live or (not force and time.monotonic() - self.drawn_at < REFRESH_S):
            return
        progress = [labelled(r, [final_state(p)]) for r, p in self.partial.items() if final_state(p)]
        self._show("".join(self.recent + progress) or tr("(waiting for the ranks' first output)") + "\n")
        self.drawn_at = time.monotonic()

    def _show(self, text: str) -> None:
        from IPython.display import display

        bundle = {"text/plain": text.rstrip("\n")}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)

    def texts(self) -> dict[int, str]:
        """Each rank's whole output, bars in their final state."""
        return {rank: "".join(f"{line}\n" for line in self._all_lines(rank)) for rank in self.lines}

    def _all_lines(self, rank: int) -> list[str]:
        tail = final_state(self.partial[rank])
        return self.lines[rank] + ([tail] if tail else [])

    def close(self) -> None:
        """Show the final, grouped view."""
        if self.quiet:
            return
        grouped = "".join(labelled(rank, self._all_lines(rank)) for rank in self.lines)
        if self.live:
            if grouped or self.handle is not None:
                self._show(grouped or tr("(the ranks printed nothing)") + "\n")
        elif self.stream:
            self.say("".join(labelled(r, [final_state(p)]) for r, p in self.partial.items() if final_state(p)))
        else:
            self.say(grouped)
