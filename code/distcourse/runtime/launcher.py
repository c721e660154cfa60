"""Start N real PyTorch ranks from a notebook cell and collect what they return.

    results = launch(fn, world_size=2, args=(...), timeout=60)

``fn`` runs once per rank with a fresh process group already initialised
(gloo on CPU, nccl with one GPU per rank); ``results[r]`` is what rank ``r``
returned. Each rank's output is shown below the cell, labelled by rank.

Built on ``torch.multiprocessing`` (the fork-server start method) and
``torch.distributed.TCPStore``. What they lack, written here:

* output relay: ``mp.spawn`` lets children write straight into the terminal, so
  lines of different ranks interleave at random and C++ messages bypass Jupyter;
* returning values: ``mp.spawn`` discards them;
* teardown on failure: ``mp.spawn`` waits on a rank stuck in a collective
  until gloo's 30-minute default timeout; here a failure, a timeout or an
  interrupted cell stops every rank within a second or two.

Why the fork server: ``spawn`` starts a new interpreter and imports torch for
every rank of every launch (1-2 s each). A fork server is started once per
kernel, imports torch once, and then forks a fresh rank in milliseconds.
It is started by exec (not forked from the kernel), so a kernel that has used
CUDA never passes a CUDA context to ranks; the fork server only imports torch
(importing does not initialise CUDA), and every rank checks
``torch.cuda.is_initialized()`` before it starts. The modules the fork server
preloads (torch and the launcher itself) are not re-imported by later
launches: after editing them, restart the kernel. Chapter modules are imported
afresh by every rank.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import sys
import time
import uuid
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp
import torch.distributed as dist

from . import hardware
from .rank import run_rank

# torch._dynamo: optimizers and FSDP import it (~1 s per rank otherwise); importing starts nothing.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "distcourse", "distcourse.runtime.rank"]
_live: set = set()  # processes of launches in progress, killed at interpreter exit


class LaunchError(RuntimeError):
    """A launch did not finish: a rank failed, or it ran out of time."""


class RankFailed(LaunchError):
    def __init__(self, rank: int, detail: str, outputs: dict[int, str]):
        self.rank, self.detail, self.outputs = rank, detail, outputs
        super().__init__(f"rank {rank} failed; the other ranks were stopped.\n\n{detail}".rstrip())


class LaunchTimeout(LaunchError, TimeoutError):
    def __init__(self, timeout: float, running: list[int], outputs: dict[int, str]):
        self.running, self.outputs = running, outputs
        super().__init__(
            f"ranks {running} were still running after the {timeout:g} s timeout and were stopped "
            f"(a rank waiting in a collective that another rank never joins hangs like this)"
        )


class Results(list):
    """Per-rank return values, indexed by rank, plus how the launch went."""

    seconds: float = 0.0
    plan: hardware.Plan | None = None
    outputs: dict[int, str]


def _context():
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def warm_up() -> None:
    """Start the fork server now, so that the first launch is as fast as the rest."""
    ctx = _context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _check_importable(fn) -> None:
    """Rank processes import ``fn`` by module and name; refuse what they cannot."""
    target = getattr(fn, "func", fn)  # functools.partial
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    hint = (
        "Rank processes import the function by name, so it must live in a .py module: "
        "move it into a file (e.g. my_workers.py next to the notebook) and import it, "
        "or use one from the distcourse package."
    )
    if not callable(target):
        raise ValueError(f"fn must be callable, got {fn!r}")
    if module in (None, "__main__", "__mp_main__") or "<" in qualname:
        raise ValueError(f"{qualname or fn!r} is defined in the notebook or inside a function. {hint}")
    try:
        obj = sys.modules.get(module) or __import__(module, fromlist=["_"])
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        obj = None
    if obj is not target:
        raise ValueError(f"{module}.{qualname} cannot be imported by that name. {hint}")


class _NotebookObjectPickler(pickle.Pickler):
    """Pickles like the default but refuses objects whose class lives in ``__main__``."""

    def reducer_override(self, obj):
        owner = obj if isinstance(obj, type) else type(obj)
        if getattr(owner, "__module__", None) == "__main__" or getattr(obj, "__module__", 1) == "__main__":
            raise ValueError(
                f"{obj!r} is defined in the notebook, so rank processes cannot unpickle it; "
                "move its definition into a .py module and import it"
            )
        return NotImplemented


def _dumps(value) -> bytes:
    import io

    buffer = io.BytesIO()
    try:
        _NotebookObjectPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"the function's arguments cannot be sent to rank processes: {exc}") from exc
    return buffer.getvalue()


def _listening_store():
    """A TCPStore served by this process on 127.0.0.1, on a port the OS picks.

    Binding the socket ourselves (port 0) and handing it to the store means no
    other launch can take the port between choosing and listening, and the
    store never listens beyond loopback (TCPStore alone binds every interface).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns and closes the descriptor
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd, use_libuv=True
    )
    return store, port


