"""Self-check of chapter 03's exercise: a ring all-reduce that sends to the left.

A function written in a notebook cannot be sent to rank processes, so the check
runs the learner's schedule on the in-process simulation of the ring
(:func:`distcourse.collectives.simulate_ring`), which moves chunks exactly as
``ring_all_reduce`` does, only in the opposite direction.
"""

from __future__ import annotations

import torch

from ..collectives import simulate_ring
from ..runtime.i18n import tr


def check_left_ring(reduce_scatter_chunk, all_gather_chunk) -> bool:
    """True if the two schedules make a leftward ring all-reduce correct for 2 to 6 ranks."""
    generator = torch.Generator().manual_seed(3)
    for n in range(2, 7):
        for numel in (n, 3 * n + 1):  # one element per chunk, and uneven chunks
            # Integer values: sums are exact in any order, so equality is the right test.
            values = [torch.randint(-50, 50, (numel,), generator=generator).float() for _ in range(n)]
            expected = torch.stack(values).sum(dim=0)
            try:
                final = simulate_ring(values, reduce_scatter_chunk, all_gather_chunk, direction=-1)
            except Exception as exc:  # the learner's function raised or returned a bad index
                print(tr("Not yet: with n={n} ranks, {error}").format(n=n, error=f"{type(exc).__name__}: {exc}"))
                return False
            wrong = [r for r in range(n) if not torch.equal(final[r], expected)]
            if wrong:
                print(
                    tr(
                        "Not yet: with n={n} ranks and {numel} elements, rank {rank} ends with "
                        "{got} instead of the sum {expected}."
                    ).format(n=n, numel=numel, rank=wrong[0], got=final[wrong[0]].tolist(), expected=expected.tolist())
                )
                return False
    print(tr("Correct: your leftward ring all-reduce gives every rank the sum, for 2 to 6 ranks."))
    return True
