"""Starting launchers (torchrun agents, scripts) as subprocesses, without leaving processes behind.

Chapters 01, 07, 11 and 12 start torchrun from notebook cells and tests; this is their one copy.

    result = run(torchrun("--standalone", "--nproc-per-node=2", script_args=["--steps", "20"]))
    result.ranks[0]          # lines rank 0 printed, "[rank 0] " removed
    result.json(0, "result") # the JSON that rank 0 printed after "result "

Each agent starts in its own session (``start_new_session=True``), so it and everything in
its process group can be signalled at once. torchrun starts every *worker* in a session
of its own, though, so a group signal alone would orphan them: teardown first finds the
agent's descendants, then signals every one of them. Output goes to temporary files
rather than pipes, so a chatty process can never block on a full pipe while we wait
for another one.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ..runtime import hardware, i18n
from ..runtime.processes import group_alive as group_alive  # chapter 07 checks teardown with it
from ..runtime.processes import package_env, stop_trees

RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")
# Lines that code reads back (tag, then JSON) and that say nothing a sentence beside them does not
# say in the reader's language: Result.show() leaves them out. "result" is shown: it is the outcome.
MACHINE_TAGS = ("worker", "store", "crash", "resume", "kill")


class TorchrunError(RuntimeError):
    """A torchrun process failed; ``results`` holds what every process printed."""

    def __init__(self, message: str, results: list[Result]):
        super().__init__(message)
        self.results = results


class TorchrunTimeout(TorchrunError, TimeoutError):
    """Still running at the deadline: every process was stopped."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it when we bind port 0).

    Another program could take it before torchrun binds it; on a single machine that is
    rare enough, and the error would say "address already in use".
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*launcher_args: str, module: str = "distcourse.train", script_args=()) -> list[str]:
    """The command line ``torchrun <launcher_args> -m <module> <script_args>``.

    ``python -m torch.distributed.run`` is what the ``torchrun`` command runs; spelling it
    this way uses the notebook's own Python, whatever is on the PATH.
    """
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", module, *map(str, script_args)]


def child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """The environment for launched processes: one intra-op thread each, distcourse importable, and
    ``DISTCOURSE_LANG``: the language this process speaks (the notebook's), for what they print."""
    language = {"DISTCOURSE_LANG": i18n.language()}
    return package_env(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **{**language, **extra})


def node_envs(nnodes: int, nproc_per_node: int = 1, threads: int = 1, **extra: str) -> list[dict[str, str]]:
    """One environment per "node" simulated on this machine: ``run_together(agents, env=node_envs(2))``.

    Every torchrun agent numbers its workers from ``LOCAL_RANK=0`` and each worker takes
    ``cuda:LOCAL_RANK``, so agents sharing a machine would all take its first GPU, and NCCL
    refuses two ranks on one GPU ("Duplicate GPU detected"). Each agent therefore gets a
    ``CUDA_VISIBLE_DEVICES`` of its own: GPUs no other agent sees, as on separate machines,
    or none ("") when there are too few for every worker; then all of them run gloo on the CPU.
    """
    return [
        child_env(threads, **hardware.agent_env(None, nnodes, nproc_per_node, node), **extra) for node in range(nnodes)
    ]


@dataclass
class Result:
    """What one launched process did: its command, exit code and output."""

    command: list[str]
    pid: int  # also the id of its process group and session
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    ranks: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self):
        self.ranks = per_rank(self.stdout)

    def json(self, rank: int, tag: str):
        """The JSON value that ``rank`` printed after ``tag`` (the last one, if several)."""
        found = self.all_json(rank, tag)
        if not found:
            raise KeyError(i18n.tr("rank {rank} printed no '{tag} ...' line").format(rank=rank, tag=tag))
        return found[-1]

    def all_json(self, rank: int, tag: str) -> list:
        """Every JSON value that ``rank`` printed after ``tag``, in order (e.g. one per restart)."""
        lines = self.ranks.get(rank, [])
        return [json.loads(line[len(tag) + 1 :]) for line in lines if line.startswith(tag + " ")]

    def show(self, stderr_lines: int = 0, label: str = "", hide=MACHINE_TAGS) -> None:
        """Print the ranks' lines but those tagged ``hide``; optionally the end of stderr (torchrun's log)."""
        for line in self.stdout.splitlines():
            m = RANK_LINE.match(line)
            if not (m and m.group(2).split(" ", 1)[0] in hide):
                print(f"{label}{line}")
        if stderr_lines:
            for line in self.stderr.splitlines()[-stderr_lines:]:
                print(f"{label}(stderr) {line}")


def find_json(results: list[Result], rank: int, tag: str):
    """The JSON value after ``tag`` from ``rank``, whichever of several agents printed it."""
    for result in results:
        if result.all_json(rank, tag):
            return result.json(rank, tag)
    raise KeyError(i18n.tr("no agent shows a '{tag} ...' line of rank {rank}").format(tag=tag, rank=rank))


