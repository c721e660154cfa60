"""Start N real PyTorch ranks from a notebook cell and collect what they return.

    results = launch(fn, world_size=2, args=(...), timeout=60)

``fn`` runs once per rank with a fresh process group already initialised
(gloo on CPU, nccl with one GPU per rank); ``results[r]`` is what rank ``r``
returned. Each rank's output appears in the cell while the ranks run, and,
when they are done, grouped by rank in rank order.

Built on ``torch.multiprocessing`` (the fork-server start method) and
``torch.distributed.TCPStore``. ``torch.multiprocessing.spawn`` already starts
ranks and, when one fails, terminates the others and raises its error; what a
notebook needs beyond it is written here:

* output relay: under ``mp.spawn`` children write straight into the terminal, so
  lines of different ranks interleave at random and C++ messages bypass Jupyter;
* returning values: ``mp.spawn`` discards them; here they come back, and their
  tensors through shared memory rather than copied through a pipe;
* a deadline for the whole run, and a stop that reaches the ranks' own children
  (DataLoader workers, pools, subprocesses; see ``processes.py``), also when the
  cell is interrupted;
* blame: the first rank that failed for a reason of its own is reported, not a rank
  that merely lost its peer.

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
import dataclasses
import io
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch.distributed as dist
import torch.multiprocessing as mp

from . import hardware, i18n, processes
from .messages import RECEIVED, Failed, Returned, Task
from .output import RankOutput
from .rank import run_rank

# torch._dynamo: optimizers and FSDP import it (~1 s per rank otherwise); importing starts nothing.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "distcourse", "distcourse.runtime.rank"]
_live: set = set()  # processes of launches in progress, stopped at interpreter exit


class LaunchError(RuntimeError):
    """A launch did not finish: a rank failed, or it ran out of time."""


class RankFailed(LaunchError):
    def __init__(self, rank: int, detail: str, outputs: dict[int, str]):
        self.rank, self.detail, self.outputs = rank, detail, outputs
        headline = i18n.tr("rank {rank} failed; the other ranks were stopped.").format(rank=rank)
        super().__init__(f"{headline}\n\n{detail}".rstrip())


class LaunchTimeout(LaunchError, TimeoutError):
    def __init__(self, timeout: float, running: list[int], outputs: dict[int, str]):
        self.running, self.outputs = running, outputs
        super().__init__(
            i18n.tr(
                "ranks {running} were still running after the {timeout} s timeout and were stopped "
                "(a rank waiting in a collective that another rank never joins hangs like this)"
            ).format(running=running, timeout=i18n.number(timeout))
        )


class Results(list):
    """Per-rank return values, indexed by rank, plus how the launch went."""

    seconds: float = 0.0
    plan: hardware.Plan | None = None
    outputs: dict[int, str]


# ------------------------------------------------------------------ before any process starts


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
    hint = i18n.tr(
        "Rank processes import the function by name, so it must live in a .py module: "
        "move it into a file (e.g. my_workers.py next to the notebook) and import it, "
        "or use one from the distcourse package."
    )
    if not callable(target):
        raise ValueError(i18n.tr("fn must be callable, got {fn}").format(fn=repr(fn)))
    if module in (None, "__main__", "__mp_main__") or "<" in qualname:
        where = i18n.tr("{name} is defined in the notebook or inside a function.").format(name=qualname or repr(fn))
        raise ValueError(f"{where} {hint}")
    try:
        obj = sys.modules.get(module) or __import__(module, fromlist=["_"])
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        obj = None
    if obj is not target:
        where = i18n.tr("{name} cannot be imported by that name.").format(name=f"{module}.{qualname}")
        raise ValueError(f"{where} {hint}")


class _NotebookObjectPickler(pickle.Pickler):
    """Pickles like the default but refuses objects whose class lives in ``__main__``."""

    def reducer_override(self, obj):
        owner = obj if isinstance(obj, type) else type(obj)
        if getattr(owner, "__module__", None) == "__main__" or getattr(obj, "__module__", 1) == "__main__":
            raise ValueError(
                i18n.tr(
                    "{object} is defined in the notebook, so rank processes cannot unpickle it; "
                    "move its definition into a .py module and import it"
                ).format(object=repr(obj))
            )
        return NotImplemented


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    try:
        _NotebookObjectPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(
            i18n.tr("the function's arguments cannot be sent to rank processes: {error}").format(error=exc)
        ) from exc
    return buffer.getvalue()


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(
            i18n.tr("{name} must be a positive number of seconds, got {value}").format(name=name, value=repr(value))
        )
    return float(value)


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


# ------------------------------------------------------------------ while the ranks run


@dataclass
class _Rank:
    """The launcher's view of one rank: its process, its reply connection, its output pipe."""

    index: int
    process: object
    conn: Connection | None
    output_fd: int | None
    reply: Returned | Failed | None = None
    failure: tuple[float, str] | None = None  # (when, what) if it failed
    exited: bool = False  # its exit has been seen and handled


