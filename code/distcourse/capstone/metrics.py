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
from ..runtime.i18n import number, tr


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
