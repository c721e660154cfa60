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


def run_rank(rank: int, task: dict, conn, output) -> None:
    _redirect_output(output)
    threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    exit_code = 0
    try:
        reply = ("ok", _run(rank, task))
        try:
            payload = pickle.dumps(reply)
        except Exception as exc:  # the return value itself cannot travel back
            reply = ("error", f"rank {rank} returned a value that cannot be pickled: {exc!r}\n")
            payload = pickle.dumps(reply)
            exit_code = 1
    except BaseException:  # SystemExit and KeyboardInterrupt in a rank are failures too
        payload = pickle.dumps(("error", traceback.format_exc()))
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    _finished.set()
    conn.send_bytes(payload)
    sys.exit(exit_code)


def _run(rank: int, task: dict):
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
        return fn(*args, **kwargs)

    timeout = datetime.timedelta(seconds=task["collective_timeout"])
    if task["backend"] == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", task["port"], is_master=False, timeout=timeout)
    try:
        dist.init_process_group(
            task["backend"],
            store=dist.PrefixStore(task["run_id"], store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        return fn(*args, **kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
