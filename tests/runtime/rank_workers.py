"""Rank functions used by test_launcher.py (rank processes import them by name)."""

import os
import signal
import time

import torch
import torch.distributed as dist


def rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def chatty(lines=3):
    rank = dist.get_rank()
    if rank == 0:
        time.sleep(0.2)  # rank 1 prints first; the cell must still show rank 0 first
    for i in range(lines):
        print(f"line {i} of rank {rank}")
    os.write(2, f"raw fd-2 write of rank {rank}\n".encode())
    return rank


def threads_and_env():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return torch.get_num_threads(), {k: os.environ[k] for k in keys}, os.getpid()


def raise_on(rank_to_fail=1):
    if dist.get_rank() == rank_to_fail:
        raise ValueError(f"deliberate failure on rank {rank_to_fail}")
    dist.barrier()  # the healthy rank waits for the failed one: the launcher must stop it
    time.sleep(60)


def exit_with(code=3):
    if dist.get_rank() == 1:
        os._exit(code)
    time.sleep(60)


def kill_self():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def sleep_forever(pid_dir=None):
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{dist.get_rank()}.pid"), "w") as f:
            f.write(str(os.getpid()))
    time.sleep(600)


def uneven_barrier():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(30)


def unpicklable_result():
    return lambda: None


def sleep_then_return(seconds=1.5):
    time.sleep(seconds)
    return dist.get_rank()


def no_process_group():
    return dist.is_initialized(), int(os.environ["RANK"])


class Payload:
    """A class that lives in a module, so ranks can unpickle it."""

    def __init__(self, value):
        self.value = value


def echo(payload):
    return payload.value * (dist.get_rank() + 1)


def killed_mid_collective():
    """Rank 1 dies (SIGKILL) while rank 0 waits for it in all_reduce."""
    t = torch.ones(1)
    for step in range(1000):
        if dist.get_rank() == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
    return t.item()
