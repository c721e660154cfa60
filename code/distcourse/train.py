"""One training script for one process or many (chapter 07).

    python -m distcourse.train --batch-size 16                       # one process
    torchrun --standalone --nproc-per-node 2 -m distcourse.train --batch-size 8

Whether it runs distributed is decided by the environment, as in nanoGPT's train.py:
torchrun sets RANK (and WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) for every worker it
starts; a plain ``python`` run has no RANK. ``--batch-size`` is per process, so the two
commands above train on the same global batch of 16 and end with the same weights.

Only the master process (global rank 0) logs losses and writes files. With ``--ckpt-dir``
it saves the training state every ``--save-every`` steps and, when it starts, continues
from the newest checkpoint there: that is what lets torchrun restart a crashed job
(``--max-restarts``) without losing more than the steps since the last save.
"""

from __future__ import annotations

import argparse
import datetime
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

from . import checkpoints

# What --print-env shows: the variables torchrun sets for each worker, and CUDA_VISIBLE_DEVICES,
# which it does not set (unless --virtual-local-rank): workers inherit it from the agent.
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
# Setting up and tearing down the process group
# --------------------------------------------------------------------------------------


def choose_device(local_rank: int, local_world_size: int) -> tuple[torch.device, str]:
    """One GPU per process if this node has enough of them, else the CPU (gloo).

    ``cuda:LOCAL_RANK`` is unique on a machine only if one agent runs there: several torchrun
    agents on one machine (chapter 07's simulated nodes) all start at LOCAL_RANK 0, so each
    must be started with GPUs of its own (``torchrun_tools.node_envs``).
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(backend: str, device: torch.device, timeout: float) -> dict:
    """init_process_group for a torchrun worker, safe to repeat after an elastic restart.

    Workers meet in a key-value store at MASTER_ADDR:MASTER_PORT: each rank writes its
    address there under a fixed key and reads the others'. Which store that is decides
    whether a restart works:

    - ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment (workers then see
      ``TORCHELASTIC_USE_AGENT_STORE=False``): in every rendezvous round the agent of node 0
      picks a new free port and publishes it through that round of the rendezvous, which
      all nodes read alike; worker rank 0 hosts a new, empty store there. Plain ``env://``.
    - torchrun's default (``TORCHELASTIC_USE_AGENT_STORE=True``): the store belongs to node
      0's agent and outlives restarts, still holding the keys of the crashed attempt, which
      a new worker may read before its peer has replaced them. Each attempt then needs a
      key of its own. The only one a worker is given is ``TORCHELASTIC_RESTART_COUNT``,
      and that count is kept by each agent: on one node it names every attempt uniquely,
      but with several nodes a node restarted by a peer's failure or by a joining node
      does not count that restart (and a node that joins late starts at 0). Ranks on
      different nodes would wait under different names until the timeout. So: the prefix
      ``attempt<count>/`` on one node, and a clear error where it cannot be right.

    Returns what the chapter shows: the kind of store, and the keys that earlier attempts
    left in the agent's store.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    limit = datetime.timedelta(seconds=timeout)  # gloo's default would be 30 minutes
    # NCCL binds its communicator to the device given here; torch refuses device_id on the CPU.
    on_gpu = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init_process_group: NCCL starts on this GPU
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # A new store every rendezvous round (or not torchrun at all): nothing stale to avoid.
        dist.init_process_group(backend, init_method="env://", timeout=limit, **on_gpu)
        return {"store": "new each round", "left_over": []}
    nodes, restarts = env_int("GROUP_WORLD_SIZE", default=1), env_int("TORCHELASTIC_MAX_RESTARTS", default=0)
    if nodes > 1 and restarts > 0:
        raise ValueError(
            f"{nodes} nodes with --max-restarts={restarts} and torchrun's shared store: restart "
            "counts differ between nodes, so attempts cannot be told apart. Start every torchrun "
            "agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a new store each rendezvous round)"
        )
    launcher_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=limit
    )
    prefix = f"attempt{attempt}/"
    left_over = keys_left_over(launcher_store, prefix)
    store = dist.PrefixStore(prefix, launcher_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=limit, **on_gpu)
    return {"store": "agent's, prefix " + prefix, "left_over": left_over}


def keys_left_over(store, prefix: str) -> list[str] | None:
    """Keys in ``store`` outside ``prefix``; None where this torch cannot list a TCPStore."""
    try:
        return sorted(k for k in store.list_keys() if not k.startswith(prefix))
    except (AttributeError, NotImplementedError, RuntimeError):
        return None


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
    path = checkpoints.checkpoint_path(directory, step)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    checkpoints.atomic_save(state, path)  # chapter 05: a crash mid-save never leaves a partial file
    return path


