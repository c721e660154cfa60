"""One training script for one process or many (chapter 07).

    python -m distcourse.train --batch-size 16                       # one process
    torchrun --standalone --nproc-per-node 2 -m distcourse.train --batch-size 8

Whether it runs distributed is decided by the environment, as in nanoGPT's train.py:
torchrun sets RANK (and WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) for every worker it
starts; a plain ``python`` run has no RANK. ``--batch-size`` is per process, so the two
commands above train on the same global batch of 16 and end with the same weights.

Builds on: ``common/distributed.py`` (process group setup, shared with chapter 12's
capstone) and ``common/checkpoint_files.py`` (chapter 05's atomic saves).

Only the master process (global rank 0) logs losses and writes files. With ``--ckpt-dir``
it saves the training state every ``--save-every`` steps and, when it starts, continues
from the newest checkpoint there: that is what lets torchrun restart a crashed job
(``--max-restarts``) without losing more than the steps since the last save.

Sentences for people are in the reader's language (``DISTCOURSE_LANG``, English without it).
What code reads back is a line of its own, a tag that no sentence begins with and JSON, the
same in every language: ``result {...}``, ``resume {...}``, ``crash {...}``, ``worker {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm  # the console bar: the script runs in terminals and log files

from .common.checkpoint_files import atomic_save, checkpoint_path, latest_checkpoint, load_checkpoint
from .common.distributed import check_launcher_env, choose_device, init_distributed, say
from .runtime.i18n import number, script_language, tr, use

# What --print-env shows: the variables torchrun sets for each worker, and CUDA_VISIBLE_DEVICES,
# which it does not set (unless --virtual-local-rank): workers inherit it from the agent.
# Two of them torchrun sets only where they are unset (torch 2.13): OMP_NUM_THREADS=1 when a
# node runs several workers (torch/distributed/run.py:872-884), and
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (torch/distributed/elastic/agent/server/local_elastic_agent.py:430-432).
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="samples per process and step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, help="the master writes final.pt and losses.jsonl here")
    p.add_argument("--ckpt-dir", type=pathlib.Path, help="save training state here; resume from it")
    p.add_argument("--save-every", type=int, default=5)
    # 60 s suits the chapter's small runs on one machine; a cluster job waits longer for good
    # reasons (rank 0 writing a checkpoint, an evaluation): the SLURM script passes 600.
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    p.add_argument("--print-env", action="store_true", help="each rank prints its torchrun variables")
    p.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="a progress bar on rank 0; auto: only when stderr is a terminal, not in log files",
    )
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step: a stand-in for a bigger model")
    # Fault injection, for the chapter's demonstrations of restarts and timeouts:
    p.add_argument("--crash-at", type=int, help="on the first attempt, the last rank dies in this step")
    p.add_argument("--hang-at", type=int, help="the last rank stops responding before this step")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------
# Model, data, checkpoints
# --------------------------------------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights in every process
    # float64: the chapter compares runs across launchers and devices to 1e-6, and wants that
    # margin to come from the distribution logic, never from rounding.
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()


def make_data(seed: int, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """A small classification task: 4 classes defined by a random linear 'teacher'."""
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(n, 16, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(16, 4, generator=g, dtype=torch.float64)).argmax(dim=1)
    return x, y


def batch_for(data, step: int, rank: int, world_size: int, batch_size: int):
    """This rank's slice of step ``step``'s global batch of ``world_size * batch_size`` samples.

    The global batch depends only on the step (a per-step permutation), so one process with
    batch 2B and two processes with B each train on exactly the same samples.
    """
    x, y = data
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(step))
    mine = order[: world_size * batch_size][rank * batch_size : (rank + 1) * batch_size]
    return x[mine], y[mine]


def save_state(directory: pathlib.Path, model, optimizer, step: int) -> pathlib.Path:
    path = checkpoint_path(directory, step)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    atomic_save(state, path)  # chapter 05: a crash mid-save never leaves a partial file
    return path


def resume(directory: pathlib.Path | None, model, optimizer) -> tuple[int, str | None]:
    """Load the newest checkpoint in ``directory`` if there is one; returns (step, its name)."""
    path = latest_checkpoint(directory) if directory is not None else None
    if path is None:
        return 0, None
    state = load_checkpoint(path, map_location="cpu")  # torch.load(weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # SGD's momentum buffers
    return state["step"], path.name


# --------------------------------------------------------------------------------------
# The script
# --------------------------------------------------------------------------------------


def main(argv=None) -> None:
    args = parse_args(argv)
    check_launcher_env()  # malformed values fail here with a clear message
    ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun (or another launcher)?
    rank = int(os.environ["RANK"]) if ddp else 0
    local_rank = int(os.environ["LOCAL_RANK"]) if ddp else 0
    world_size = int(os.environ["WORLD_SIZE"]) if ddp else 1
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"]) if ddp else 1
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    master_process = rank == 0  # logs and saves; the others only train
    device, backend = choose_device(local_rank, local_world_size)

    if args.print_env:  # one line per rank: who am I, what was I given
        env = {k: os.environ[k] for k in TORCHRUN_VARS if k in os.environ}
        say(rank, "worker " + json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "env": env}))
    if ddp:
        store = init_distributed(backend, device, args.timeout)
        if args.print_env and master_process:
            say(rank, "store " + json.dumps(store))
    try:
        train(args, rank, world_size, device, attempt, master_process)
    finally:
        if ddp:
            dist.destroy_process_group()  # also after an exception: no half-open connections


def train(args, rank: int, world_size: int, device, attempt: int, master_process: bool) -> None:
    distributed = dist.is_initialized()
    model = make_model(args.seed).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start, resumed_from = resume(args.ckpt_dir, model, optimizer)
    if master_process:
        announce(args, rank, world_size, device, attempt, start, resumed_from)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if distributed else model
    data = make_data(args.seed)
    if args.out and master_process:
        args.out.mkdir(parents=True, exist_ok=True)

    loss = torch.zeros(())
    bar = progress_bar(args, rank, attempt, start, master_process)
    for step in bar:
        if step == args.hang_at and rank == world_size - 1:
            say(rank, tr("simulated hang before step {step}").format(step=step))
            time.sleep(3600)
        x, y = (t.to(device) for t in batch_for(data, step, rank, world_size, args.batch_size))
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # under DDP: gradients averaged over all ranks
        if step == args.crash_at and attempt == 0 and rank == world_size - 1:
            # After the backward pass: every rank has finished (and logged) the previous step.
            say(rank, tr("simulated crash in step {step}").format(step=step))
            say(rank, "crash " + json.dumps({"step": step}))
            os._exit(1)  # no exception, no cleanup: like a segfault or a lost node
        optimizer.step()
        if args.step_seconds:
            time.sleep(args.step_seconds)
        loss = global_mean(loss.detach())  # the loss of the whole global batch
        bar.set_postfix({tr("loss"): number(loss.item(), 4)}, refresh=False)
        log_and_checkpoint(args, rank, step, loss, attempt, model, optimizer, master_process)
    bar.close()
    if master_process:
        finish(args, rank, world_size, model, loss)


def announce(args, rank, world_size, device, attempt, start, resumed_from) -> None:
    """The master process's first lines: how this attempt runs, and where it resumed."""
    if dist.is_initialized():
        where = tr("{backend} on {device}").format(backend=dist.get_backend(), device=device)
    else:
        where = tr("one process on {device}").format(device=device)
    say(
        rank,
        tr(
            "attempt {attempt}: world size {world_size} ({where}), global batch {batch}, "
            "{threads} thread(s) per process"
        ).format(
            attempt=attempt,
            world_size=world_size,
            where=where,
            batch=number(world_size * args.batch_size),
            threads=torch.get_num_threads(),
        ),
    )
    if resumed_from:
        say(rank, tr("resumed from step {step} ({checkpoint})").format(step=start, checkpoint=resumed_from))
        say(rank, "resume " + json.dumps({"step": start, "checkpoint": resumed_from}))


