"""Chapter 12: a small GPT trained on the course's own text, from the first step to a sample.

    python -m distcourse.capstone                                        # one process
    torchrun --standalone --nproc-per-node 2 -m distcourse.capstone      # FSDP2 over 2 ranks
    torchrun --standalone --nproc-per-node 4 -m distcourse.capstone --tp 2   # (dp 2, tp 2) mesh
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:PORT -m distcourse.capstone             # on each of two nodes
    sbatch code/distcourse/scripts/slurm_train.sbatch -m distcourse.capstone --steps 5000   # SLURM

One script, chosen by the launcher's flags: like chapter 07's ``train.py`` it runs distributed
when the launcher set ``RANK``. It is also a rank function: ``launch(capstone.main, 4,
args=(argv,))`` runs it on ranks whose process group is already initialised.

What it puts together: a byte-level corpus split into training and held-out text; a
``DataLoader`` with worker processes over a ``DistributedSampler`` (``set_epoch`` every
epoch, and able to start mid-epoch after a resume); FSDP2 on a ``dp`` mesh dimension and,
with ``--tp``, tensor parallelism on a ``tp`` dimension (chapter 10's plan); bf16 autocast;
activation checkpointing; evaluation on held-out text; a tqdm bar and logs on rank 0 only;
asynchronous DCP checkpoints and exact resume; a checkpoint resumed on another layout
(``resume_resharded``: DCP reshards on load); a final model gathered for one-process
inference, and a sample of generated text.

Its sentences are in the reader's language (``DISTCOURSE_LANG`` for the program, the
notebook's for ``launch``); what code reads back has a line of its own, a fixed tag and
JSON, in every language: ``result {...}``, ``resume {...}``, ``kill {...}``.

Builds on: ``tensor_parallel.py`` (chapter 10's ``tp_plan``), ``common/distributed.py``
(process group setup, shared with chapter 07's ``train.py``), ``common/checkpoint_files.py``
(chapter 05's atomic saves) and ``common/models.py`` (the GPT).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm  # the console bar: the script runs in terminals and log files

from .common.checkpoint_files import atomic_save
from .common.distributed import check_launcher_env, choose_device, init_distributed, say
from .common.models import gpt
from .common.timing import clock
from .runtime.hardware import rank_device
from .runtime.i18n import number, script_language, tr, use
from .tensor_parallel import tp_plan

COURSE_CHAPTERS = pathlib.Path(__file__).resolve().parents[2] / "chapters" / "en"
VOCAB = 256  # bytes: no tokenizer to train or ship, and any text in any language is valid input


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=pathlib.Path, default=COURSE_CHAPTERS, help="a text file, or a folder of them")
    p.add_argument("--held-out", type=float, default=0.1, help="the last fraction of the corpus, for evaluation only")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank and step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-windows", type=int, help="train on the first N windows only (short epochs)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per model replica (a 2-D mesh)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on GPUs only")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic GPU kernels (torch.use_deterministic_algorithms): bitwise-equal reruns and resumes",
    )
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss logs (one sync of the GPU each)")
    p.add_argument("--ckpt-dir", type=pathlib.Path, help="save here every --save-every steps; resume from it")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--sync-save", action="store_true", help="wait for each checkpoint (default: async_save)")
    p.add_argument("--out", type=pathlib.Path, help="rank 0 writes metrics.jsonl, final.pt and sample.txt here")
    p.add_argument("--sample-bytes", type=int, default=160)
    p.add_argument("--prompt", default="Distributed training ")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="tqdm bar on rank 0")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    p.add_argument("--kill-at", type=int, help="on the first attempt, the last rank is killed (SIGKILL) at this step")
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "steps", "tp", "save_every", "log_every", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# --------------------------------------------------------------------------------------
# Data: the course's own prose, as bytes
# --------------------------------------------------------------------------------------


def corpus_text(path: pathlib.Path) -> str:
    """The text to train on: a text file, or the markdown cells of every notebook (but the
    first: its title, badge and links) and every ``.md``/``.txt`` file in a folder (sorted by
    name, so every rank reads the same corpus)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no corpus at {path}: pass --corpus with a text file or a folder of notebooks or text files"
        )
    files = sorted(p for p in path.iterdir() if p.suffix in (".ipynb", ".md", ".txt")) if path.is_dir() else [path]
    parts = []
    for f in files:
        if f.suffix == ".ipynb":
            cells = json.loads(f.read_text(encoding="utf-8"))["cells"]
            parts += ["".join(c["source"]) for c in cells[1:] if c["cell_type"] == "markdown"]
        else:
            parts.append(f.read_text(encoding="utf-8"))
    text = "\n\n".join(parts)
    if not text.strip():
        raise ValueError(f"the corpus at {path} holds no text")
    return text


