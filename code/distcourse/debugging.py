"""When distributed training goes wrong, chapter 11 (first part): hangs, crashes, consistency.

Rank functions that break on purpose, each with a short timeout, and the tools that say why:

- ``missing_rank``: ``monitored_barrier`` names the rank that never arrived;
- ``stuck_stacks``: ``faulthandler`` prints every rank's Python stack while it hangs;
- ``flight_recorder``: each rank's last collectives from PyTorch's flight recorder, and
  ``behind``, which compares the ranks' records and names the rank that fell behind;
- ``nan_stop``: a NaN on one rank stops every rank at the same step instead of hanging;
- ``parameters_agree`` and ``diverged_replicas``: a checksum of every parameter compared
  across ranks finds the layer whose replicas differ;
- ``reproducible_run``: the same seeds give bitwise the same losses, run after run.

Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .common.datasets import digits_batch
from .common.models import mlp
from .common.training import global_mean, wrap_ddp
from .runtime.hardware import rank_device
from .runtime.i18n import tr


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0]


def _gloo_group(seconds: float):
    """A gloo group with a short timeout: ``monitored_barrier`` and these demos need gloo even
    where the training runs on nccl (it is the backend that can name a missing rank)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))


# --------------------------------------------------------------------------------------
# 1. A rank that never arrives
# --------------------------------------------------------------------------------------


def missing_rank(late: int = 1, timeout: float = 0.5) -> dict:
    """Rank function: every rank but ``late`` enters a ``monitored_barrier``; ``late`` is busy elsewhere.

    A plain barrier (or any collective) would only time out, saying nothing about whom it
    waited for. ``monitored_barrier`` on rank 0 collects an acknowledgement from each rank
    and, after ``timeout``, raises naming those that did not answer.
    """
    group = _gloo_group(timeout * 4)
    if dist.get_rank() == late:
        time.sleep(timeout * 2)  # stuck somewhere else: loading data, a deadlock, a slow disk
        return {"error": None}
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as error:
        return {"error": _first_line(error)}
    return {"error": None}


# --------------------------------------------------------------------------------------
# 2. Where is each rank stuck? Its Python stack
# --------------------------------------------------------------------------------------


def load_next_batch(seconds: float) -> None:
    """Stands for the place a real rank gets stuck: a data loader, a lock, a file system."""
    time.sleep(seconds)


def stuck_stacks(stuck: int = 1, after: float = 0.5) -> dict:
    """Rank function: rank ``stuck`` hangs in ``load_next_batch``, the others wait in an all-reduce.

    ``faulthandler.dump_traceback_later`` prints the Python stack of every thread of the
    process after ``after`` seconds, from a C-level watchdog that works even while Python
    waits inside C++ (a collective). In a real job, ``py-spy dump --pid PID`` does the same
    from outside without changing the code. Returns this rank's stack text.
    """
    group = _gloo_group(after * 2)
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback_later(after, file=out)
        try:
            if dist.get_rank() == stuck:
                load_next_batch(after * 3)
            else:
                dist.all_reduce(torch.ones(4), group=group)
        except RuntimeError:
            pass  # the all-reduce timed out: its peer never came
        finally:
            faulthandler.cancel_dump_traceback_later()
        out.seek(0)
        return {"stack": main_thread(out.read())}


def main_thread(dump: str) -> str:
    """From a faulthandler dump of all threads, the main thread's stack (the one running this code).

    The dump lists each thread as a header line ("Thread 0x..." or "Current thread 0x...")
    followed by its frames, most recent first.
    """
    blocks, current = [], []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            current = [line]
            blocks.append(current)
        elif current:
            current.append(line)
    mine = [b for b in blocks if any("stuck_stacks" in line for line in b)]
    return "\n".join(mine[0] if mine else (blocks[-1] if blocks else [])).strip()


# --------------------------------------------------------------------------------------
# 3. The flight recorder: the last collectives of every rank
# --------------------------------------------------------------------------------------


