"""Stopping a process and everything it started, and the environment for child Pythons.

A rank (or a torchrun agent) may start processes of its own: DataLoader workers, a
``multiprocessing.Pool``, ``subprocess.run``. Stopping only the rank would orphan them.
Two mechanisms of the OS find them, and ``stop_trees`` uses both because each misses
something the other catches:

* **process groups**: every rank makes itself the leader of a new session
  (``os.setsid``), and whatever it starts inherits that group, even after the rank is
  gone and the orphan has been re-parented to ``init``. ``os.killpg`` reaches them all.
  A child that starts a session of its own (torchrun does that for every worker) leaves
  the group, so the group alone is not enough;
* **the process tree** (``psutil``): listed *before* anything is signalled, while the
  parent is still there to be asked, it finds children in other sessions too.

Signals go out as SIGTERM first (a torchrun agent stops its workers itself; a
DataLoader shuts down), then SIGKILL after ``grace`` seconds for whatever ignored it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import psutil

# The folder that holds the distcourse package, so that child Pythons can import it
# whether or not it was installed.
PACKAGE_PARENT = str(pathlib.Path(__file__).resolve().parents[2])


def descendants(pid: int) -> list[psutil.Process]:
    """Every process started, directly or not, by ``pid`` that is still running."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_alive(pgid: int) -> bool:
    """Whether a running (not zombie) process of process group ``pgid`` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg also succeeds while only zombies (exited, not yet reaped) remain.
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            pass
    return False


def _signal_all(leaders: list[int], family: list[psutil.Process], sig: int) -> None:
    for pid in leaders:
        for send in (os.killpg, os.kill):  # the group (if it was made one) and the leader itself
            try:
                send(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in family:
        try:
            proc.send_signal(sig)  # psutil checks that the PID still names the same process
        except psutil.Error:
            pass


def _leader(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def stop_trees(pids: list[int], grace: float = 1.0) -> None:
    """Stop processes ``pids``, their process groups and all their descendants.

    ``pids`` should be session or group leaders (``start_new_session=True`` or
    ``os.setsid()``); for others only the tree is found. Returns once everything is gone
    (SIGKILL cannot be refused; this waits at most a few seconds for the kernel).
    """
    leaders = [proc for proc in map(_leader, pids) if proc is not None]
    family = [child for pid in pids for child in descendants(pid)]  # before any parent is gone
    everyone = leaders + family

    def anything_left() -> bool:
        return any(alive(p) for p in everyone) or any(group_alive(pid) for pid in pids)

    if not anything_left():
        return
    _signal_all(list(pids), family, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and anything_left():
        time.sleep(0.02)
    # Children that appeared meanwhile (a worker started while we waited) are caught too.
    family += [child for pid in pids for child in descendants(pid) if child not in family]
    everyone = leaders + family
    _signal_all(list(pids), family, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and anything_left():
        time.sleep(0.02)


def package_env(env: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default: this process's) with distcourse importable, plus ``extra``."""
    env = dict(os.environ if env is None else env)
    path = [PACKAGE_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != PACKAGE_PARENT]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra)
    return env
