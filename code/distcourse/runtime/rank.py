"""What runs inside each rank process started by :func:`distcourse.launch`.

The parent hands every rank a :class:`~.messages.Task`, a duplex connection (the one
reply goes up; :data:`~.messages.RECEIVED` and, finally, end-of-file come down) and the
write end of a pipe that becomes the rank's stdout and stderr, so that everything the
rank prints, Python or C++, reaches the notebook cell.

A rank is an ordinary (non-daemon) process and may start processes of its own:
DataLoader workers, a ``multiprocessing.Pool``, ``subprocess.run``. It first makes
itself the leader of a new session, so that the launcher can stop it and everything
it started with one ``killpg`` (see ``processes.py``), and so that if the notebook's
kernel dies, the rank can take its whole group with it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from . import hardware, i18n
from .messages import RECEIVED, Failed, Returned, Task, dumps

RECEIPT_TIMEOUT_S = 120.0  # how long a finished rank waits for the parent to read its reply


class _Parent:
    """Watches the connection to the launcher in a thread.

    End-of-file before the rank has finished means the launcher is gone (a crashed or
    killed kernel): the rank then kills its own process group, itself and its children
    included, because multiprocessing has no such guard for children of the fork server
    and a rank blocked in a collective would otherwise live on.
    """

    def __init__(self, conn):
        self.conn = conn
        self.finished = threading.Event()
        self.received = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        try:
            while self.conn.recv_bytes() != RECEIVED:
                pass
        except (EOFError, OSError):
            if not self.finished.is_set():
                os.killpg(os.getpgrp(), signal.SIGKILL)
        self.received.set()

    def reply(self, reply: Returned | Failed, share_tensors: bool) -> None:
        if self.finished.is_set():
            return  # one reply per rank: the first (the cause) wins
        data = dumps(reply, share_tensors)
        sys.stdout.flush()
        sys.stderr.flush()
        self.finished.set()
        self.conn.send_bytes(data)

    def wait_until_received(self) -> None:
        self.received.wait(RECEIPT_TIMEOUT_S)


def _redirect_output(output) -> None:
    fd = output.fileno()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    output.close()
    # A pipe is block-buffered by default; line buffering keeps prints and
    # tracebacks in the order the rank wrote them.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def run_rank(rank: int, task: Task, conn, output) -> None:
    os.setsid()  # a session (and process group) of its own; see the module docstring
    _redirect_output(output)
    parent = _Parent(conn)
    try:
        value = _run(rank, task, parent)
    except BaseException:  # SystemExit and KeyboardInterrupt in a rank are failures too
        parent.reply(Failed(traceback.format_exc(), time.time()), task.share_tensors)
        sys.exit(1)
    try:
        parent.reply(Returned(value), task.share_tensors)
    except Exception as exc:  # the return value itself cannot travel back
        message = (
            i18n.tr("rank {rank} returned a value that cannot be pickled: {error}").format(rank=rank, error=repr(exc))
            + "\n"
        )
        parent.reply(Failed(message, time.time()), False)  # not sent yet: the pickling failed first
        sys.exit(1)
    parent.wait_until_received()


def _call(fn, args, kwargs, parent: _Parent, share_tensors: bool):
    try:
        return fn(*args, **kwargs)
    except BaseException:
        # Report before the process group is torn down: once this rank leaves,
        # the others fail too ("connection closed by peer"), and the parent
        # must hear about the cause first.
        parent.reply(Failed(traceback.format_exc(), time.time()), share_tensors)
        raise


def _set_environment(rank: int, task: Task) -> None:
    """The launching process's environment (``Task.environ``), then this rank's own variables."""
    if task.environ:
        os.environ.clear()
        os.environ.update(dict(task.environ))
        # torch.distributed read TORCH_DISTRIBUTED_DEBUG when the fork server imported it: read it again.
        dist.set_debug_level_from_env()
    loopback = hardware.loopback_interface()
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(task.world_size),
            "LOCAL_WORLD_SIZE": str(task.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(task.port),
            # gloo would otherwise bind to the address the hostname resolves to.
            "GLOO_SOCKET_IFNAME": loopback,
            "NCCL_SOCKET_IFNAME": loopback,
        }
    )


def _run(rank: int, task: Task, parent: _Parent):
    _set_environment(rank, task)
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before the rank started; ranks must start CUDA-free")
    torch.set_num_threads(task.threads)
    # A child of the fork server inherits "forkserver" as its default start method; give the
    # rank the launching process's default instead, as a script under torchrun has: on Linux
    # with Python <= 3.13 that is "fork", and DataLoader workers start in milliseconds rather
    # than importing torch afresh in a new interpreter each.
    multiprocessing.set_start_method(task.start_method, force=True)
    i18n.use(task.language)  # the rank speaks the notebook's language
    fn, args, kwargs = pickle.loads(task.payload)
    if not task.init_process_group:
        return _call(fn, args, kwargs, parent, task.share_tensors)

    timeout = datetime.timedelta(seconds=task.collective_timeout)
    device_id = None
    if task.backend == "nccl":
        # Before init_process_group: NCCL binds its communicator to the current device,
        # and device_id lets it create the communicator eagerly on the right GPU.
        # (torch rejects device_id for CPU-only groups, so it is given on GPUs only.)
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
    store = dist.TCPStore("127.0.0.1", task.port, is_master=False, timeout=timeout)
    try:
        _init_process_group(task, rank, store, timeout, device_id)
        return _call(fn, args, kwargs, parent, task.share_tensors)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


INIT_ATTEMPTS = 3


def _init_process_group(task: Task, rank: int, store, timeout, device_id) -> None:
    """``init_process_group`` that retries when gloo's connection mesh fails.

    With several launches at once on a busy machine, about 1 launch in 100
    failed inside gloo's ``connectFullMesh`` ("Connection closed by peer")
    before any user code ran. Every rank votes in the store after each attempt;
    the group is kept only if all ranks succeeded, otherwise all of them retry
    under a fresh key prefix, so no rank can go on with a half-built group.
    """
    extra = {"device_id": device_id} if device_id is not None else {}
    for attempt in range(INIT_ATTEMPTS):
        prefix = f"{task.run_id}/{attempt}"
        error = None
        try:
            dist.init_process_group(
                task.backend,
                store=dist.PrefixStore(prefix, store),
                rank=rank,
                world_size=task.world_size,
                timeout=timeout,
                **extra,
            )
        except RuntimeError as exc:
            if attempt == INIT_ATTEMPTS - 1:
                raise
            error = exc
        store.set(f"{prefix}/vote/{rank}", "ok" if error is None else "retry")
        votes = [store.get(f"{prefix}/vote/{r}") for r in range(task.world_size)]
        if all(vote == b"ok" for vote in votes):
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        if error is not None:
            print(
                i18n.tr("init_process_group attempt {attempt} failed, retrying: {error}").format(
                    attempt=attempt + 1, error=str(error)[:200]
                ),
                file=sys.stderr,
            )
