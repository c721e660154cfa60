"""How long do large results take to come back from the ranks? Shared memory vs the pipe.

Every rank returns a tensor of ``--megabytes`` MB (filled with its rank, checked).
``distcourse.launch`` sends it back two ways, timed alternately in one run:

* shared  - ``share_tensors=True`` (the default): torch.multiprocessing moves the
  tensor's storage into shared memory and only a file-descriptor handle travels;
* pipe    - ``share_tensors=False``: the tensor is pickled and its bytes copied
  through the rank's pipe, then unpickled.

A third job, *baseline*, makes the same tensors and returns None: process start,
process group and filling the tensor, everything but the trip back. Two ratios are
reported: of whole launches, and of the cost of the trip back alone (each path's
median minus the baseline's median, all timed in the same rounds).

    .venv/bin/python benchmarks/results_bench.py [--megabytes 200] [--repeats 5]

Prints a table and writes _build/bench/results.json.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import launch_jobs  # ranks import the job from it by name

import distcourse

OUT_DIR = Path(__file__).resolve().parent.parent / "_build" / "bench"


def timed(megabytes: int, world_size: int, path: str) -> float:
    keep = path != "baseline"
    start = time.perf_counter()
    results = distcourse.launch(
        launch_jobs.big_result,
        world_size,
        args=(megabytes, keep),
        share_tensors=path == "shared",
        quiet=True,
        timeout=300,
    )
    seconds = time.perf_counter() - start
    if not keep:
        if any(r is not None for r in results):
            raise SystemExit("results_bench: the baseline returned something")
        return seconds
    for rank, tensor in enumerate(results):
        if tensor.numel() != megabytes * 2**20 // 4 or tensor.min() != rank or tensor.max() != rank:
            raise SystemExit(f"results_bench: rank {rank} returned a wrong tensor; its timing would mean nothing")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=int, default=200, help="MB returned by each rank (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path (default 5)")
    parser.add_argument("--world-size", type=int, default=2)
    opts = parser.parse_args()
    if min(opts.megabytes, opts.repeats, opts.world_size) < 1:
        parser.error("--megabytes, --repeats and --world-size must be at least 1")

    distcourse.launch(launch_jobs.big_result, 1, args=(1,), quiet=True)  # starts the fork server, untimed
    times = {"shared": [], "pipe": [], "baseline": []}
    for i in range(opts.repeats):
        order = ("shared", "pipe", "baseline")
        for name in order[i % 3 :] + order[: i % 3]:  # rotate the order from round to round
            times[name].append(timed(opts.megabytes, opts.world_size, name))
        print(
            f"round {i + 1}/{opts.repeats}: " + ", ".join(f"{name} {t[-1]:.2f} s" for name, t in times.items()),
            flush=True,
        )
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["pipe"] / medians["shared"]
    trip = {name: max(medians[name] - medians["baseline"], 1e-9) for name in ("shared", "pipe")}
    trip_ratio = trip["pipe"] / trip["shared"]
    print(
        f"\n{opts.world_size} ranks x {opts.megabytes} MB returned, {opts.repeats} runs each, "
        f"{distcourse.cpu_cores()} cores"
    )
    print(f"{'path':<8} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, t in times.items():
        print(f"{name:<8} {medians[name]:>9.3f} {min(t):>7.3f} {max(t):>7.3f}")
    print(f"\nshared memory is {ratio:.1f}x faster than the pipe (whole launch, medians)")
    print(
        f"the trip back alone (median minus baseline): shared {trip['shared']:.3f} s, "
        f"pipe {trip['pipe']:.3f} s, {trip_ratio:.1f}x"
    )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    report = {
        "megabytes_per_rank": opts.megabytes,
        "world_size": opts.world_size,
        "repeats": opts.repeats,
        "cores": distcourse.cpu_cores(),
        "times_s": times,
        "median_s": medians,
        "pipe_over_shared": ratio,
        "trip_back_s": trip,
        "trip_back_pipe_over_shared": trip_ratio,
    }
    (OUT_DIR / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {OUT_DIR}/results.json")


if __name__ == "__main__":
    main()
