"""A torchrun script in which one rank fails at step 1: by an exception, or killed by a signal.

    torchrun --standalone --nproc-per-node=2 -m distcourse.scripts.crashing_train --fail exception
    torchrun --standalone --nproc-per-node=2 -m distcourse.scripts.crashing_train --fail sigkill

``@record`` (torch.distributed.elastic) catches an exception that leaves ``main``, writes it
with its traceback to the error file torchrun gave this worker (``TORCHELASTIC_ERROR_FILE``),
and re-raises it; torchrun then names the first failure as the root cause. A worker killed by
a signal (the kernel's out-of-memory killer sends SIGKILL) writes nothing: torchrun can only
report the signal. Chapter 11 runs both.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from distcourse.runtime import i18n


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fail", choices=("exception", "sigkill"), default="exception")
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails (default 1)")
    args = parser.parse_args()
    i18n.use(i18n.script_language())  # the notebook's language (DISTCOURSE_LANG), English without one
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    for step in range(3):
        if step == 1 and rank == args.rank:
            if args.fail == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
            # "rank N:" stays as it is: chapter 11 reads it back from the error file
            raise ValueError(f"rank {rank}: " + i18n.tr("batch {step} has no labels").format(step=step))
        if step == 1:
            # The others are still computing when that rank fails. torchrun dates failures to
            # the second and breaks ties by rank, so a peer's "connection closed" error in the
            # same second would be named the root cause; a longer step keeps them apart.
            time.sleep(2)
        dist.all_reduce(torch.ones(1))
        print(i18n.tr("rank {rank} finished step {step}").format(rank=rank, step=step), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