def _stop(processes, grace: float = 1.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, and reap every process."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)
    _live.difference_update(processes)


@atexit.register
def _stop_all() -> None:
    _stop(list(_live), grace=0.5)


def _labelled(rank: int, text: str) -> str:
    lines = text.splitlines()
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


def launch(
    fn,
    world_size: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    backend: str | None = None,
    timeout: float = 60.0,
    collective_timeout: float | None = None,
    threads: int | None = None,
    init_process_group: bool = True,
    stream: bool = False,
    quiet: bool = False,
) -> Results:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new processes and return their results.

    backend: None picks nccl when every rank can have its own GPU, else gloo.
    timeout: seconds for the whole launch; then every rank is stopped and
        :class:`LaunchTimeout` is raised.
    collective_timeout: the process group's timeout inside the ranks (defaults
        to ``timeout``); a collective waiting longer raises in that rank.
    threads: intra-op threads per rank; default ``max(1, cores // world_size)``.
    stream: print rank output as it arrives instead of grouped by rank at the end.
    quiet: print nothing (results and errors are unchanged).
    """
    the_plan = hardware.plan(world_size, backend, threads)
    _check_importable(fn)
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    collective_timeout = timeout if collective_timeout is None else collective_timeout
    if not (isinstance(collective_timeout, (int, float)) and collective_timeout > 0):
        raise ValueError(f"collective_timeout must be a positive number of seconds, got {collective_timeout!r}")
    payload = _dumps((fn, tuple(args), dict(kwargs or {})))
    say = (lambda text: None) if quiet else (lambda text: print(text, end="", flush=True))
    say(f"launch: {the_plan.describe()}\n")

    ctx = _context()
    started = time.monotonic()
    store, port = _listening_store() if init_process_group else (None, 0)
    task = {
        "world_size": world_size,
        "backend": the_plan.backend,
        "threads": the_plan.threads,
        "port": port,
        "run_id": uuid.uuid4().hex,
        "collective_timeout": float(collective_timeout),
        "init_process_group": init_process_group,
        "payload": payload,
    }
    processes, conns, pipes = [], {}, {}
    outputs = {rank: b"" for rank in range(world_size)}
    replies: dict[int, tuple] = {}
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            read_fd, write_fd = os.pipe()
            output = Connection(write_fd, readable=False)
            p = ctx.Process(
                target=run_rank, args=(rank, task, child_end, output), name=f"rank{rank}", daemon=True
            )
            p.start()
            _live.add(p)
            child_end.close()
            output.close()
            processes.append(p)
            conns[parent_end] = rank
            pipes[read_fd] = rank

        failures: dict[int, tuple[float, str]] = {}  # rank -> (when, what)
        sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}
        deadline = started + timeout

        def handle(obj) -> None:
            if obj in pipes:
                rank, chunk = pipes[obj], os.read(obj, 65536)
                if chunk:
                    outputs[rank] += chunk
                    if stream:
                        say(_labelled(rank, chunk.decode(errors="replace")))
                else:
                    del pipes[obj]
                    os.close(obj)
            elif obj in conns:
                rank = conns.pop(obj)
                try:
                    replies[rank] = reply = pickle.loads(obj.recv_bytes())
                    if reply[0] == "error":
                        failures.setdefault(rank, (reply[2], reply[1]))
                except (EOFError, OSError):
                    pass
                obj.close()
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                p = processes[rank]
                p.join()
                for conn in [c for c, r in conns.items() if r == rank and c.poll(0)]:
                    handle(conn)
                if (p.exitcode != 0 or rank not in replies) and rank not in failures:
                    # Died without a word (signal, os._exit): nothing happened before it.
                    failures[rank] = (float("-inf"), _describe_failure(rank, p.exitcode, replies.get(rank)))

        while sentinels or pipes:
            if not sentinels:
                # Every rank has exited: drain the pipes for at most one more second,
                # since a grandchild (e.g. a DataLoader worker) may still hold one open.
                deadline = min(deadline, time.monotonic() + 1.0)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for obj in wait(list(sentinels) + list(conns) + list(pipes), timeout=remaining):
                handle(obj)
            if failures and sentinels:
                # One failure makes the others fail too (their peer vanished). Collect
                # what arrives shortly after, then blame the earliest, and stop the rest.
                # If every failure so far only reports a vanished peer, the rank that
                # vanished has not been seen yet: give it a little longer to show up.
                grace_end, patience_end = time.monotonic() + 0.2, time.monotonic() + 2.0
                while sentinels:
                    only_consequences = all(_is_consequence(d) for _, d in failures.values())
                    remaining = (patience_end if only_consequences else grace_end) - time.monotonic()
                    if remaining <= 0:
                        break
                    for obj in wait(list(sentinels) + list(conns), timeout=remaining):
                        handle(obj)
                _stop(processes)
                sentinels.clear()
        failure = None
        if failures:
            # Blame the earliest failure that is not just "my peer vanished".
            rank = min(failures, key=lambda r: (_is_consequence(failures[r][1]), failures[r][0], r))
            failure = (rank, failures[rank][1])
        running = [rank for rank, p in enumerate(processes) if p.is_alive() and failure is None]
    except BaseException:
        _stop(processes)
        _close_all(conns, pipes)
        raise
    _stop(processes)
    _close_all(conns, pipes)
    if store is not None:
        del store
    seconds = time.monotonic() - started
    text = {rank: data.decode(errors="replace") for rank, data in outputs.items()}
    if not stream:
        for rank in range(world_size):
            say(_labelled(rank, text[rank]))
    if running:
        raise LaunchTimeout(timeout, running, text)
    if failure is not None:
        raise RankFailed(failure[0], failure[1], text)
    results = Results(replies[rank][1] for rank in range(world_size))
    results.seconds, results.plan, results.outputs = seconds, the_plan, text
    return results


# What a rank reports when another rank vanished under it (gloo, NCCL).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "ECONNRESET", "remote process exited")


def _is_consequence(detail: str) -> bool:
    return any(marker in detail for marker in _PEER_LOST)


def _describe_failure(rank: int, exitcode, reply) -> str:
    if reply is not None and reply[0] == "error":
        return reply[1]
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"rank {rank} was killed by signal {name}"
    return f"rank {rank} exited with code {exitcode} without returning a result"


def _close_all(conns, pipes) -> None:
    for conn in list(conns):
        conn.close()
    conns.clear()
    for fd in list(pipes):
        os.close(fd)
    pipes.clear()
