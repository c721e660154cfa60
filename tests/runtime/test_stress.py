"""Launcher failure scenarios, each repeated many times: `make stress` (also part of `make test`).

Every attempt must end with the right error, quickly, and with no process left
behind, checked by listing the process tree. The terminal summary prints a
table of passed/attempts per scenario.
"""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import pytest

import rank_workers as w
from conftest import stray_processes
from distcourse import LaunchTimeout, RankFailed, launch
from interrupts import interrupt_when_ranks_run

pytestmark = pytest.mark.stress
ATTEMPTS = int(os.environ.get("STRESS_ATTEMPTS", "20"))
TESTS = os.path.dirname(__file__)
RESULTS: dict[str, tuple[int, int, float]] = {}  # scenario -> (passed, attempts, worst seconds)

# Time bounds that hold on a machine whose two cores are busy with other work. Measured beside two
# `python -c "while True: pass"`: the launcher's fork server needs up to 18 s to start (it imports
# torch), so the fixture below starts it before any clock; after that, 2 ranks start, create 2
# DataLoader workers each and take their first batch in at most 0.6 s (0.3 s on an idle machine).
START = 3.0  # seconds for that start-up: 5x the slowest measured
STOP = 6.0  # stopping: the launcher's 1 s SIGTERM grace, then SIGKILL and up to 5 s for the kernel


@pytest.fixture(scope="module", autouse=True)
def warm_launcher():
    """Start the fork server (and torch in it) once, outside the timed attempts."""
    launch(w.rank_and_sum, 2, quiet=True, timeout=120)


def processes_gone(grace: float = 5.0) -> bool:
    deadline = time.monotonic() + grace
    while stray_processes():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def repeat(name: str, attempt, limit: float) -> None:
    """Run ``attempt`` ATTEMPTS times; each must return True within ``limit`` seconds."""
    passed, worst, failures = 0, 0.0, []
    for i in range(ATTEMPTS):
        start = time.monotonic()
        try:
            ok = attempt()
        except Exception as exc:  # an unexpected error is a failed attempt, reported below
            ok, failures = False, failures + [f"attempt {i}: {exc!r}"[:300]]
        seconds = time.monotonic() - start
        worst = max(worst, seconds)
        ok = ok and seconds < limit and processes_gone()
        passed += ok
    RESULTS[name] = (passed, ATTEMPTS, worst)
    assert passed == ATTEMPTS, f"{name}: {passed}/{ATTEMPTS} passed, worst {worst:.2f} s; {failures[:3]}"


def expect(exc_type, match, fn, *args, **kwargs) -> bool:
    try:
        launch(fn, 2, *args, quiet=True, **kwargs)
    except exc_type as exc:
        return match(exc)
    return False


def test_rank_raises():
    repeat(
        "a rank raises",
        lambda: expect(
            RankFailed, lambda e: e.rank == 1 and "deliberate failure" in str(e), w.raise_on, kwargs={"rank_to_fail": 1}
        ),
        limit=10,
    )


def test_rank_exits_nonzero():
    repeat("a rank exits with code 3", lambda: expect(RankFailed, lambda e: "code 3" in str(e), w.exit_with), limit=10)


def test_rank_killed_by_signal():
    repeat(
        "a rank is killed (SIGKILL)", lambda: expect(RankFailed, lambda e: "SIGKILL" in str(e), w.kill_self), limit=10
    )


def test_rank_killed_while_others_wait_in_a_collective():
    # The survivor reports "connection closed by peer" first; the launcher must still
    # name the rank that died, not the one that noticed.
    repeat(
        "a rank is killed while the other is in all_reduce",
        lambda: expect(RankFailed, lambda e: e.rank == 1 and "SIGKILL" in str(e), w.killed_mid_collective),
        limit=10,
    )