def split_corpus(text: str, held_out: float) -> tuple[torch.Tensor, torch.Tensor]:
    """UTF-8 bytes as a uint8 tensor, cut in two: training text, then held-out text."""
    if not 0 < held_out < 1:
        raise ValueError(f"--held-out must be between 0 and 1, got {held_out}")
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]


class Windows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: the input, and the targets one byte later."""

    def __init__(self, data: torch.Tensor, seq_len: int, limit: int | None = None):
        self.data, self.seq_len = data, seq_len
        self.count = (len(data) - 1) // seq_len if limit is None else min(limit, (len(data) - 1) // seq_len)
        if self.count < 1:
            raise ValueError(f"{len(data)} bytes hold no window of {seq_len + 1}: use a bigger corpus or --seq-len")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        window = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start its epoch part-way through.

    After a resume at step s the epoch is already ``s % steps_per_epoch`` batches old; those
    samples must be skipped, not read and thrown away (a real corpus is big). The order of an
    epoch depends only on ``seed + epoch`` (``set_epoch``), so the samples that follow are
    exactly those the uninterrupted run saw.
    """

    skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


# --------------------------------------------------------------------------------------
# Model: the GPT of chapter 10 on a (dp, tp) mesh
# --------------------------------------------------------------------------------------


def build_model(args, device: torch.device, world_size: int):
    """The GPT, parallelised for ``world_size`` ranks; returns (model, data-parallel size, its rank)."""
    model = gpt(args.seed, vocab=VOCAB, hidden=args.hidden, heads=args.heads, layers=args.layers).to(device)
    if not dist.is_initialized():
        if args.tp > 1:
            raise ValueError(f"--tp {args.tp} needs {args.tp} or more ranks: start the script with torchrun")
        return checkpoint_blocks(model) if args.activation_checkpointing else model, 1, 0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if world_size % args.tp or args.heads % args.tp:
        raise ValueError(f"--tp {args.tp} must divide the world size ({world_size}) and --heads ({args.heads})")
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    # torchtitan's order: tensor parallelism on the plain modules (the plan names them), then
    # activation checkpointing around each block, then FSDP2 around the checkpointed blocks.
    if args.tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(model))
    if args.activation_checkpointing:
        model = checkpoint_blocks(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])  # one all-gather per block, freed after use
    fully_shard(model, mesh=mesh["dp"])  # embedding, final norm and output
    return model, mesh["dp"].size(), mesh["dp"].get_local_rank()


def checkpoint_blocks(model):
    """Activation checkpointing per block (torchtitan's ``checkpoint_wrapper``): backward keeps
    only each block's input and runs the block's forward again to get the rest."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
    return model


def autocast(device: torch.device, precision: str):
    """bf16 autocast where it pays: on GPUs, whose matrix units run bf16 faster than fp32. On a
    CPU the conversions to and from bf16 often cost more than they save (chapter 12, part 2,
    measures the ratio on the machine it runs on)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"), precision


def loss_of(model, inputs, targets) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --------------------------------------------------------------------------------------
# Checkpoints: DCP, asynchronous, with a completeness rule
# --------------------------------------------------------------------------------------


def checkpoint_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / f"step-{step:06d}"


def latest_complete(root: pathlib.Path | None) -> tuple[int, pathlib.Path | None, list[str]]:
    """The newest checkpoint that finished (DCP writes ``.metadata`` last, after every rank's
    shards), and the names of newer ones that did not: a save cut short by a kill."""
    if root is None or not root.exists():
        return 0, None, []
    found = sorted(root.glob("step-*"))
    complete = [d for d in found if (d / ".metadata").exists()]
    if not complete:
        return 0, None, [d.name for d in found]
    newest = complete[-1]
    return int(newest.name.split("-")[1]), newest, [d.name for d in found if d.name > newest.name]


