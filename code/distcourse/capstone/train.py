"""The job's train loop: set up, one step per batch, then logs, evaluation and checkpoints when due.

torchtitan's ``train.py``: ``main`` starts or joins the process group, ``setup`` builds what
the loop needs (model on its mesh, optimizer, data, the step to resume from), ``train_step``
is forward, backward and optimizer step, and ``after_step`` does what is due at a step.
``resume_resharded`` runs the job again from a checkpoint on another layout.
"""

from __future__ import annotations

import os
import signal
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tqdm import tqdm  # the console bar: the script runs in terminals and log files

from ..common.distributed import check_launcher_env, choose_device, init_distributed, say
from ..common.timing import clock
from ..runtime.hardware import rank_device
from ..runtime.i18n import number, tr
from .checkpointing import agreed_checkpoint, background_stager, export, load_state, loaded_model, save
from .config import parse_args
from .data import Windows, corpus_text, make_loader, split_corpus
from .metrics import (
    CURVES,
    announce,
    flops_per_token,
    flush,
    mfu_sentence,
    model_flops_utilization,
    peak_of,
    tag,
    write,
)
from .model import generate, loss_of
from .optim import build_optimizer, clip, grad_scaler
from .parallelize import autocast, build_model, profile_of


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
    optimizer, scheduler = build_optimizer(model, args)
    amp, precision = autocast(device, args.precision)
    # Checkpoints go through a gloo group of their own: on GPUs that keeps the background
    # save's collectives off NCCL, whose order on the training stream must not interleave.
    ckpt_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    if ckpt_group is None:  # DCP warns that it saves without a process group: one process is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    sampler, loader, per_epoch = make_loader(
        args, Windows(train_bytes, args.seq_len, args.limit_windows), dp_size, dp_rank, device
    )
    scaler = grad_scaler(device, precision)
    # Everything a resume needs besides model and optimizer, each with state_dict/load_state_dict.
    extra = {"scheduler": scheduler, "loader": loader} | ({"scaler": scaler} if precision == "fp16" else {})
    start, resumed_from, incomplete = agreed_checkpoint(args.ckpt_dir, ckpt_group)  # rank 0 decides
    if resumed_from is not None:
        load_state(resumed_from, model, optimizer, ckpt_group, extra)
    job = SimpleNamespace(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        extra=extra,
        amp=amp,
        precision=precision,
        ckpt_group=ckpt_group,
        stager=background_stager(device) if args.background_staging else None,
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


def train_step(job, run, args, inputs, targets) -> torch.Tensor:
    """Forward, backward, clipping, optimizer and schedule step (torchtitan's ``train_step``).

    Returns the local loss and the gradient norm before clipping, as one tensor on the device:
    no ``.item()`` here, which on a GPU would wait for every step to finish. ``flush`` reads
    many steps' values at once. With fp16 the scaler multiplies the loss before backward and
    divides the gradients back (``unscale_``) before they are clipped; with bf16 and fp32 its
    calls do nothing.
    """
    with job.amp:
        loss = loss_of(job.model, inputs, targets)
    job.optimizer.zero_grad(set_to_none=True)
    job.scaler.scale(loss).backward()
    job.scaler.unscale_(job.optimizer)
    norm = clip(job.model, args.max_norm)
    if run.staging is not None:  # background staging still copying the parameters this step changes
        run.staging.result()
        run.staging = None
    job.scaler.step(job.optimizer)  # skipped, with fp16, if a gradient overflowed
    job.scaler.update()
    job.scheduler.step()
    return torch.stack([loss.detach().float(), norm.detach().float()])


def train(args, rank: int, world_size: int, device: torch.device) -> dict:
    """The loop: one step per batch, then logging, evaluation and checkpoints when they are due."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job = setup(args, rank, world_size, device, attempt)
    show = {"auto": None, "on": False, "off": True}[args.progress]  # tqdm: None = only on a terminal
    bar = tqdm(total=args.steps, initial=job.start, unit=tr("step"), disable=show if job.master else True)
    curves = {"loss": {}, "grad norm": {}, "lr": {}}
    run = SimpleNamespace(pending=[], saving=None, staging=None, saves=[], step=job.start, timed=None, curves=curves)
    run.held = {}
    job.model.train()
    while run.step < args.steps:
        for inputs, targets in job.loader:  # the rest of the loader's epoch: mid-epoch after a resume
            if run.step == args.kill_at and attempt == 0 and rank == world_size - 1:
                if run.saving is not None:  # the saves already begun finish first, so the resume
                    run.saving.result()  # point is known; a kill mid-save is a stress scenario
                say(rank, tr("killed at step {step}").format(step=run.step))
                tag(rank, "kill", {"step": run.step})
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: a lost node
            if run.step == job.start + 2:
                run.timed = (clock(device), run.step)  # throughput from the third step: no warm-up
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            lr = job.scheduler.get_last_lr()[0]
            run.pending.append((run.step, train_step(job, run, args, inputs, targets), lr))
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
        logged = flush(run.pending, out, job.attempt, run.curves)
        bar.set_postfix({tr("loss"): number(logged, 3)}, refresh=False)
        if job.master:
            say(job.rank, tr("step {step}: loss {loss}").format(step=step, loss=number(logged, 4)))
    if step % args.eval_every == 0 or step == args.steps:
        held = run.held[step] = evaluate(job.model, job.held_out, args, job.dp_size, job.dp_rank, job.device, job.amp)
        if job.master:
            say(job.rank, tr("step {step}: held-out loss {loss}").format(step=step, loss=number(held, 4)))
            write(args.out, {"step": step, "held-out": held, "attempt": job.attempt})
    if args.ckpt_dir and step % args.save_every == 0:
        flush(run.pending, out, job.attempt, run.curves)
        run.saving = save(args, job, run)


def finish(job, run, args, bar, world_size: int) -> dict:
    """After the last step: wait for the last save, measure throughput, export and sample the model."""
    seconds = clock(job.device) - run.timed[0] if run.timed else float("nan")
    bar.close()
    if run.saving is not None:
        run.saving.result()  # the last asynchronous save must finish before the process ends
    if job.stager is not None:
        job.stager.close()  # a stager we made is ours to close (async_save's docstring)
    tokens_per_step = job.dp_size * args.batch_size * args.seq_len
    speed = (run.step - run.timed[1]) * tokens_per_step / seconds if run.timed else None
    result = {
        "world size": world_size,
        "dp": job.dp_size,
        "tp": args.tp,
        "threads": torch.get_num_threads(),
        "precision": job.precision,
        "resumed from": job.start,
        "steps per epoch": job.per_epoch,
        "saves": run.saves,
        "tokens per second": speed,
        "mfu": utilization(job, args, speed, world_size),
        "loss": run.curves["loss"],
        "grad norm": run.curves["grad norm"],
        "lr": run.curves["lr"],
        "held-out": run.held,
    }
    final = export(job.model, args, job.master)
    if job.master:
        text = generate(final, args.prompt, args.sample_bytes, args.seq_len, seed=args.seed)
        result["sample"] = text
        if args.out:
            (args.out / "sample.txt").write_text(text, encoding="utf-8")
        tag(job.rank, "result", {k: v for k, v in result.items() if k not in (*CURVES, "held-out")})
    return result


def utilization(job, args, speed: float | None, world_size: int) -> float | None:
    """MFU from the measured tokens per second and the device's peak (its profile); rank 0 says
    it, or that a CPU has no profile to compare with. None without a peak."""
    params = sum(p.numel() for p in job.model.parameters())  # whole tensors' sizes, also of DTensor shards
    flops = flops_per_token(params, args.layers, args.hidden, args.seq_len)
    peak = peak_of(profile_of(job.device), job.precision)
    mfu = model_flops_utilization(speed, flops, world_size, peak)
    if job.master:
        say(job.rank, mfu_sentence(mfu, peak, job.device, job.precision))
    return mfu


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