def test_rank_hangs_in_collective():
    repeat(
        "a rank hangs in a collective (1 s timeout)",
        lambda: expect(RankFailed, lambda e: "Timed out" in str(e), w.uneven_barrier, collective_timeout=1, timeout=30),
        limit=6,
    )


def test_whole_run_timeout():
    repeat(
        "the whole run times out (1 s)",
        lambda: expect(LaunchTimeout, lambda e: e.running == [0, 1], w.sleep_forever, timeout=1),
        limit=1 + STOP,
    )


def test_sigint_to_the_caller():
    def attempt():
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            launch(w.sleep_forever, 2, timeout=60, quiet=True)
        except KeyboardInterrupt:
            return True
        finally:
            timer.join()
        return False

    repeat("SIGINT to the calling process", attempt, limit=0.3 + STOP)


def test_two_callers_at_once():
    """Two independent processes, like two pytest workers, launching at the same time."""
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {TESTS!r})
        import distcourse, rank_workers
        ok = 0
        for _ in range({ATTEMPTS}):
            ok += distcourse.launch(rank_workers.rank_and_sum, 2, quiet=True) == [(0, 2, 3.0), (1, 2, 3.0)]
        print(ok)
        """
    )
    start = time.monotonic()
    callers = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    counts = [int(c.communicate(timeout=300)[0] or 0) for c in callers]
    passed = sum(counts) if all(c.returncode == 0 for c in callers) else 0
    RESULTS["two callers launching at once"] = (passed, 2 * ATTEMPTS, time.monotonic() - start)
    assert passed == 2 * ATTEMPTS and processes_gone()


# --- ranks with children: DataLoader workers, and a grandchild that ignores SIGTERM -----------


def children_gone(pid_dir: str, at_least: int) -> bool:
    pids = [int(pid) for name in os.listdir(pid_dir) for pid in open(os.path.join(pid_dir, name)).read().split()]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if not alive:
            return len(pids) >= at_least
        time.sleep(0.02)
    return False


def with_workers(then: str, exc_type, timeout: float = 60, interrupt: bool = False) -> bool:
    with tempfile.TemporaryDirectory() as pid_dir:
        launch_ended = threading.Event()
        interrupter = interrupt_when_ranks_run(pid_dir, launch_ended) if interrupt else None
        try:
            launch(w.ddp_with_loader_workers, 2, kwargs={"pid_dir": pid_dir, "then": then}, timeout=timeout, quiet=True)
        except exc_type:
            return children_gone(pid_dir, at_least=3 if then == "orphan" else 2)
        finally:
            launch_ended.set()
            if interrupter:
                interrupter.join()
        return False


# A failure while the workers run comes after the start-up; then everything is stopped, and
# children_gone may wait up to 5 s more for the kernel to reap the workers.
WORKERS_LIMIT = START + STOP + 5


def test_rank_raises_while_its_dataloader_workers_run():
    repeat("a rank raises, DataLoader workers alive", lambda: with_workers("raise", RankFailed), limit=WORKERS_LIMIT)


def test_timeout_while_dataloader_workers_run():
    # the timeout must fire while the workers run: after the start-up
    repeat(
        f"timeout ({START:g} s), DataLoader workers alive",
        lambda: with_workers("hang", LaunchTimeout, timeout=START),
        limit=WORKERS_LIMIT,
    )


def test_sigint_while_dataloader_workers_run():
    repeat(
        "SIGINT, DataLoader workers alive",
        lambda: with_workers("hang", KeyboardInterrupt, interrupt=True),
        limit=WORKERS_LIMIT,
    )


def test_orphaned_grandchild_that_ignores_sigterm():
    repeat(
        "a grandchild ignores SIGTERM, its parent gone", lambda: with_workers("orphan", RankFailed), limit=WORKERS_LIMIT
    )


def pytest_terminal_summary_table() -> list[str]:
    return [
        f"{passed:3d}/{attempts:<3d} worst {worst:6.2f} s  {name}"
        for name, (passed, attempts, worst) in RESULTS.items()
    ]