@dataclass
class _Run:
    """One launch: start the ranks, pump their output and replies, stop everything."""

    task: Task
    timeout: float
    output: RankOutput
    ranks: list[_Rank] = field(default_factory=list)

    def start(self, ctx) -> None:
        for index in range(self.task.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            read_fd, write_fd = os.pipe()
            writer = Connection(write_fd, readable=False)
            # Not a daemon: a rank may start processes of its own (DataLoader workers...).
            process = ctx.Process(target=run_rank, args=(index, self.task, child_end, writer), name=f"rank{index}")
            self.ranks.append(_Rank(index, process, parent_end, read_fd))
            process.start()
            _live.add(process)
            child_end.close()
            writer.close()

    # -- events
    def _on_output(self, rank: _Rank) -> None:
        chunk = os.read(rank.output_fd, 65536)
        if chunk:
            self.output.feed(rank.index, chunk)
        else:
            os.close(rank.output_fd)
            rank.output_fd = None

    def _on_reply(self, rank: _Rank) -> None:
        conn, rank.conn = rank.conn, None
        try:
            rank.reply = pickle.loads(conn.recv_bytes())  # shared tensors are mapped here
            conn.send_bytes(RECEIVED)  # the rank may exit now
        except (EOFError, OSError):
            pass
        except Exception as exc:  # e.g. the rank vanished before its shared tensors were fetched
            detail = i18n.tr("rank {rank}'s result could not be received: {error}")
            rank.failure = (time.time(), detail.format(rank=rank.index, error=repr(exc)))
        finally:
            conn.close()
        if isinstance(rank.reply, Failed) and rank.failure is None:
            rank.failure = (rank.reply.when, rank.reply.traceback)

    def _on_exit(self, rank: _Rank) -> None:
        rank.exited = True
        rank.process.join()
        _live.discard(rank.process)
        if rank.conn is not None and rank.conn.poll(0):
            self._on_reply(rank)
        if rank.failure is None and (rank.process.exitcode != 0 or rank.reply is None):
            # Died without a word (signal, os._exit): nothing happened before it.
            rank.failure = (float("-inf"), _describe_exit(rank.index, rank.process.exitcode))

    def _pump(self, until: float, with_output: bool = True) -> None:
        """Handle whatever happens before ``until`` (or until nothing is left to wait for)."""
        events = {}
        for rank in self.ranks:
            if not rank.exited:
                events[rank.process.sentinel] = (self._on_exit, rank)
            if rank.conn is not None:
                events[rank.conn] = (self._on_reply, rank)
            if with_output and rank.output_fd is not None:
                events[rank.output_fd] = (self._on_output, rank)
        remaining = until - time.monotonic()
        if not events or remaining <= 0:
            return
        for ready in wait(list(events), timeout=remaining):
            handler, rank = events[ready]
            if handler != self._on_reply or rank.conn is not None:  # _on_exit may have read it already
                handler(rank)

    # -- the run
    def wait(self, started: float) -> None:
        deadline = started + self.timeout
        while time.monotonic() < deadline and not all(r.exited for r in self.ranks):
            self._pump(min(deadline, time.monotonic() + 0.5))
            self.output.refresh()
            if any(r.failure for r in self.ranks):
                self._collect_consequences()
                return
        # Every rank has exited: read what is left in the pipes for at most one more second,
        # since a grandchild (e.g. a DataLoader worker) may still hold one open.
        drain_until = min(deadline, time.monotonic() + 1.0) if all(r.exited for r in self.ranks) else 0
        while time.monotonic() < drain_until and any(r.output_fd is not None for r in self.ranks):
            self._pump(drain_until)

    def _collect_consequences(self) -> None:
        """One failure makes the others fail too (their peer vanished). Collect what arrives
        shortly after, so that the earliest real cause can be blamed. If every failure so far
        only reports a vanished peer, the rank that vanished has not been seen yet: wait longer."""
        start = time.monotonic()
        while not all(r.exited for r in self.ranks):
            failures = [r.failure[1] for r in self.ranks if r.failure]
            patience = 2.0 if all(_is_consequence(f) for f in failures) else 0.2
            if time.monotonic() - start >= patience:
                return
            self._pump(start + patience)

    def stop(self) -> None:
        """The one cleanup path: every rank, its process group and its descendants."""
        processes.stop_trees([r.process.pid for r in self.ranks if r.process.pid], grace=1.0)
        for rank in self.ranks:
            if rank.process.pid is not None:  # a rank whose start failed has nothing to join
                rank.process.join(5)
            _live.discard(rank.process)
            if rank.conn is not None:
                rank.conn.close()
                rank.conn = None
        for rank in self.ranks:  # output written before the stop still belongs in the cell
            while rank.output_fd is not None and wait([rank.output_fd], timeout=0):
                self._on_output(rank)
            if rank.output_fd is not None:
                os.close(rank.output_fd)
                rank.output_fd = None

    def outcome(self) -> tuple[int, str] | None:
        """The rank to blame and why: the earliest failure that is not just "my peer vanished"."""
        failed = [r for r in self.ranks if r.failure]
        if not failed:
            return None
        first = min(failed, key=lambda r: (_is_consequence(r.failure[1]), r.failure[0], r.index))
        return first.index, first.failure[1]


@atexit.register
def _stop_all() -> None:
    processes.stop_trees([p.pid for p in list(_live) if p.pid], grace=0.5)


# What a rank reports when another rank vanished under it (gloo, NCCL).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "ECONNRESET", "remote process exited")


def _is_consequence(detail: str) -> bool:
    return any(marker in detail for marker in _PEER_LOST)


def rank_environment(env: dict[str, str | None] | None = None) -> tuple[tuple[str, str], ...]:
    """``os.environ`` now, with ``env`` applied: what the ranks of a launch start with.

    Read at every launch, not when the fork server started: the fork server's own
    environment is the one of the moment it was started (``warm_up()``, usually the
    setup cell), and a variable set in the notebook after that would never reach a rank.
    """
    environ = dict(os.environ)
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ValueError(
                i18n.tr("env: variable names must be non-empty strings without '=', got {key}").format(key=repr(key))
            )
        if value is None:
            environ.pop(key, None)
        elif isinstance(value, str):
            environ[key] = value
        else:
            raise ValueError(
                i18n.tr("env: the value of {key} must be a string or None (to remove it), got {value}").format(
                    key=key, value=repr(value)
                )
            )
    return tuple(sorted(environ.items()))


def _describe_exit(rank: int, exitcode) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return i18n.tr("rank {rank} was killed by signal {signal}").format(rank=rank, signal=name)
    return i18n.tr("rank {rank} exited with code {code} without returning a result").format(rank=rank, code=exitcode)


# ------------------------------------------------------------------ the entry point


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
    share_tensors: bool = True,
    env: dict[str, str | None] | None = None,
) -> Results:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new processes and return their results.

    backend: None picks nccl when every rank can have its own GPU, else gloo.
    timeout: seconds for the whole launch; then every rank is stopped and
        :class:`LaunchTimeout` is raised.
    collective_timeout: the process group's timeout inside the ranks (defaults
        to ``timeout``); a collective waiting longer raises in that rank.
    threads: intra-op threads per rank; default ``max(1, cores // world_size)``.
    stream: outside Jupyter, print rank lines as they arrive instead of grouped by
        rank at the end (in Jupyter the cell always shows them live, then grouped).
    quiet: print nothing (results and errors are unchanged).
    share_tensors: return tensors through shared memory (default) or pickled
        through the pipe (slower for large tensors; kept for comparison).
    env: variables for this launch only, on top of ``os.environ`` as it is now
        (a value of None removes the variable). Every rank starts with that
        environment, applied before its process group is created, so that
        ``NCCL_*``, ``TORCH_DISTRIBUTED_DEBUG`` and the like take effect.
    """
    the_plan = hardware.plan(world_size, backend, threads)
    _check_importable(fn)
    timeout = _positive("timeout", timeout)
    collective_timeout = _positive("collective_timeout", timeout if collective_timeout is None else collective_timeout)
    task = Task(
        world_size=world_size,
        backend=the_plan.backend,
        threads=the_plan.threads,
        port=0,  # set once the store listens, after every check has passed
        run_id=uuid.uuid4().hex,
        collective_timeout=collective_timeout,
        init_process_group=init_process_group,
        share_tensors=share_tensors,
        start_method=multiprocessing.get_context().get_start_method(),  # the default, without fixing it
        payload=_dumps((fn, tuple(args), dict(kwargs or {}))),
        language=i18n.language(),
        environ=rank_environment(env),
    )
    output = RankOutput(world_size, quiet=quiet, stream=stream)
    output.say(f"launch: {the_plan.describe()}\n")  # "launch:" is a fixed tag; the description is translated
    started = time.monotonic()
    run = _run_to_the_end(task, timeout, output)
    results = Results(r.reply.value for r in run.ranks)
    results.seconds, results.plan, results.outputs = time.monotonic() - started, the_plan, output.texts()
    return results


def _run_to_the_end(task: Task, timeout: float, output: RankOutput) -> _Run:
    """Start the ranks, wait for them, stop everything; raise if a rank failed or time ran out."""
    ctx = _context()
    started = time.monotonic()
    store, port = _listening_store() if task.init_process_group else (None, 0)
    run = _Run(dataclasses.replace(task, port=port), timeout, output)
    try:
        run.start(ctx)
        run.wait(started)
    finally:
        run.stop()
        output.close()
        del store
    failure = run.outcome()
    running = [r.index for r in run.ranks if not isinstance(r.reply, Returned) and failure is None]
    if running:
        raise LaunchTimeout(timeout, running, output.texts())
    if failure is not None:
        raise RankFailed(failure[0], failure[1], output.texts())
    return run
