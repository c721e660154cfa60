"""Chapter 01 exercise: per-worker seeding of random augmentation."""

from __future__ import annotations

from .. import dataloaders as data
from ..runtime.i18n import tr
from . import verdict


def check_worker_init_fn(worker_init_fn) -> bool:
    """Exercise 01: a worker_init_fn that gives every worker its own, reproducible noise."""
    problems = []
    first = data.noise_by_sample(num_workers=2, worker_init_fn=worker_init_fn, seed=123)
    again = data.noise_by_sample(num_workers=2, worker_init_fn=worker_init_fn, seed=123)
    other = data.noise_by_sample(num_workers=2, worker_init_fn=worker_init_fn, seed=456)
    if data.duplicated_noise(first):
        problems.append(
            tr("samples {pairs}... still get identical noise").format(pairs=data.duplicated_noise(first)[:3])
        )
    if any(not (first[i][1] == again[i][1]).all() for i in first):
        problems.append(tr("two runs with the same DataLoader generator seed differ: not reproducible"))
    if all((first[i][1] == other[i][1]).all() for i in first):
        problems.append(tr("a different DataLoader seed gives the same noise: the seed is ignored"))
    return verdict(problems, tr("Correct: every sample gets its own noise, and the same seed reproduces it."))
