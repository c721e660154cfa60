"""The job that launch_bench.py starts three ways, and its torchrun entry point.

It lives in its own module, not in launch_bench.py, because every launcher
starts ranks that import the job by module name, and a function defined in the
script being run (``__main__``) cannot be found that way.

Run directly (``torchrun ... launch_jobs.py``) it is the torchrun job.
"""

import datetime
import os

import torch
import torch.distributed as dist

# A rank that waits on a peer which never comes should fail within a minute,
# not after gloo's 30-minute default.
TIMEOUT = datetime.timedelta(seconds=60)


def all_reduce_check() -> float:
    """One all_reduce of a small tensor; fails loudly if the sum is wrong."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tensor = torch.full((4,), float(rank + 1))
    dist.all_reduce(tensor)
    expected = world_size * (world_size + 1) / 2  # 1 + 2 + ... + world_size
    assert torch.all(tensor == expected), f"rank {rank}: all_reduce gave {tensor.tolist()}, expected {expected}"
    return float(tensor[0])


def spawn_job(rank: int, world_size: int, port: int) -> None:
    """The job under mp.spawn: it gets only its rank, so it joins the group itself."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        all_reduce_check()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # torchrun has put RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment.
    dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        all_reduce_check()
    finally:
        dist.destroy_process_group()


def big_result(megabytes: int, keep: bool = True):
    """Every rank returns ``megabytes`` MB of float32 filled with its rank (results_bench.py).

    ``keep=False`` makes the same tensor and returns None: the baseline that costs all but the trip back.
    """
    tensor = torch.full((megabytes * 2**20 // 4,), float(dist.get_rank()))
    return tensor if keep else None
