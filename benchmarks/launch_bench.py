"""How long does it take to start a small multi-process job? Three launchers compared.

The job is the same each time: every rank joins a gloo process group, does one
all_reduce of a small tensor (checked), and leaves the group. It does almost
no work, so what is measured is the cost of starting and stopping ranks:

* mp.spawn   - torch.multiprocessing.spawn with the spawn start method;
* launcher   - distcourse.launch, which forks ranks from a preloaded fork server;
* torchrun   - torchrun --standalone, as a subprocess (as from a terminal).

    .venv/bin/python benchmarks/launch_bench.py [--repeats 7] [--world-size 2]

Prints a table and writes _build/bench/launch.json and launch.csv.
"""

import argparse
import csv
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import launch_jobs  # next to this script; ranks import the job from it by name
import torch
import torch.multiprocessing as mp

import distcourse

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "_build" / "bench"


def fail(method: str, detail: str) -> None:
    sys.exit(f"launch_bench: a {method} run failed, so its timing would mean nothing.\n{detail}")


def free_port() -> int:
    # Port 0 lets the OS pick an unused port. We must close the socket so that
    # rank 0 can listen on it; another program could grab it in between, but on
    # a benchmark machine that is rare enough to accept.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_spawn(world_size: int) -> float:
    port = free_port()
    start = time.perf_counter()
    try:
        # join=True raises if any rank exits non-zero (a failed all_reduce check
        # included), so returning normally means every rank exited with 0.
        mp.spawn(launch_jobs.spawn_job, args=(world_size, port), nprocs=world_size, join=True, start_method="spawn")
    except Exception as exc:
        fail("mp.spawn", str(exc))
    return time.perf_counter() - start


def run_launcher(world_size: int) -> float:
    start = time.perf_counter()
    try:
        # The launcher itself joins and leaves the process group around the job.
        results = distcourse.launch(launch_jobs.all_reduce_check, world_size, quiet=True)
    except distcourse.LaunchError as exc:
        fail("launcher", str(exc))
    seconds = time.perf_counter() - start
    expected = world_size * (world_size + 1) / 2
    if list(results) != [expected] * world_size:
        fail("launcher", f"ranks returned {list(results)}, expected {expected} each")
    return seconds


def run_torchrun(world_size: int) -> float:
    # sys.executable -m torch.distributed.run is the torchrun of this venv,
    # whatever `torchrun` happens to be first on PATH.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        str(Path(__file__).with_name("launch_jobs.py")),
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        fail("torchrun", "it did not finish within 120 s")
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        fail("torchrun", f"exit code {done.returncode}; last output:\n{(done.stdout + done.stderr)[-3000:]}")
    return seconds


def machine() -> dict:
    return {
        "cpu_cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpus": torch.cuda.device_count(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def summary(times: list) -> dict:
    return {
        "runs": len(times),
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "times_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per method (default 7)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per job (default 2)")
    opts = parser.parse_args()
    if opts.repeats < 1 or opts.world_size < 1:
        parser.error("--repeats and --world-size must be at least 1")

    # The launcher pins gloo to loopback; do the same for the other two (their
    # ranks inherit this environment) so that all three do the same network work.
    os.environ["GLOO_SOCKET_IFNAME"] = distcourse.runtime.hardware.loopback_interface()

    # The first launch in a process also starts the fork server (one interpreter
    # that imports torch). A notebook pays that once per kernel, so it is timed
    # and shown on its own rather than mixed into the medians.
    cold = run_launcher(opts.world_size)
    print(f"launcher cold start (starts the fork server): {cold:.2f} s", flush=True)

    runners = {"mp.spawn": run_spawn, "launcher": run_launcher, "torchrun": run_torchrun}
    times = {name: [] for name in runners}
    names = list(runners)
    for i in range(opts.repeats):
        # Round-robin, and each round starts with the next method, so that a
        # noisy moment or a run still cleaning up after the previous one does
        # not always land on the same method.
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(runners[name](opts.world_size))
        print(f"round {i + 1}/{opts.repeats}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names), flush=True)

    results = {"launcher (cold, 1st)": summary([cold])}
    results.update({name: summary(times[name]) for name in names})
    fast = results["launcher"]["median_s"]
    ratios = {
        "mp.spawn / launcher": results["mp.spawn"]["median_s"] / fast,
        "torchrun / launcher": results["torchrun"]["median_s"] / fast,
    }
    info = machine()

    print(f"\n{opts.world_size}-rank gloo job (init, one all_reduce, destroy), {opts.repeats} warm runs each")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"\n{'method':<21} {'runs':>4} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, r in results.items():
        print(f"{name:<21} {r['runs']:>4} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f}")
    print(
        f"\nlauncher is {ratios['mp.spawn / launcher']:.1f}x faster than mp.spawn "
        f"and {ratios['torchrun / launcher']:.1f}x faster than torchrun (medians, warm launcher)"
    )

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    report = {
        "job": "init_process_group + all_reduce + destroy_process_group (gloo)",
        "world_size": opts.world_size,
        "repeats": opts.repeats,
        "machine": info,
        "results": results,
        "ratios": ratios,
    }
    (OUT_DIR / "launch.json").write_text(json.dumps(report, indent=2) + "\n")
    with open(OUT_DIR / "launch.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "world_size", "runs", "median_s", "min_s", "max_s", "times_s", *info])
        for name, r in results.items():
            writer.writerow(
                [
                    name,
                    opts.world_size,
                    r["runs"],
                    f"{r['median_s']:.4f}",
                    f"{r['min_s']:.4f}",
                    f"{r['max_s']:.4f}",
                    " ".join(f"{t:.4f}" for t in r["times_s"]),
                    *info.values(),
                ]
            )
    print(f"\nwrote {OUT_DIR.relative_to(ROOT)}/launch.json and launch.csv")


if __name__ == "__main__":
    main()
