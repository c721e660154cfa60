"""What runs inside each rank process started by :func:`distcourse.launch`.

The parent hands every rank three things: a pickled task, a duplex connection
(results go up; its end-of-file tells the rank that the parent is gone) and
the write end of a pipe that becomes the rank's stdout and stderr, so that
everything the rank prints, Python or C++, reaches the notebook cell.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from . import hardware


_finished = threading.Event()


def _watch_parent(conn) -> None:
    """Exit as soon as the launching process goes away, unless the rank is done.

    multiprocessing has no such guard for children of the fork server, and a
    rank blocked in a collective would otherwise outlive a crashed kernel.
    """
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    if not _finished.is_set():
        os._exit(70)


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


class _Reporter:
    """Sends the rank's one reply to the parent: ("ok", value) or ("error", traceback, time)."""

    def __init__(self, conn, rank: int):
        self.conn, self.rank, self.sent = conn, rank, False

    def error(self) -> None:
        self._send(("error", traceback.format_exc(), time.time()))

    def ok(self, value) -> None:
        try:
            payload = pickle.dumps(("ok", value))
        except Exception as exc:  # the return value itself cannot travel back
            message = f"rank {self.rank} returned a value that cannot be pickled: {exc!r}\n"
            raise RuntimeError(message) from None
        self._send(payload)

    def _send(self, reply) -> None:
        if self.sent:
            return
        self.sent = True
        sys.stdout.flush()
        sys.stderr.flush()
        _finished.set()
        self.conn.send_bytes(reply if isinstance(reply, bytes) else pickle.dumps(reply))


def run_rank(rank: int, task: dict, conn, output) -> None:
    _redirect_output(output)
    threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    reporter = _Reporter(conn, rank)
    try:
        reporter.ok(_run(rank, task, reporter))
    except BaseException:  # SystemExit and KeyboardInterrupt in a rank are failures too
        reporter.error()
        sys.exit(1)


def _call(fn, args, kwargs, reporter):
    try:
        return fn(*args, **kwargs)
    except BaseException:
        # Report before the process group is torn down: once this rank leaves,
        # the others fail too ("connection closed by peer"), and the parent
        # must hear about the cause first.
        reporter.error()
        raise


def _run(rank: int, task: dict, reporter):
    world_size = task["world_size"]
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(task["port"]),
            # gloo would otherwise bind to the address the hostname resolves to.
            "GLOO_SOCKET_IFNAME": hardware.loopback_interface(),
            "NCCL_SOCKET_IFNAME": hardware.loopback_interface(),
        }
    )
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before the rank started; ranks must start CUDA-free")
    torch.set_num_threads(task["threads"])
    fn, args, kwargs = pickle.loads(task["payload"])
    if not task["init_process_group"]:
        return _call(fn, args, kwargs, reporter)

    timeout = datetime.timedelta(seconds=task["collective_timeout"])
    if task["backend"] == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", task["port"], is_master=False, timeout=timeout)
    try:
        _init_process_group(task, rank, store, timeout)
        return _call(fn, args, kwargs, reporter)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


INIT_ATTEMPTS = 3


def _init_process_group(task: dict, rank: int, store, timeout) -> None:
    """``init_process_group`` that retries when gloo's connection mesh fails.

    With several launches at once on a busy machine, about 1 launch in 100
    failed inside gloo's ``connectFullMesh`` ("Connection closed by peer")
    before any user code ran. Every rank votes in the store after each attempt;
    the group is kept only if all ranks succeeded, otherwise all of them retry
    under a fresh key prefix, so no rank can go on with a half-built group.
    """
    world_size = task["world_size"]
    for attempt in range(INIT_ATTEMPTS):
        prefix = f"{task['run_id']}/{attempt}"
        error = None
        try:
            dist.init_process_group(
                task["backend"],
                store=dist.PrefixStore(prefix, store),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        except RuntimeError as exc:
            if attempt == INIT_ATTEMPTS - 1:
                raise
            error = exc
        store.set(f"{prefix}/vote/{rank}", "ok" if error is None else "retry")
        votes = [store.get(f"{prefix}/vote/{r}") for r in range(world_size)]
        if all(vote == b"ok" for vote in votes):
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        if error is not None:
            print(f"init_process_group attempt {attempt + 1} failed, retrying: {str(error)[:200]}", file=sys.stderr)
