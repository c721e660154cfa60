"""What the job reports: rank 0's sentences, the tagged lines code reads back, and ``metrics.jsonl``.

Sentences for people go through ``tr`` (the reader's language); what code reads back has a
line of its own, a fixed tag and JSON (``result {...}``, ``resume {...}``, ``kill {...}``), the
same in every language. Losses are read in batches, one all-reduce for many steps: a
``.item()`` every step would make a GPU wait for each step to finish.
"""

from __future__ import annotations

import json
import pathlib

import torch
import torch.distributed as dist

from ..common.distributed import say
from ..runtime import gpus
from ..runtime.i18n import number, tr

CURVES = ("loss", "grad norm", "lr")  # per step, kept by flush; not in the result line


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


def flush(pending: list, out: pathlib.Path | None, attempt: int, curves: dict) -> float:
    """All-reduce the losses and gradient norms kept since the last log (one collective for
    many steps), add them and each step's learning rate to ``curves`` and append them to
    ``out/metrics.jsonl``; returns the last loss."""
    if not pending:
        return float("nan")
    values = torch.stack([v for _, v, _ in pending]).float()  # (steps, 2): loss, gradient norm
    if dist.is_initialized():
        dist.all_reduce(values)  # tp peers hold equal losses: the mean over ranks is the batch's
        values /= dist.get_world_size()  # the norm is the same on every rank already
    for (step, _, lr), (loss, norm) in zip(pending, values.tolist()):
        curves["loss"][step], curves["grad norm"][step], curves["lr"][step] = loss, norm, lr
        write(out, {"step": step, "loss": loss, "grad norm": norm, "lr": lr, "attempt": attempt})
    pending.clear()
    return loss


def write(out: pathlib.Path | None, record: dict) -> None:
    if out is not None:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(out: pathlib.Path) -> dict:
    """``metrics.jsonl`` as curves: step -> loss, gradient norm, learning rate and held-out
    loss. A step logged by several attempts (the ones between a checkpoint and a kill) keeps
    its last value."""
    curves = {name: {} for name in (*CURVES, "held-out")}
    for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for name in curves:
            if name in record:
                curves[name][record["step"]] = record[name]
    return {name: dict(sorted(curve.items())) for name, curve in curves.items()}


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (torchtitan's count): 6 per parameter (2 forward, 4 backward),
    plus the attention scores, 12 x layers x hidden x sequence length, which no parameter counts."""
    return 6 * params + 12 * layers * hidden * seq_len


def peak_of(profile, precision: str) -> float | None:
    """The device's dense peak (TFLOP/s) for the precision its matrix products run in: fp32
    products use TF32 units only if ``set_float32_matmul_precision`` allowed it."""
    if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    return gpus.peak_tflops(profile, precision)


def model_flops_utilization(tokens_per_second, flops: float, devices: int, peak: float | None) -> float | None:
    """MFU: the model's FLOPs per second on each device, as a fraction of its peak."""
    if peak is None or not tokens_per_second:
        return None
    return tokens_per_second * flops / devices / (peak * 1e12)


def mfu_sentence(mfu: float | None, peak: float | None, device, precision: str) -> str:
    if mfu is None:
        return tr("MFU needs a GPU profile: {device} has no peak FLOP/s to compare with").format(device=device)
    return tr("MFU: {mfu} % of the {peak} TFLOP/s dense {precision} peak of each device").format(
        mfu=number(100 * mfu, 1), peak=number(peak, 0), precision=precision
    )
