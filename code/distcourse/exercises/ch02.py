"""Self-check of chapter 02's exercise: a gradient all-reduce that is exact for unequal chunks."""

from __future__ import annotations

from .. import data_parallel as dp
from ..common import numerics
from ..runtime.i18n import number, tr
from . import verdict


def check_weighted_reduce(reduce) -> bool:
    """Exercise 1: ``reduce(replicas, chunk_sizes)`` must make a data-parallel step on
    unequal chunks (10 samples on 3 replicas: 4, 3 and 3) equal the full-batch step.

    Prints a verdict and returns True/False.
    """
    problems = []
    for size, k in ((10, 3), (64, 2)):
        x, y = dp.digits_batch(size, seed=3)
        model = dp.mlp(width=16, seed=3)
        reference, _, _ = dp.full_batch_step(model, x, y, lr=0.5)
        try:
            replicas, _, _ = dp.data_parallel_step(model, x, y, dp.devices_for(k), lr=0.5, reduce=reduce)
        except Exception as exc:  # the learner's code may raise anything
            problems.append(
                tr("{size} samples on {k} replicas: the step raised {error}").format(
                    size=size, k=k, error=f"{type(exc).__name__}: {exc}"
                )
            )
            continue
        if not all(dp.identical(replicas[0], r) for r in replicas[1:]):
            problems.append(
                tr(
                    "{size} samples on {k} replicas: the replicas differ after the step; "
                    "every replica must end up with the same gradient"
                ).format(size=size, k=k)
            )
        # the step's sums: across each layer's width (64 pixels, 16 hidden units, 10 classes) forward and
        # backward, then over the batch (common.numerics)
        elif not numerics.close(dp.params_of(replicas[0]), dp.params_of(reference), terms=2 * (64 + 16 + 10) + size):
            problems.append(
                tr(
                    "{size} samples on {k} replicas: the update differs from the full-batch step by "
                    "{difference}; weight each replica's gradient by its chunk's share of the batch"
                ).format(
                    size=size,
                    k=k,
                    difference=number(dp.max_difference(replicas[0], reference), 1, scientific=True),
                )
            )
    return verdict(
        problems, tr("Correct: with chunks of 4, 3 and 3 samples the replicas take exactly the full-batch step.")
    )
