"""Starting a torchrun worker: read the launcher's environment, pick device and backend,
initialise the process group so that elastic restarts work.

Chapter 07's ``train.py`` and chapter 12's capstone are both scripts that torchrun starts;
this is what they share, so neither imports the other. Also ``pretend_ranks``: a process group
of any size inside one process that sends nothing, for memory estimates (chapters 08 and 09).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist

from ..runtime.i18n import tr

# --------------------------------------------------------------------------------------
# Setting up and tearing down the process group
# --------------------------------------------------------------------------------------


def choose_device(local_rank: int, local_world_size: int) -> tuple[torch.device, str]:
    """One GPU per process if this node has enough of them, else the CPU (gloo).

    ``cuda:LOCAL_RANK`` is unique on a machine only if one agent runs there: several torchrun
    agents on one machine (chapter 07's simulated nodes) all start at LOCAL_RANK 0, so each
    must be started with GPUs of its own (``common.subprocesses.node_envs``).
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
            tr(
                "{nodes} nodes with --max-restarts={restarts} and torchrun's shared store: restart "
                "counts differ between nodes, so attempts cannot be told apart. Start every torchrun "
                "agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a new store each rendezvous round)"
            ).format(nodes=nodes, restarts=restarts)
        )
    launcher_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=limit
    )
    prefix = f"attempt{attempt}/"
    left_over = keys_left_over(launcher_store, prefix)
    store = dist.PrefixStore(prefix, launcher_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=limit, **on_gpu)
    return {"store": "agent's, prefix " + prefix, "left_over": left_over}


def store_text(store: str) -> str:
    """What :func:`init_distributed` reports about the store (``"store"``), in the reader's words."""
    if store == "new each round":
        return tr("new each round")
    return tr("the agent's, prefix {prefix}").format(prefix=store.removeprefix("agent's, prefix "))


def keys_left_over(store, prefix: str) -> list[str] | None:
    """Keys in ``store`` outside ``prefix``: what earlier attempts left behind.

    None where this torch cannot list a TCPStore.
    """
    try:
        return sorted(k for k in store.list_keys() if not k.startswith(prefix))
    except (AttributeError, NotImplementedError, RuntimeError):
        return None


# --------------------------------------------------------------------------------------
# The launcher's environment
# --------------------------------------------------------------------------------------


def say(rank: int, text: str) -> None:
    """Print one line tagged ``[rank R]``, the form ``common.subprocesses.per_rank`` reads back."""
    # One write per line: workers share the launcher's stdout, and a line written in one
    # call is not broken up by another rank's output.
    sys.stdout.write(f"[rank {rank}] {text}\n")
    sys.stdout.flush()


def env_int(name: str, default: int | None = None, minimum: int = 0) -> int:
    """An integer the launcher put in the environment, or a clear error if it is not one."""
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(
                tr("{name} is not set: run this script with torchrun, or unset RANK to run one process").format(
                    name=name
                )
            )
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(
            tr("{setting} is not an integer; let torchrun set it").format(setting=f"{name}={value!r}")
        ) from None
    if number < minimum:
        raise ValueError(tr("{setting} must be at least {minimum}").format(setting=f"{name}={number}", minimum=minimum))
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
            tr("{ranks} do not fit {sizes}; let torchrun set these variables").format(
                ranks=f"RANK={rank} / LOCAL_RANK={local_rank}",
                sizes=f"WORLD_SIZE={world_size} / LOCAL_WORLD_SIZE={local_world_size}",
            )
        )


@contextlib.contextmanager
def pretend_ranks(world_size: int):
    """A default process group of ``world_size`` ranks inside this one process, which sends nothing.

    Each collective returns at once with tensors of the right shape (their values are wrong),
    which is all a memory estimate needs: FSDP2 behaves as on rank 0 of ``world_size``.
    """
    # A private module: torch's "fake" backend and its store have no public home (torch's own
    # init_process_group imports this module when asked for "fake" without a store).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # A timeout like every group of the course, although nothing here ever waits.
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()
