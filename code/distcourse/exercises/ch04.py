"""Self-check of chapter 04's exercise: which indices does a DistributedSampler give a rank?

The learner's function runs here, in the notebook's own process (a function defined
in a notebook cannot be sent to rank processes), and is compared with PyTorch's own
``DistributedSampler``, which needs no process group when it is told the world size
and the rank.
"""

from __future__ import annotations

import itertools

from torch.utils.data import DistributedSampler

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
                    return "my_shard returned None: return the list of this rank's indices"
                got = [int(i) for i in got]
            except Exception as exc:  # the learner's code may raise anything
                return f"{call} raised {type(exc).__name__}: {exc}"
            want = expected_shard(size, world, rank, epoch, seed)
            if got == want:
                continue
            if len(got) != len(want):
                return (
                    f"{call} gave {len(got)} indices instead of {len(want)}. Every rank must get "
                    f"ceil({size}/{world}) = {len(want)}: pad the permutation by repeating its start"
                )
            if epoch > 0 and got == expected_shard(size, world, rank, 0, seed):
                return f"{call} gave the order of epoch 0. Seed the generator with seed + epoch"
            return f"{call} gave {got}; DistributedSampler gives {want}"
    return None


def check_shard(my_shard) -> bool:
    """True if ``my_shard(size, world_size, rank, epoch, seed=0)`` yields exactly the indices
    of ``DistributedSampler(shuffle=True, drop_last=False)`` after ``set_epoch(epoch)``."""
    problem = _problem(my_shard)
    if problem:
        print(f"Not yet: {problem}.")
        return False
    print("Correct: your shards match DistributedSampler's for all sizes, world sizes, ranks, epochs and seeds tried.")
    return True
