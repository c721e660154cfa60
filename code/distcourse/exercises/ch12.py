"""Self-checks for the exercises of chapter 12.

Part 1: ``resume_point(step, steps_per_epoch, batch_size)`` says where a resumed run picks up
its data: the epoch, and how many of this rank's samples that epoch has already used. The
check sets the capstone's own sampler (over the real corpus) to the learner's answer and
compares the batches that follow with those of an uninterrupted pass.

Part 3: ``server_bytes(params, trainers)`` predicts the tensor bytes that pass through a
synchronous parameter server per step. The check runs a real server and counts them.
"""

from __future__ import annotations

import random

from .. import capstone, parameter_server
from ..common.subprocesses import free_port
from ..runtime.i18n import number, tr
from ..runtime.launcher import launch
from . import verdict


def _order(sampler, epoch: int, skip: int) -> list[int]:
    sampler.set_epoch(epoch)
    sampler.skip = skip
    return list(sampler)


def check_resume_point(resume_point) -> bool:
    """Random resume steps on 2 ranks; the samples that follow must be the uninterrupted run's."""
    train, _ = capstone.split_corpus(capstone.corpus_text(capstone.COURSE_CHAPTERS), 0.1)
    dataset = capstone.Windows(train, seq_len=64, limit=300)
    rng, problems = random.Random(), []
    for _ in range(4):
        batch_size, rank = rng.choice((4, 8, 16)), rng.randrange(2)
        sampler = capstone.ResumableSampler(dataset, num_replicas=2, rank=rank, seed=0, drop_last=True)
        per_epoch = sampler.num_samples // batch_size
        step = rng.randrange(1, 4 * per_epoch)
        epoch, done = divmod(step, per_epoch)
        expected = _order(sampler, epoch, 0)[done * batch_size : per_epoch * batch_size]
        call = f"resume_point({step}, {per_epoch}, {batch_size})"
        try:
            answer = resume_point(step, per_epoch, batch_size)
            got = _order(sampler, *answer)[: len(expected)]
        except Exception as exc:  # the learner's code: report, do not crash the notebook
            problems.append(tr("{call} raised {error}").format(call=call, error=repr(exc)))
            continue
        if got != expected:
            problems.append(
                tr("{call} = {answer}: the next samples differ from the uninterrupted run's").format(
                    call=call, answer=answer
                )
            )
    return verdict(problems, tr("Correct: every resumed run continues with the samples it would have seen."))


def check_server_bytes(server_bytes) -> bool:
    """Run a synchronous parameter server with 2 trainers and a random width; compare bytes per step."""
    width, steps = random.choice((16, 32, 48)), 4
    params = sum(p.numel() for p in parameter_server.mlp(width).parameters())
    result = launch(
        parameter_server.parameter_server,
        world_size=3,
        kwargs={"port": free_port(), "mode": "sync", "steps": steps, "width": width},
        quiet=True,
    )[0]
    measured = (result["bytes"]["in"] + result["bytes"]["out"]) / steps
    call = f"server_bytes(params={params}, trainers=2)"
    try:
        answer = server_bytes(params=params, trainers=2)
    except Exception as exc:  # the learner's code: report, do not crash the notebook
        return verdict([tr("{call} raised {error}").format(call=call, error=repr(exc))], "")
    problems = [] if answer == measured else [tr("{call} = {answer}, measured {measured}").format(
        call=call, answer=answer, measured=number(int(measured)))]  # fmt: skip
    return verdict(
        problems, tr("Correct: {measured} bytes per step through the server.").format(measured=number(int(measured)))
    )