def flight_recorder(skip: int | list = 1, steps: int = 3, after: float = 0.5, dump_dir: str | None = None) -> dict:
    """Rank function: ``steps`` all-reduces on every rank, then one more that the rank(s) ``skip`` never join.

    PyTorch's flight recorder records each collective (sequence number, operation, sizes,
    state, Python stack) in a ring buffer, one per process. It is on by default; its size
    comes from ``TORCH_FR_BUFFER_SIZE`` (0 turns it off; the default is in
    ``torch/csrc/distributed/c10d/FlightRecorder.hpp``), read once, when the process creates
    the recorder with its first process group: set it in the ranks' environment at launch
    (``launch(..., env=...)``), not in a rank. ``"recorder variables"`` in the result says
    which of its variables this rank had. NCCL dumps the buffer by itself on a timeout; gloo
    does not, so a watchdog thread here dumps it after ``after`` seconds, as JSON (returned)
    and, if ``dump_dir`` is given, as the pickle file PyTorch's analyzer reads
    (``<dump_dir>/rank_<r>``).
    """
    group = _gloo_group(after * 2)
    dumped = {}

    def dump():
        dumped["json"] = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True))
        if dump_dir is not None:
            Path(dump_dir, f"rank_{dist.get_rank()}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())

    watchdog = threading.Timer(after, dump)
    watchdog.start()
    for _ in range(steps):
        dist.all_reduce(torch.ones(4), group=group)
    try:
        if dist.get_rank() in (skip if isinstance(skip, list) else [skip]):
            time.sleep(after * 2)  # busy elsewhere: never calls the last all-reduce
        else:
            dist.all_reduce(torch.ones(5), group=group)
    except RuntimeError:
        pass  # timed out, as the hang would in a real job
    watchdog.join()
    entries = [
        {
            "seq": e["collective_seq_id"],
            "op": e["profiling_name"],
            "sizes": e["input_sizes"],
            "state": e["state"],
            "group": e["process_group"][0],
        }
        for e in dumped["json"].get("entries", [])  # none at all when the recorder is off
    ]
    return {"rank": dist.get_rank(), "entries": entries, "recorder variables": recorder_variables()}


RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # the second: its older name


def recorder_variables() -> dict:
    """The variables that size the flight recorder, as this process has them (empty: the default)."""
    return {name: os.environ[name] for name in RECORDER_VARIABLES if name in os.environ}


def behind(records: list[dict]) -> dict:
    """Compare the ranks' flight records per process group; name the rank(s) that fell behind.

    The collectives of a group are numbered in the order each rank calls them, so the same
    number must be the same operation with the same sizes on every rank. A rank whose last
    number is lower than the others' never called what they are waiting in; a mismatch at
    the same number means the ranks called different collectives (a desync).
    The keys are for code; ``describe_behind`` says the same in the reader's language.
    """
    last = {}
    for record in records:
        for e in record["entries"]:
            key = (e["group"], record["rank"])
            if key not in last or e["seq"] > last[key]["seq"]:
                last[key] = e
    groups = sorted({g for g, _ in last})
    report = {}
    for group in groups:
        ranks = {r: e for (g, r), e in last.items() if g == group}
        newest = max(e["seq"] for e in ranks.values())
        waiting = {r: e for r, e in ranks.items() if e["seq"] == newest}
        report[group] = {
            "last seq per rank": {r: e["seq"] for r, e in sorted(ranks.items())},
            "behind": sorted(r for r, e in ranks.items() if e["seq"] < newest),
            "waiting in": next(iter(waiting.values()))["op"] + " " + str(next(iter(waiting.values()))["sizes"]),
        }
    return report


def describe_behind(report: dict) -> str:
    """``behind``'s report as sentences, one per process group, in the reader's language."""
    lines = []
    for group, r in report.items():
        last = ", ".join(f"{rank} → #{seq}" for rank, seq in r["last seq per rank"].items())
        if r["behind"]:
            text = tr(
                "Process group {group}, last collective per rank: {last}. Behind: rank(s) {behind}; "
                "the others wait in {op}."
            )
        else:
            text = tr("Process group {group}, last collective per rank: {last}. No rank is behind.")
        lines.append(text.format(group=group, last=last, behind=", ".join(map(str, r["behind"])), op=r["waiting in"]))
    return "\n".join(lines)


def run_torch_analyzer(dump_dir: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """PyTorch's own analyzer, ``python -m torch.distributed.flight_recorder.fr_trace``, on the dumps."""
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", dump_dir, "-p", "rank_"]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def read_dump(path: str) -> dict:
    """A pickle dump as ``run_torch_analyzer`` reads it (for looking at what it contains)."""
    with open(path, "rb") as f:
        return pickle.load(f)


# --------------------------------------------------------------------------------------
# 4. NaN on one rank: stop everyone at the same step
# --------------------------------------------------------------------------------------


def nan_stop(bad_rank: int = 1, bad_step: int = 2, agree: bool = True, steps: int = 5, timeout: float = 5.0) -> dict:
    """Rank function: DDP training where rank ``bad_rank``'s loss becomes NaN at ``bad_step``.

    agree=False: the rank that sees the NaN stops alone; the others enter the next step's
        gradient all-reduce and wait for it, until the collective timeout or until its
        connections close (gloo, when that rank's process ends).
    agree=True: every rank all-reduces a "finite?" flag (one number, MIN) before backward,
        so all of them see the NaN in the same step and stop there together, cleanly.
    Returns the step at which this rank stopped, why in a word for code ("agreed": a rank
    reported a non-finite loss; "alone": this rank's loss is not finite; "error": a
    collective failed; "finished") and why in a sentence for the reader (for "error": the
    error's first line, as PyTorch wrote it). ``timeout`` bounds each collective: long
    enough that a busy machine's delays in the first steps do not end the demo early, and
    not waited for in full here, since the rank that stops alone closes its connections.
    """
    device = rank_device()
    group = _gloo_group(timeout)
    model = wrap_ddp(mlp(width=32, seed=0), device, process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = digits_batch(64, seed=dist.get_rank())
    for step in range(steps):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        if step == bad_step and dist.get_rank() == bad_rank:
            loss = loss * float("nan")  # a bad sample, an overflow, a division by zero
        try:
            if agree:
                finite = torch.tensor([float(torch.isfinite(loss).item())])
                dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=group)  # 0 if any rank saw NaN or inf
                if finite.item() == 0:
                    return {"stopped at": step, "reason": "agreed", "why": tr("a rank reported a non-finite loss")}
            elif not torch.isfinite(loss):
                return {"stopped at": step, "reason": "alone", "why": tr("this rank's loss is not finite")}
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        except RuntimeError as error:
            return {"stopped at": step, "reason": "error", "why": _first_line(error)}
    return {"stopped at": None, "reason": "finished", "why": tr("finished")}


# --------------------------------------------------------------------------------------
# 5. Are the replicas still equal?
# --------------------------------------------------------------------------------------


def parameters_agree(model: torch.nn.Module) -> list[str]:
    """Names of the parameters whose values differ between ranks (empty: all replicas equal).

    Each rank sums every parameter in float64 and the sums are all-gathered: a few numbers
    per tensor instead of the tensors themselves. Equal sums do not prove equal tensors,
    but different sums prove different ones, which is what a check needs.
    """
    device = next(model.parameters()).device  # nccl gathers GPU tensors only
    sums = torch.tensor([p.detach().double().sum().item() for p in model.parameters()], device=device)
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    names = [n for n, _ in model.named_parameters()]
    return [names[i] for i in range(len(names)) if any(g[i] != gathered[0][i] for g in gathered)]


def diverged_replicas(steps: int = 3) -> dict:
    """Rank function: DDP replicas drift apart, and the checksum finds where.

    After DDP broadcast rank 0's weights, rank 1 re-initialises its last layer: a bug seen in
    real code (loading a checkpoint on one rank only, a random init after wrapping). DDP
    averages gradients, so every replica takes the same *step*, and what differed stays
    different forever; the loss looks normal.
    """
    device = rank_device()
    model = wrap_ddp(mlp(width=32, seed=0), device)
    before = parameters_agree(model.module)
    if dist.get_rank() == 1:
        with torch.no_grad():
            torch.manual_seed(123)
            model.module[-1].weight.normal_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = digits_batch(64, seed=dist.get_rank())
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    return {"before": before, "after": parameters_agree(model.module)}


# --------------------------------------------------------------------------------------
# 6. Reproducibility
# --------------------------------------------------------------------------------------


def reproducible_runs(seeds: tuple = (0, 0, 1), steps: int = 5) -> list[list[float]]:
    """Rank function: ``reproducible_run`` once per seed, one after the other in the same processes."""
    return [reproducible_run(seed, steps) for seed in seeds]


def reproducible_run(seed: int = 0, steps: int = 5) -> list[float]:
    """DDP training (on the ranks of the current process group) whose only randomness comes from ``seed``.

    Weights from a seeded generator, data chosen by the seed, per-rank random streams (here:
    dropout) seeded from it, deterministic kernels (``torch.use_deterministic_algorithms``):
    the losses are bitwise the same every run with the same world size. A different world
    size changes the order of the gradient sums, and with it the last bits.
    """
    # cuBLAS is deterministic only with a fixed workspace; read when its first handle is created
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed + dist.get_rank())  # per-rank streams (e.g. dropout) from the seed
    device = rank_device()
    model = wrap_ddp(mlp(width=32, dropout=0.1, seed=seed), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = digits_batch(64, seed=seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(global_mean(loss))
    return losses


# --------------------------------------------------------------------------------------
# 7. Crashes under torchrun
# --------------------------------------------------------------------------------------


def torchrun_crash(fail: str = "exception", timeout: float = 60.0) -> dict:
    """Run ``scripts/crashing_train.py`` under torchrun on 2 processes; one fails at step 1.

    Returns torchrun's exit code, its "Root Cause" block parsed into fields, and the error
    file that ``@record`` wrote for the failing rank (None when a signal killed it).
    """
    from .common.subprocesses import child_env, torchrun

    command = torchrun(
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        module="distcourse.scripts.crashing_train",
        script_args=["--fail", fail],
    )
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=timeout)
    root = root_cause(done.stderr)
    error_file = None
    if root.get("error_file", "<N/A>") != "<N/A>" and Path(root["error_file"]).is_file():
        error_file = json.loads(Path(root["error_file"]).read_text())
    return {
        "returncode": done.returncode,
        "root cause": root,
        "other failures": other_failures(done.stderr),
        "error file": error_file,
        "stdout": done.stdout,
    }


FIELDS = ("time", "host", "rank", "exitcode", "error_file", "traceback")


def _block(lines: list[str]) -> list[dict]:
    """Failure entries ("[0]:" then "  field : value" lines) of one block of torchrun's summary."""
    entries = []
    for line in lines:
        if line.strip().startswith("[") and line.strip().endswith("]:"):
            entries.append({})
            continue
        key, sep, value = line.strip().partition(":")
        if entries and sep and key.strip() in FIELDS and key.strip() not in entries[-1]:
            entries[-1][key.strip()] = value.strip()
    return entries


def _section(stderr: str, title: str) -> list[str]:
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(title)), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(("----", "===="))), len(lines))
    return lines[start + 1 : end]