def resume(directory: pathlib.Path | None, model, optimizer) -> tuple[int, str | None]:
    """Load the newest checkpoint in ``directory`` if there is one; returns (step, its name)."""
    path = checkpoints.latest_checkpoint(directory) if directory is not None else None
    if path is None:
        return 0, None
    state = checkpoints.load_checkpoint(path, map_location="cpu")  # torch.load(weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # SGD's momentum buffers
    return state["step"], path.name


# --------------------------------------------------------------------------------------
# The script
# --------------------------------------------------------------------------------------


def say(rank: int, text: str) -> None:
    # One write per line: workers share the launcher's stdout, and a line written in one
    # call is not broken up by another rank's output.
    sys.stdout.write(f"[rank {rank}] {text}\n")
    sys.stdout.flush()


def env_int(name: str, default: int | None = None, minimum: int = 0) -> int:
    """An integer the launcher put in the environment, or a clear error if it is not one."""
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"{name} is not set: run this script with torchrun, or unset RANK to run one process")
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; let torchrun set it") from None
    if number < minimum:
        raise ValueError(f"{name}={number} must be at least {minimum}")
    return number


def check_launcher_env() -> None:
    """Refuse launcher variables that are missing, not integers, or inconsistent."""
    env_int("TORCHELASTIC_RESTART_COUNT", default=0)
    if env_int("RANK", default=-1, minimum=-1) == -1:
        return  # one process
    rank, local_rank = env_int("RANK"), env_int("LOCAL_RANK")
    world_size, local_world_size = env_int("WORLD_SIZE", minimum=1), env_int("LOCAL_WORLD_SIZE", minimum=1)
    if not (rank < world_size and local_rank < local_world_size):
        raise ValueError(
            f"RANK={rank} / LOCAL_RANK={local_rank} do not fit WORLD_SIZE={world_size} / "
            f"LOCAL_WORLD_SIZE={local_world_size}; let torchrun set these variables"
        )


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
        where = f"{dist.get_backend()} on {device}" if distributed else f"one process on {device}"
        say(
            rank,
            f"attempt {attempt}: world size {world_size} ({where}), global batch "
            f"{world_size * args.batch_size}, {torch.get_num_threads()} thread(s) per process",
        )
        if resumed_from:
            say(rank, f"resumed from step {start} ({resumed_from})")
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if distributed else model
    data = make_data(args.seed)
    if args.out and master_process:
        args.out.mkdir(parents=True, exist_ok=True)

    loss = torch.zeros(())
    # One bar, on the master process only: every rank drawing its own would interleave. tqdm
    # writes to stderr; in a log file (a SLURM job, a notebook capturing the output) each
    # redraw would be a line of its own, so "auto" draws only on a terminal (disable=None).
    show = {"auto": None, "on": False, "off": True}[args.progress]
    bar = tqdm(
        range(start, args.steps),
        initial=start,
        total=args.steps,
        unit="step",
        desc=f"rank {rank}, attempt {attempt}",
        disable=show if master_process else True,
    )
    for step in bar:
        if step == args.hang_at and rank == world_size - 1:
            say(rank, f"simulated hang before step {step}")
            time.sleep(3600)
        x, y = (t.to(device) for t in batch_for(data, step, rank, world_size, args.batch_size))
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # under DDP: gradients averaged over all ranks
        if step == args.crash_at and attempt == 0 and rank == world_size - 1:
            # After the backward pass: every rank has finished (and logged) the previous step.
            say(rank, f"simulated crash in step {step}")
            os._exit(1)  # no exception, no cleanup: like a segfault or a lost node
        optimizer.step()
        if args.step_seconds:
            time.sleep(args.step_seconds)
        loss = global_mean(loss.detach())  # the loss of the whole global batch
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        if master_process and args.out:
            with open(args.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item(), "attempt": attempt}) + "\n")
        if args.ckpt_dir and (step + 1) % args.save_every == 0:
            if master_process:
                args.ckpt_dir.mkdir(parents=True, exist_ok=True)
                say(rank, f"step {step + 1}: checkpoint {save_state(args.ckpt_dir, model, optimizer, step + 1).name}")
            if distributed:
                dist.barrier()  # nobody runs ahead of a checkpoint that is still being written

    bar.close()
    if master_process:
        if args.out:
            checkpoints.atomic_save({k: v.cpu() for k, v in model.state_dict().items()}, args.out / "final.pt")
        say(
            rank,
            "result "
            + json.dumps(
                {"steps": args.steps, "world_size": world_size, "loss": loss.item(), "checksum": checksum(model)}
            ),
        )


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
    main()
