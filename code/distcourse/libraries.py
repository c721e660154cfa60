"""One small training, four ways: plain DDP, PyTorch Lightning, Hugging Face Accelerate, DeepSpeed.

Every version trains the same MLP (same initial weights) on the same digits, two ranks,
``BATCH`` samples per rank per step, Adam, for ``steps`` steps, and records the *global*
loss of every step (the mean over both ranks) and the final weights. If the libraries do
what they claim (average gradients across ranks, like DDP), the four records agree.

Plain DDP runs through ``distcourse.launch`` (``ddp_train``). Each library runs as a real
script in its own processes (``run_script``): Lightning starts its ranks itself, Accelerate and
DeepSpeed run under torchrun. The scripts live in
``distcourse/scripts/`` and write their record with ``save_result``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .common.datasets import digits
from .common.models import mlp
from .common.training import global_mean, train_step, wrap_ddp
from .runtime import hardware, i18n
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr
from .runtime.processes import package_env, stop_trees

BATCH = 32  # samples per rank per step
LR = 1e-2
WORLD_SIZE = 2
LIBRARIES = ("lightning", "accelerate", "deepspeed")

# --------------------------------------------------------------------------------------
# The task every version trains on
# --------------------------------------------------------------------------------------


def task_data(steps: int, world_size: int = WORLD_SIZE, batch_size: int = BATCH) -> tuple:
    """Exactly ``steps`` global batches of scikit-learn's digits, in a fixed shuffled order.

    Returns (images, labels, index): index numbers the samples, so that a run can report
    which ones each rank saw. The order is shuffled once, here, and every loader reads
    it sequentially (``shuffle=False``): samplers with their own seeds would give each
    library other data. Built once in the notebook and handed to every run, which also
    spares each rank the import of scikit-learn.
    """
    x, y = digits()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n = steps * world_size * batch_size
    if n > len(x):
        raise ValueError(f"{steps} steps of {world_size} x {batch_size} need {n} samples; the digits have {len(x)}")
    keep = order[:n]
    return x[keep], y[keep], torch.arange(n)


def make_model() -> nn.Module:
    """A small MLP, the same initial weights in every version; no dropout, so that no
    library's random numbers change the result."""
    return mlp(width=64, seed=0)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def rank_facts(first_batch) -> list[dict]:
    """Every rank's process and the samples it trained on in step 0, gathered on every rank (a collective)."""
    mine = {
        "first_batch": first_batch,
        "pid": os.getpid(),
        "parent": os.getppid(),
        "argv": sys.argv[1:],
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def record(library: str, losses, model: nn.Module, ranks: list) -> dict:
    """What every version reports: per-step global loss, final weights, and how its ranks ran."""
    return {
        "library": library,
        "losses": [float(v) for v in losses],
        "weights": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "world_size": len(ranks),
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "ranks": ranks,  # rank_facts(), one dict per rank
    }


def save_result(path, result: dict) -> None:
    """Write a record as JSON (weights as nested lists: a few thousand numbers, and no pickle)."""
    plain = {**result, "weights": {k: v.tolist() for k, v in result["weights"].items()}}
    pathlib.Path(path).write_text(json.dumps(plain))


def load_result(path) -> dict:
    """A result file as written by ``save_result``, with the weights back as tensors."""
    result = json.loads(pathlib.Path(path).read_text())
    result["weights"] = {k: torch.tensor(v) for k, v in result["weights"].items()}
    return result


# --------------------------------------------------------------------------------------
# Plain PyTorch: DDP under distcourse.launch, and a one-process reference
# --------------------------------------------------------------------------------------


def ddp_train(data) -> dict:
    """Rank function: the task with DistributedDataParallel and a DistributedSampler."""
    device, model = rank_device(), make_model()
    ddp = wrap_ddp(model, device)
    optimizer = make_optimizer(ddp.parameters())
    dataset = TensorDataset(*data)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))
    losses, first = [], None
    for x, y, index in loader:
        first = index.tolist() if first is None else first
        loss = train_step(ddp, optimizer, x.to(device), y.to(device))
        losses.append(global_mean(loss))  # the loss of the global batch
    return record("ddp", losses, model, rank_facts(first))


def reference_train(data, world_size: int = WORLD_SIZE) -> dict:
    """The same training in one process: each step one batch of ``world_size * BATCH`` samples."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    loader = DataLoader(TensorDataset(*data), batch_size=world_size * BATCH, shuffle=False)
    losses = []
    for x, y, _ in loader:
        losses.append(train_step(model, optimizer, x, y).item())
    return record("reference", losses, model, [])


def max_weight_difference(a: dict, b: dict) -> float:
    """Largest difference between the final weights of two records."""
    return max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"])


# --------------------------------------------------------------------------------------
# Running a library's script under its own launcher
# --------------------------------------------------------------------------------------


def version(package: str):
    """The installed version of ``package``, or None if it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def launch_environment(library: str) -> dict:
    """The environment a library's script starts with (``run_script``)."""
    env = package_env()  # so the scripts import this package
    if library == "deepspeed" and hardware.gpu_count() < WORLD_SIZE:
        env["DS_ACCELERATOR"] = "cpu"  # else DeepSpeed would put both ranks on a single GPU, if there is one
    # One intra-op thread per rank per core, as distcourse.launch does (no oversubscription).
    env["OMP_NUM_THREADS"] = str(hardware.threads_per_rank(WORLD_SIZE))
    env["PYTHONWARNINGS"] = "ignore"  # library deprecation chatter; errors still show
    env["DISTCOURSE_LANG"] = i18n.language()  # the script prints in the notebook's language
    return env


