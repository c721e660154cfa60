"""The basic DistributedDataParallel program, started with ``mp.spawn``.

    python -m distcourse.scripts.ddp_spawn_example [--world-size 2]

Every rank builds a tiny model, joins the process group, wraps the model in DDP,
takes one optimizer step on its own random batch and leaves the group. The ranks
start from *different* random weights on purpose: DDP copies rank 0's weights to
every rank when it wraps the model, so they agree anyway.

What the ranks print is in the language of the notebook that started the program
(``DISTCOURSE_LANG``), English otherwise; the ``result`` line is for programs to read.
"""

import argparse
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distcourse.runtime import i18n


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))

    def forward(self, x):
        return self.net(x)


def free_port() -> int:
    """Bind to port 0 and the OS picks a free port (never hard-code one: it may be taken)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def say(line: str) -> None:
    """Print a line in one write: the ranks share this terminal, and print() may write the
    text and the newline separately, letting another rank's line slip in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def speak_the_notebooks_language() -> None:
    """Print in the language of the notebook that started this program (or English)."""
    i18n.use(i18n.script_language())


def checksum(model: nn.Module) -> float:
    return sum(p.detach().double().sum().item() for p in model.parameters())


def rank_device(rank: int, world_size: int) -> torch.device:
    """This rank's accelerator (a CUDA GPU, or XPU, MPS...) if there is one per rank, else the CPU."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and torch.accelerator.device_count() >= world_size:
        return torch.device(accelerator.type, rank)
    return torch.device("cpu")


def join_group(rank: int, world_size: int, device: torch.device) -> str:
    """Join the process group with the backend that suits ``device``; returns the backend."""
    backend = dist.get_default_backend_for_device(device)  # nccl for CUDA, gloo for the CPU
    options = {}
    if device.type != "cpu":
        # First: NCCL and the caching allocator start on the current GPU, which is GPU 0 until
        # set otherwise; every rank would then put a context (and its memory) on GPU 0.
        torch.accelerator.set_device_index(device.index)
        options["device_id"] = device  # binds the group to this GPU at once (refused on the CPU)
    # An explicit timeout: by default a stuck rank would wait 10 to 30 minutes.
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **options)
    return backend


def train(rank: int, world_size: int, port: int) -> None:
    """What every rank runs; mp.spawn passes the rank as the first argument."""
    speak_the_notebooks_language()  # a new interpreter: nothing of main()'s state came along
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # rank 0 listens here, the others connect
    os.environ["MASTER_PORT"] = str(port)
    # gloo connects over the interface the hostname resolves to; on one machine, use loopback
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    device = rank_device(rank, world_size)
    backend = join_group(rank, world_size, device)
    try:
        torch.manual_seed(rank)  # different initial weights on every rank...
        model = ToyModel().to(device)
        before = checksum(model)
        ids = [device.index] if device.type != "cpu" else None  # the one device this rank drives
        ddp = DDP(model, device_ids=ids)  # ...until DDP broadcasts rank 0's
        wrapped = checksum(model)

        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        x, y = torch.randn(20, 10, device=device), torch.randn(20, 5, device=device)  # this rank's data
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP averages the gradients across ranks during backward
        optimizer.step()
        after = checksum(model)
        text = i18n.tr(
            "rank {rank}/{world} ({backend}, {device}): loss {loss} | weight sum "
            "before DDP {before} | after wrapping {wrapped} | after the step {after}"
        )
        numbers = {"before": before, "wrapped": wrapped, "after": after}
        shown = {name: i18n.number(value, 6) for name, value in numbers.items()}
        say(
            text.format(
                rank=rank, world=world_size, backend=backend, device=device, loss=i18n.number(loss.item(), 4), **shown
            )
        )
        say("result " + json.dumps({"rank": rank, **numbers}))  # the same numbers, for a program to read
    finally:
        dist.destroy_process_group()  # always leave the group, even after an error


def main() -> None:
    speak_the_notebooks_language()
    parser = argparse.ArgumentParser(description="the basic DDP example, started with mp.spawn")
    parser.add_argument("--world-size", type=int, default=2)
    world_size = parser.parse_args().world_size
    port = free_port()
    say(i18n.tr("spawning {n} ranks; MASTER_ADDR=127.0.0.1 MASTER_PORT={port}").format(n=world_size, port=port))
    # A new Python interpreter per rank; join=True waits for all of them and raises if one fails.
    mp.spawn(train, args=(world_size, port), nprocs=world_size, join=True)
    say(i18n.tr("all ranks finished"))


if __name__ == "__main__":
    main()
