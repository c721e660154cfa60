"""Self-checks of chapter 04's exercises.

First part: which indices does a DistributedSampler give a rank? Second part: the
global BatchNorm statistics from every rank's count, sums and sums of squares.

The learner's function runs here, in the notebook's own process (a function defined
in a notebook cannot be sent to rank processes), and is compared with PyTorch's own
``DistributedSampler``, which needs no process group when it is told the world size
and the rank.
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DistributedSampler

from ..common import numerics
from ..runtime.i18n import tr

# (dataset size, world size): even splits, splits that need padding, more ranks
CASES = [(10, 2), (11, 2), (7, 3), (10, 4), (5, 4)]


def expected_shard(size: int, world_size: int, rank: int, epoch: int, seed: int = 0) -> list[int]:
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def _problem(my_shard) -> str | None:
    """What is wrong with ``my_shard``, or None."""
    for (size, world), epoch, seed in itertools.product(CASES, (0, 1, 2), (0, 7)):
        for rank in range(world):
            call = f"my_shard({size}, {world}, {rank}, {epoch}, seed={seed})"
            try:
                got = my_shard(size, world, rank, epoch, seed=seed)
                if got is None:
                    return tr("my_shard returned None: return the list of this rank's indices")
                got = [int(i) for i in got]
            except Exception as exc:  # the learner's code may raise anything
                return tr("{call} raised {error}").format(call=call, error=f"{type(exc).__name__}: {exc}")
            want = expected_shard(size, world, rank, epoch, seed)
            if got == want:
                continue
            if len(got) != len(want):
                return tr(
                    "{call} gave {got} indices instead of {want}. Every rank must get "
                    "ceil({size}/{world}) = {want}: pad the permutation by repeating its start"
                ).format(call=call, got=len(got), want=len(want), size=size, world=world)
            if epoch > 0 and got == expected_shard(size, world, rank, 0, seed):
                return tr("{call} gave the order of epoch 0. Seed the generator with seed + epoch").format(call=call)
            return tr("{call} gave {got}; DistributedSampler gives {want}").format(call=call, got=got, want=want)
    return None


def check_shard(my_shard) -> bool:
    """True if ``my_shard(size, world_size, rank, epoch, seed=0)`` yields exactly the indices
    of ``DistributedSampler(shuffle=True, drop_last=False)`` after ``set_epoch(epoch)``."""
    problem = _problem(my_shard)
    if problem:
        print(tr("Not yet: {problem}.").format(problem=problem))
        return False
    print(
        tr("Correct: your shards match DistributedSampler's for all sizes, world sizes, ranks, epochs and seeds tried.")
    )
    return True


# --- Second part: global BatchNorm statistics from per-rank sums -------------------------

# (ranks, samples per rank, channels): equal shares, unequal shares, a rank with one sample
STATS_CASES = [((8, 8), 3), ((5, 11), 4), ((1, 6, 9), 2), ((3, 3, 3, 7), 5)]


def _stats_problem(my_global_stats) -> str | None:
    for case, (sizes, channels) in enumerate(STATS_CASES):
        generator = torch.Generator().manual_seed(case)
        # float64 and a shift per channel: realistic data whose variance is not just 1
        shares = [torch.randn(n, channels, generator=generator, dtype=torch.float64) * 2 + 3 for n in sizes]
        counts = [len(s) for s in shares]
        sums = [s.sum(0) for s in shares]
        squares = [(s * s).sum(0) for s in shares]
        everything = torch.cat(shares)
        want_mean, want_var = everything.mean(0), everything.var(0, unbiased=False)
        # float64 sums over every sample; E[x²] - mean² then cancels, losing digits by E[x²] / var
        terms = round(len(everything) * ((everything * everything).mean(0) / want_var).max().item())
        call = f"my_global_stats(counts={counts}, ...)"
        try:
            got = my_global_stats(list(counts), [t.clone() for t in sums], [t.clone() for t in squares])
            mean, var = got
        except Exception as exc:  # the learner's code may raise anything
            return tr("{call} raised {error}").format(call=call, error=f"{type(exc).__name__}: {exc}")
        if mean is None or var is None:
            return tr("my_global_stats returned None: return (mean, variance), two tensors of shape [C]")
        mean, var = torch.as_tensor(mean, dtype=torch.float64), torch.as_tensor(var, dtype=torch.float64)
        if mean.shape != want_mean.shape or var.shape != want_var.shape:
            return tr("{call} returned shapes {mean} and {var}; both should be {want}").format(
                call=call, mean=tuple(mean.shape), var=tuple(var.shape), want=(channels,)
            )
        average_of_means = torch.stack([s / n for s, n in zip(sums, counts)]).mean(0)
        # (answer, expected, a known mistake, what to say about it, what to say otherwise)
        for got, want, mistake, hint, wrong in (
            (
                mean,
                want_mean,
                average_of_means,
                tr(
                    "{call}: the mean is the average of the ranks' means, which weighs a rank with "
                    "few samples as much as one with many. Divide the total sum by the total count"
                ),
                tr("{call}: mean {got}, expected {want}"),
            ),
            (
                var,
                want_var,
                everything.var(0, unbiased=True),
                tr(
                    "{call}: that is the unbiased variance (divided by n - 1). BatchNorm normalises "
                    "with the biased one, divided by n"
                ),
                tr("{call}: variance {got}, expected {want}"),
            ),
        ):
            if numerics.close(got, want, terms=terms, dtype=torch.float64):
                continue
            if numerics.close(got, mistake, terms=terms, dtype=torch.float64):
                return hint.format(call=call)
            return wrong.format(call=call, got=got.tolist(), want=want.tolist())
    return None


def check_global_stats(my_global_stats) -> bool:
    """True if ``my_global_stats(counts, sums, squares)`` returns the mean and biased variance,
    per channel, of all ranks' samples together."""
    problem = _stats_problem(my_global_stats)
    if problem:
        print(tr("Not yet: {problem}.").format(problem=problem))
        return False
    print(tr("Correct: your statistics match those of all ranks' samples together, for equal and unequal shares."))
    return True