def root_cause(stderr: str) -> dict:
    """The fields of the "Root Cause (first observed failure)" block torchrun prints on failure."""
    entries = _block(_section(stderr, "Root Cause"))
    return entries[0] if entries else {}


def other_failures(stderr: str) -> list[dict]:
    """Rank and exit code of each failure torchrun lists besides the root cause."""
    return [{k: e[k] for k in ("rank", "exitcode") if k in e} for e in _block(_section(stderr, "Failures:"))]


# --------------------------------------------------------------------------------------
# 8. On GPUs: what NCCL says
# --------------------------------------------------------------------------------------


def nccl_info(directory: str) -> list[str]:
    """Rank function, GPUs only: NCCL's own lines from this rank's first collective.

    Needs ``NCCL_DEBUG=INFO`` and ``NCCL_DEBUG_FILE=<directory>/nccl.%p`` in the ranks'
    environment before their process group is created (NCCL reads them once, when it
    initialises in a process, which ``device_id`` makes happen in ``init_process_group``):
    ``launch(..., env={...})`` applies them there. NCCL replaces %p by the process id.
    """
    device = rank_device()
    if device.type != "cuda":
        raise RuntimeError("NCCL_DEBUG shows NCCL's lines: this rank has no GPU")
    dist.all_reduce(torch.ones(1, device=device))
    torch.cuda.synchronize(device)
    path = Path(directory, f"nccl.{os.getpid()}")
    return path.read_text().splitlines() if path.exists() else []