def per_rank(text: str) -> dict[int, list[str]]:
    """Lines of the form ``[rank R] message``, grouped by rank, in the order printed."""
    ranks: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = RANK_LINE.match(line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    return dict(sorted(ranks.items()))


def run(command: list[str], timeout: float = 60.0, env=None, check: bool = True) -> Result:
    """Run one command (e.g. a torchrun agent) to completion, or stop it at ``timeout``."""
    return run_together([command], timeout=timeout, env=env, check=check)[0]


def run_together(
    commands: list[list[str]], timeout: float = 60.0, env=None, check: bool = True, grace: float = 5.0, start_when=None
) -> list[Result]:
    """Start every command at once (e.g. one torchrun agent per "node") and wait for all.

    env: one environment for all (default ``child_env()``), or a list with one per command.
    start_when: optionally, one entry per command: None (start at once) or a function of no
    arguments; the command starts as soon as it returns True (e.g. a node that joins a job
    once the job is training). A command whose moment never comes is reported with
    ``returncode`` None.
    On timeout, on an interrupted cell, or when one fails and ``check`` is set: every
    process and all their descendants are stopped before this returns or raises; after
    a failure the others first get ``grace`` seconds to end on their own.
    """
    envs = env if isinstance(env, list) else [child_env() if env is None else env] * len(commands)
    conditions = list(start_when) if start_when is not None else [None] * len(commands)
    started = time.monotonic()
    procs, files = [None] * len(commands), []
    # torchrun leaves a log folder in the temporary directory after every run: give it ours.
    with tempfile.TemporaryDirectory(prefix="torchrun-") as scratch:

        def start(i):
            out, err = files[i]
            procs[i] = subprocess.Popen(
                commands[i], stdout=out, stderr=err, env={**envs[i], "TMPDIR": scratch}, start_new_session=True
            )

        try:
            files.extend((tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in commands)
            for i, condition in enumerate(conditions):
                if condition is None:
                    start(i)
            while any(p is None for p in procs) and time.monotonic() < started + timeout:
                if check and any(p is not None and p.poll() not in (None, 0) for p in procs):
                    break  # one failed already: start nothing more
                for i, condition in enumerate(conditions):
                    if procs[i] is None and condition():
                        start(i)
                time.sleep(0.05)
            running = [p for p in procs if p is not None]
            timed_out = _wait_all(running, started + timeout, stop_on_failure=check, grace=grace)
            timed_out = timed_out or (len(running) < len(procs) and not (check and any(p.returncode for p in running)))
        finally:
            for p in procs:  # no-op for processes that have exited and have no descendants left
                if p is not None:
                    stop(p)
    seconds = time.monotonic() - started
    results = [
        Result(cmd, p.pid if p else 0, p.returncode if p else None, _read(out), _read(err), seconds)
        for cmd, p, (out, err) in zip(commands, procs, files)
    ]
    _raise_if_failed(results, timed_out, timeout, check)
    return results


def _raise_if_failed(results: list[Result], timed_out: bool, timeout: float, check: bool) -> None:
    if timed_out:
        text = i18n.tr("still running after {timeout} s: stopped every process")
        raise TorchrunTimeout(text.format(timeout=i18n.number(timeout)), results)
    failed = [i for i, r in enumerate(results) if r.returncode != 0]
    if check and failed:
        i = failed[0]
        tail = "\n".join(results[i].stderr.splitlines()[-15:])
        text = i18n.tr("process {i} exited with code {code}:").format(i=i, code=results[i].returncode)
        raise TorchrunError(f"{text}\n{tail}", results)


def _wait_all(procs, deadline: float, stop_on_failure: bool, grace: float) -> bool:
    """Wait until every process has exited; True if the deadline came first.

    After a failure the others get ``grace`` seconds to notice and exit on their own
    (a torchrun agent whose peer died ends its run), then they are stopped.
    """
    while any(p.poll() is None for p in procs):
        if stop_on_failure and any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() >= deadline:
            return not (stop_on_failure and any(p.returncode not in (None, 0) for p in procs))
        time.sleep(0.05)
    return False


def _read(f) -> str:
    f.seek(0)
    text = f.read().decode(errors="replace")
    f.close()
    return text


# --------------------------------------------------------------------------------------
# Teardown
# --------------------------------------------------------------------------------------


def stop(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """Stop an agent, its process group and every descendant (``runtime/processes.py``), then reap it.

    SIGTERM first: a torchrun agent catches it and stops its workers itself; SIGKILL after
    ``grace`` seconds for whatever is left.
    """
    stop_trees([proc.pid], grace=grace)
    proc.wait()