def progress_bar(args, rank: int, attempt: int, start: int, master_process: bool):
    """One bar, on the master process only: every rank drawing its own would interleave.

    tqdm writes to stderr; in a log file (a SLURM job, a notebook capturing the output) each
    redraw would be a line of its own, so "auto" draws only on a terminal (disable=None).
    """
    show = {"auto": None, "on": False, "off": True}[args.progress]
    return tqdm(
        range(start, args.steps),
        initial=start,
        total=args.steps,
        unit=tr("step"),
        desc=tr("rank {rank}, attempt {attempt}").format(rank=rank, attempt=attempt),
        disable=show if master_process else True,
    )


def log_and_checkpoint(args, rank, step, loss, attempt, model, optimizer, master_process) -> None:
    """The step's loss into losses.jsonl, and every ``save_every`` steps a checkpoint (rank 0 writes)."""
    if master_process and args.out:
        with open(args.out / "losses.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": loss.item(), "attempt": attempt}) + "\n")
    if args.ckpt_dir and (step + 1) % args.save_every == 0:
        if master_process:
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
            name = save_state(args.ckpt_dir, model, optimizer, step + 1).name
            say(rank, tr("step {step}: checkpoint {checkpoint}").format(step=step + 1, checkpoint=name))
        if dist.is_initialized():
            dist.barrier()  # nobody runs ahead of a checkpoint that is still being written


def finish(args, rank, world_size, model, loss) -> None:
    """The final weights (for one-process use) and the machine-readable result line."""
    if args.out:
        atomic_save({k: v.cpu() for k, v in model.state_dict().items()}, args.out / "final.pt")
    result = {
        "steps": args.steps,
        "world_size": world_size,
        "threads per process": torch.get_num_threads(),
        "loss": loss.item(),
        "checksum": checksum(model),
    }
    say(rank, "result " + json.dumps(result))


def global_mean(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.cpu()


def checksum(model: nn.Module) -> float:
    """One number that changes with any weight: enough to compare runs at a glance."""
    return sum(p.detach().double().abs().sum().item() for p in model.parameters())


if __name__ == "__main__":
    use(script_language())  # a program has no notebook to ask: DISTCOURSE_LANG, or English
    main()