def launch_command(library: str, script_args) -> list[str]:
    """How each library is started, as you would type it in a terminal."""
    python = sys.executable
    if library == "lightning":
        # Lightning is its own launcher: strategy="ddp" re-runs this very command for rank 1.
        return [python, "-m", "distcourse.scripts.lightning_train", *script_args]
    nproc = f"--nproc-per-node={WORLD_SIZE}"
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", nproc]
    if library == "accelerate":
        return [*torchrun, "-m", "distcourse.scripts.accelerate_train", *script_args]
    if library == "deepspeed":
        return [*torchrun, "-m", "distcourse.scripts.deepspeed_train", *script_args]
    raise ValueError(tr("unknown library {library}; one of {choices}").format(library=repr(library), choices=LIBRARIES))


def command_line(library: str, extra_args=()) -> str:
    """The launch command as you would type it (``python`` for this interpreter's path)."""
    command = launch_command(library, ["--data", "data.pt", "--out", "result.json", *extra_args])
    return " ".join(["python", *command[1:]])


def run_script(
    library: str, data, *, extra_args=(), timeout: float = 120.0, env=None, show_log: bool = False, quiet: bool = False
) -> dict:
    """Run one library's training script under its launcher; return its result and timing.

    The script's own lines (prefixed ``[rank r]``) are printed; the libraries' logging is
    kept in ``result["log"]`` and printed only with ``show_log=True`` or on failure.
    ``quiet``: print nothing, keep what would have been printed in ``result["shown"]`` (for
    runs in threads of their own, whose output would interleave).
    """
    with tempfile.TemporaryDirectory(prefix=f"ch08-{library}-") as tmp:
        out, data_file = pathlib.Path(tmp) / "result.json", pathlib.Path(tmp) / "data.pt"
        torch.save(tuple(data), data_file)
        command = launch_command(library, ["--data", str(data_file), "--out", str(out), *extra_args])
        started = time.perf_counter()
        process = subprocess.Popen(
            command,
            env={**launch_environment(library), **(env or {})},
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            log, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_trees([process.pid], grace=3.0)
            log, _ = process.communicate()
            text = tr("{library} run did not finish in {timeout} s; its log:").format(
                library=library, timeout=number(timeout)
            )
            raise TimeoutError(f"{text}\n{log}") from None
        except BaseException:  # an interrupted cell: no rank may outlive it
            stop_trees([process.pid], grace=3.0)
            process.wait()
            raise
        seconds = time.perf_counter() - started
        ours = [line for line in log.splitlines() if line.startswith("[rank ")]
        if process.returncode != 0 or not out.exists():
            text = tr("{library} run failed (exit code {code}); its log:").format(
                library=library, code=process.returncode
            )
            raise RuntimeError(f"{text}\n{log}")
        shown = "\n".join(sorted(ours, key=lambda line: line[:8]))  # stable: grouped by rank
        if show_log:
            shown += "\n" + log
        else:
            hidden = tr("({n} lines of {library}'s own log hidden: result['log'])")
            shown += "\n" + hidden.format(n=number(len(log.splitlines()) - len(ours)), library=library)
        if not quiet:
            print(shown)
        result = load_result(out)
    result.update(seconds=seconds, log=log, command=command, shown=shown)
    return result


# --------------------------------------------------------------------------------------
# Helpers used by the scripts
# --------------------------------------------------------------------------------------


def use_script_language() -> None:
    """The scripts print in the language of the notebook that started them (``DISTCOURSE_LANG``,
    which :func:`run_script` sets), English without one."""
    i18n.use(i18n.script_language())


def say(rank: int, text: str) -> None:
    """A line of the script's own output; run_script keeps these and hides library logs.

    One write call per line: both ranks share one pipe, and separate writes of text and
    newline from two processes could interleave.
    """
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"[rank {rank}] {text}\n".encode())


def script_arguments(argv=None):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="the task's tensors, written by run_script")
    parser.add_argument("--out", required=True, help="where rank 0 writes the JSON result")
    parser.add_argument("--zero-stage", type=int, default=2)  # used by the DeepSpeed script
    return parser.parse_args(argv)


def load_task(path) -> TensorDataset:
    return TensorDataset(*torch.load(path, weights_only=True))


def seconds_since_start() -> float:
    """Seconds since this process started: imports included (``-m`` imports the package first)."""
    import psutil

    return time.time() - psutil.Process().create_time()
