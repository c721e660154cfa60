"""Self-checks for the exercises: each prints a verdict and returns True/False."""

from __future__ import annotations

from . import data


def verdict(problems: list[str], success: str) -> bool:
    """Print what is still wrong (or the success message); True when nothing is."""
    if problems:
        print("Not yet:\n  - " + "\n  - ".join(problems))
        return False
    print(success)
    return True


def check_worker_init_fn(worker_init_fn) -> bool:
    """Exercise 01: a worker_init_fn that gives every worker its own, reproducible noise."""
    problems = []
    first = data.noise_by_sample(num_workers=2, worker_init_fn=worker_init_fn, seed=123)
    again = data.noise_by_sample(num_workers=2, worker_init_fn=worker_init_fn, seed=123)
    other = data.noise_by_sample(num_workers=2, worker_init_fn=worker_init_fn, seed=456)
    if data.duplicated_noise(first):
        problems.append(f"samples {data.duplicated_noise(first)[:3]}... still get identical noise")
    if any(not (first[i][1] == again[i][1]).all() for i in first):
        problems.append("two runs with the same DataLoader generator seed differ: not reproducible")
    if all((first[i][1] == other[i][1]).all() for i in first):
        problems.append("a different DataLoader seed gives the same noise: the seed is ignored")
    return verdict(problems, "Correct: every sample gets its own noise, and the same seed reproduces it.")