def state_of(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # sharded (DTensor) entries under FSDP2
    return {"model": model_state, "optimizer": optimizer_state}


def load_state(path: pathlib.Path, model, optimizer, group) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = state_of(model, optimizer)
    dcp.load(state, checkpoint_id=path, process_group=group)  # each rank reads its own shards
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# --------------------------------------------------------------------------------------
# Resharding: a checkpoint written by one layout, resumed on another
# --------------------------------------------------------------------------------------


def start_at(sampler: ResumableSampler, step: int, per_epoch: int, batch_size: int) -> None:
    """Point ``sampler`` at ``step``: that step's epoch (its shuffled order), minus the
    samples of this rank the epoch has already used."""
    sampler.set_epoch(step // per_epoch)
    sampler.skip = (step % per_epoch) * batch_size


def step_samples(dataset: Windows, dp_size: int, batch_size: int, step: int, seed: int = 0) -> list[list[int]]:
    """The windows (indices into ``dataset``) that each of ``dp_size`` ranks trains on at
    ``step``, by the rule ``train`` follows; one list per data-parallel rank."""
    shares = []
    for rank in range(dp_size):
        sampler = ResumableSampler(dataset, num_replicas=dp_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        start_at(sampler, step, len(sampler) // batch_size, batch_size)
        shares.append(list(sampler)[:batch_size])
    return shares


def loaded_model(args, device: torch.device, world_size: int) -> dict:
    """Build the model for this layout and load the newest complete checkpoint of
    ``args.ckpt_dir`` into it: each rank reads only the slices its own shards need.

    Returns the step, this rank's local shape of every parameter, and, on rank 0, the whole
    tensors gathered from the shards (a collective: every rank calls it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor import DTensor

    step, path, _ = latest_complete(args.ckpt_dir)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {args.ckpt_dir}")
    model, _, _ = build_model(args, device, world_size)
    state = {"model": get_model_state_dict(model)}  # the optimizer's entries stay on disk: a partial load
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    local = {
        name: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape) for name, p in model.named_parameters()
    }
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    master = not dist.is_initialized() or dist.get_rank() == 0
    return {"step": step, "local shapes": local, "model": full if master else None}


def resume_resharded(argv: list[str], layouts: dict[str, list[str]]) -> dict:
    """Rank function: resume the checkpoint in ``--ckpt-dir`` on this world size, once per layout.

    ``layouts`` maps a name to the arguments that make it (``["--tp", "2", ...]``). For each:
    what the load put on every rank (``loaded_model``), then the training continued by
    ``main`` from that checkpoint to ``--steps``. Pass ``--save-every`` above ``--steps``:
    a new checkpoint in the folder would be the next layout's starting point.
    """
    results = {}
    for name, extra in layouts.items():
        args = parse_args([*argv, *extra])
        loaded = loaded_model(args, rank_device(), dist.get_world_size())
        results[name] = {"loaded": loaded, "run": main([*argv, *extra])}
    return results


# --------------------------------------------------------------------------------------
# The script
# --------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_launcher_env()
    if args.deterministic:
        deterministic()  # before the first matmul: cuBLAS reads its workspace setting once
    launched = "RANK" in os.environ  # by torchrun, srun + torchrun, or distcourse.launch
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    own_group = launched and not dist.is_initialized()  # distcourse.launch has made one already
    if own_group:
        device, backend = choose_device(local_rank, local_world)
        init_distributed(backend, device, args.timeout)
    else:  # one process, or a group made by the launcher: its backend says where to compute
        device = rank_device() if dist.is_initialized() else choose_device(local_rank, local_world)[0]
    try:
        return train(args, rank, world_size, device)
    finally:
        if own_group:
            dist.destroy_process_group()  # also after an exception


def deterministic() -> None:
    """Make every kernel of this process deterministic, for bitwise-equal reruns and resumes.

    GPU kernels may add in an order that changes from run to run;
    ``use_deterministic_algorithms`` picks deterministic ones (and raises, naming the
    operation, where none exists), and cuBLAS needs a fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG``) to be deterministic. On a CPU the kernels this script uses
    are deterministic already: the flag changes nothing.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def setup(args, rank: int, world_size: int, device: torch.device, attempt: int) -> SimpleNamespace:
    """Model, optimizer, data and the step to start from (after a resume): built once, before the loop."""
    train_bytes, held_bytes = split_corpus(corpus_text(args.corpus), args.held_out)
    model, dp_size, dp_rank = build_model(args, device, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    amp, precision = autocast(device, args.precision)
    # Checkpoints go through a gloo group of their own: on GPUs that keeps the background
    # save's collectives off NCCL, whose order on the training stream must not interleave.
    ckpt_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    if ckpt_group is None:  # DCP warns that it saves without a process group: one process is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

    start, resumed_from, incomplete = latest_complete(args.ckpt_dir)
    if resumed_from is not None:
        load_state(resumed_from, model, optimizer, ckpt_group)
    sampler, loader, per_epoch = make_loader(
        args, Windows(train_bytes, args.seq_len, args.limit_windows), dp_size, dp_rank, device
    )
    job = SimpleNamespace(
        model=model,
        optimizer=optimizer,
        amp=amp,
        precision=precision,
        ckpt_group=ckpt_group,
        device=device,
        dp_size=dp_size,
        dp_rank=dp_rank,
        sampler=sampler,
        loader=loader,
        per_epoch=per_epoch,
        start=start,
        held_out=Windows(held_bytes, args.seq_len),
        master=rank == 0,
        rank=rank,
        attempt=attempt,
    )
    if job.master:
        announce(job, args, world_size, (len(train_bytes), len(held_bytes)), resumed_from, incomplete)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
    return job


def announce(job, args, world_size: int, corpus: tuple[int, int], resumed_from, incomplete: list[str]) -> None:
    """Rank 0's first lines: what this attempt runs on and, after a restart, where it resumed.

    Sentences for people go through ``tr`` (the reader's language); what code reads back
    has a line of its own, a fixed tag and JSON (``resume {...}``), in every language.
    """
    say(
        job.rank,
        tr(
            "attempt {attempt}: {ranks} rank(s) on {device} (dp {dp} x tp {tp}), {threads} thread(s) each, "
            "{precision}, {params} parameters, corpus {train} + {held} bytes, {per_epoch} steps per epoch, "
            "{workers} loader worker(s) per rank"
        ).format(
            attempt=job.attempt,
            ranks=world_size,
            device=job.device,
            dp=job.dp_size,
            tp=args.tp,
            threads=torch.get_num_threads(),
            precision=job.precision,
            params=number(sum(p.numel() for p in job.model.parameters())),
            train=number(corpus[0]),
            held=number(corpus[1]),
            per_epoch=job.per_epoch,
            workers=args.workers,
        ),
    )
    if resumed_from is not None:
        sentence = tr("resumed from {checkpoint}").format(checkpoint=resumed_from.name)
        if incomplete:
            sentence += tr("; incomplete, ignored: {names}").format(names=", ".join(incomplete))
        say(job.rank, sentence)
        tag(job.rank, "resume", {"step": job.start, "checkpoint": resumed_from.name, "ignored": incomplete})


def tag(rank: int, name: str, record: dict) -> None:
    """A line for code to read back, the same in every language: ``[rank R] name {json}``
    (``common.subprocesses.Result.json(rank, name)`` parses it). ``name`` is a word that no
    sentence the script prints begins with (``resume``, not the sentence's "resumed from")."""
    say(rank, f"{name} {json.dumps(record)}")


def make_loader(args, dataset: Windows, dp_size: int, dp_rank: int, device: torch.device):
    """The training windows for this rank: (sampler, DataLoader, steps per epoch)."""
    # Every rank of one tp group reads the same samples: the sampler shards over "dp" only.
    sampler = ResumableSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True
    )
    per_epoch = len(sampler) // args.batch_size
    if per_epoch < 1:
        raise ValueError(f"{len(dataset)} windows give no batch of {args.batch_size} on each of {dp_size} ranks")
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,  # the workers outlive an epoch: no restart cost each epoch
        pin_memory=device.type == "cuda",  # page-locked buffers: the copy to the GPU can be asynchronous
    )
    return sampler, loader, per_epoch


def train_step(model, optimizer, amp, inputs, targets) -> torch.Tensor:
    """Forward, backward, optimizer step (torchtitan's ``train_step``); returns the local loss.

    The loss stays a tensor on the device: no ``.item()`` here, which on a GPU would wait for
    every step to finish. ``flush`` reads many steps' losses at once.
    """
    with amp:
        loss = loss_of(model, inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(args, rank: int, world_size: int, device: torch.device) -> dict:
    """The loop: one step per batch, then logging, evaluation and checkpoints when they are due."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job = setup(args, rank, world_size, device, attempt)
    show = {"auto": None, "on": False, "off": True}[args.progress]  # tqdm: None = only on a terminal
    bar = tqdm(total=args.steps, initial=job.start, unit=tr("step"), disable=show if job.master else True)
    run = SimpleNamespace(pending=[], saving=None, saves=[], step=job.start, timed=None, curve={}, held={})
    job.model.train()
    while run.step < args.steps:
        start_at(job.sampler, run.step, job.per_epoch, args.batch_size)  # the epoch's order; mid-epoch after a resume
        for inputs, targets in job.loader:
            if run.step == args.kill_at and attempt == 0 and rank == world_size - 1:
                say(rank, tr("killed at step {step}").format(step=run.step))
                tag(rank, "kill", {"step": run.step})
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: a lost node
            if run.step == job.start + 2:
                run.timed = (clock(device), run.step)  # throughput from the third step: no warm-up
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            run.pending.append((run.step, train_step(job.model, job.optimizer, job.amp, inputs, targets)))
            run.step += 1
            bar.update()
            after_step(job, run, args, bar)
            if run.step == args.steps:
                break
    return finish(job, run, args, bar, world_size)


def after_step(job, run, args, bar) -> None:
    """Log the losses, evaluate on held-out text and checkpoint, each when its interval has come."""
    step, out = run.step, args.out if job.master else None
    if step % args.log_every == 0 or step == args.steps:
        logged = flush(run.pending, out, job.attempt, run.curve)
        bar.set_postfix({tr("loss"): number(logged, 3)}, refresh=False)
        if job.master:
            say(job.rank, tr("step {step}: loss {loss}").format(step=step, loss=number(logged, 4)))
    if step % args.eval_every == 0 or step == args.steps:
        held = run.held[step] = evaluate(job.model, job.held_out, args, job.dp_size, job.dp_rank, job.device, job.amp)
        if job.master:
            say(job.rank, tr("step {step}: held-out loss {loss}").format(step=step, loss=number(held, 4)))
            write(args.out, {"step": step, "held-out": held, "attempt": job.attempt})
    if args.ckpt_dir and step % args.save_every == 0:
        flush(run.pending, out, job.attempt, run.curve)
        run.saving = save(args, job, run)


def finish(job, run, args, bar, world_size: int) -> dict:
    """After the last step: wait for the last save, measure throughput, export and sample the model."""
    seconds = clock(job.device) - run.timed[0] if run.timed else float("nan")
    bar.close()
    if run.saving is not None:
        run.saving.result()  # the last asynchronous save must finish before the process ends
    tokens_per_step = job.dp_size * args.batch_size * args.seq_len
    result = {
        "world size": world_size,
        "dp": job.dp_size,
        "tp": args.tp,
        "threads": torch.get_num_threads(),
        "precision": job.precision,
        "resumed from": job.start,
        "steps per epoch": job.per_epoch,
        "saves": run.saves,
        "tokens per second": (run.step - run.timed[1]) * tokens_per_step / seconds if run.timed else None,
        "loss": run.curve,
        "held-out": run.held,
    }
    final = export(job.model, args, job.master)
    if job.master:
        text = generate(final, args.prompt, args.sample_bytes, args.seq_len, seed=args.seed)
        result["sample"] = text
        if args.out:
            (args.out / "sample.txt").write_text(text, encoding="utf-8")
        tag(job.rank, "result", {k: v for k, v in result.items() if k not in ("loss", "held-out")})
    return result


def flush(pending: list, out: pathlib.Path | None, attempt: int, curve: dict) -> float:
    """All-reduce the losses kept since the last log (one collective for many steps), add
    them to ``curve`` and append them to ``out/metrics.jsonl``; returns the last one."""
    if not pending:
        return float("nan")
    losses = torch.stack([loss for _, loss in pending]).float()
    if dist.is_initialized():
        dist.all_reduce(losses)  # tp peers hold equal losses: the mean over ranks is the batch's
        losses /= dist.get_world_size()
    for (step, _), value in zip(pending, losses.tolist()):
        curve[step] = value
        write(out, {"step": step, "loss": value, "attempt": attempt})
    pending.clear()
    return value


def write(out: pathlib.Path | None, record: dict) -> None:
    if out is not None:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


@torch.no_grad()
def evaluate(model, held_out: Windows, args, dp_size: int, dp_rank: int, device, amp) -> float:
    """Mean loss on the first ``eval_batches`` batches of held-out text, shared among dp ranks.

    Every rank gets the same number of windows: under FSDP2 each forward is a collective, and
    a rank with one batch more would wait for the others forever.
    """
    model.eval()
    per_rank = min(len(held_out) // dp_size, args.eval_batches * args.batch_size)
    if per_rank < 1:
        raise ValueError(f"{len(held_out)} held-out windows cannot be shared by {dp_size} ranks: raise --held-out")
    mine = range(dp_rank, per_rank * dp_size, dp_size)
    total = torch.zeros(2, device=device)
    for first in range(0, len(mine), args.batch_size):
        batch = [held_out[i] for i in mine[first : first + args.batch_size]]
        inputs, targets = (torch.stack(t).to(device) for t in zip(*batch))
        with amp:
            total += torch.stack(
                [loss_of(model, inputs, targets) * len(batch), torch.tensor(len(batch), device=device)]
            )
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= args.tp  # each tp peer counted the same batches
    model.train()
    return (total[0] / total[1]).item()


def save(args, job, run):
    """Start a DCP save of this step and return a future (None once done, with ``--sync-save``).

    ``async_save`` copies the state to CPU memory ("staging", synchronous by default) and
    returns; a background thread writes the files while training goes on. One save at a
    time: the previous one must be finished before the next is staged. ``run.saves`` gets
    one record per save: the seconds the loop waited, and after how many the checkpoint
    was complete (the returned future resolves only once that is recorded).
    """
    import concurrent.futures

    import torch.distributed.checkpoint as dcp

    if run.saving is not None:
        run.saving.result()
    path, state = checkpoint_dir(args.ckpt_dir, run.step), state_of(job.model, job.optimizer)
    record = {"step": run.step}
    run.saves.append(record)
    start = clock(job.device)  # after this step's kernels: the save's own time
    if args.sync_save:
        dcp.save(state, checkpoint_id=path, process_group=job.ckpt_group)
        record.update({"waited": clock(job.device) - start, "writing on return": False})
        record["complete after"] = record["waited"]
        return None
    written = dcp.async_save(state, checkpoint_id=path, process_group=job.ckpt_group)
    record.update({"waited": clock(job.device) - start, "writing on return": not written.done()})
    recorded = concurrent.futures.Future()

    def complete(future) -> None:  # in DCP's writer thread, when the files are written
        record["complete after"] = clock() - start
        if future.exception() is not None:
            recorded.set_exception(future.exception())
        else:
            recorded.set_result(future.result())

    written.add_done_callback(complete)
    return recorded


def export(model, args, master: bool):
    """The trained weights as one plain GPT on rank 0 (gathered from every shard), saved as
    ``final.pt`` for one-process inference; None on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # only rank 0 keeps the gathered tensors
    state = get_model_state_dict(model, options=options)
    if not master:
        return None
    final = gpt(None, vocab=VOCAB, hidden=args.hidden, heads=args.heads, layers=args.layers)
    final.load_state_dict(state)
    if args.out:
        atomic_save(state, args.out / "final.pt")
    return final


@torch.no_grad()
def generate(model, prompt: str, length: int, context: int, seed: int = 0, temperature: float = 0.8) -> str:
    """Sample ``length`` bytes after ``prompt``, one at a time, seeing at most ``context`` bytes."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt.encode("utf-8"))
    for _ in range(length):
        logits = model(torch.tensor([tokens[-context:]]))[0, -1].float()
        probabilities = torch.softmax(logits / temperature, dim=-1)
        tokens.append(torch.multinomial(probabilities, 1, generator=generator).item())
    return bytes(tokens).decode("utf-8", errors="replace")


def read_metrics(out: pathlib.Path) -> dict:
    """``metrics.jsonl`` as curves: step -> loss and step -> held-out loss. A step logged by
    several attempts (the ones between a checkpoint and a kill) keeps its last value."""
    losses, held = {}, {}
    for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
        else:
            held[record["step"]] = record["held-out"]
    return {"loss": dict(sorted(losses.items())), "held-out": dict(sorted(held.items()))}


if __name__ == "__main__":
    use(script_language())  # a program has no notebook to ask: DISTCOURSE_LANG, or English
    main()
