"""Recovery scenarios of the stress suite, repeated STRESS_ATTEMPTS times (default 20).

- kill -9 while the next checkpoint is being written: the previous checkpoint still loads
  (weights_only=True) and resuming from it ends bit-for-bit where an uninterrupted run ends;
- torchrun --max-restarts with a worker that dies on attempt 0: training completes,
  resuming from the checkpoint, with the uninterrupted run's result.
Rows are added to the table that test_stress.py prints.
"""

import contextlib
import io
import random
import time

import pytest
import test_stress
import torch

import distcourse
from conftest import stray_processes
from distcourse import checkpoints, train
from distcourse.common import checkpoint_files, subprocesses

pytestmark = pytest.mark.stress
ATTEMPTS = test_stress.ATTEMPTS


def record(name, outcomes, worst):
    passed = sum(outcomes)
    test_stress.RESULTS[name] = (passed, len(outcomes), worst)
    assert passed == len(outcomes), f"{name}: {passed}/{len(outcomes)}"


def test_kill9_while_writing_a_checkpoint(tmp_path):
    data = checkpoints.digits()
    (tmp_path / "reference").mkdir()
    reference = distcourse.launch(
        checkpoints.train_run, 2, args=(data, tmp_path / "reference"), kwargs={"steps": 12, "every": 4}, quiet=True
    )[0]["weights"]
    rng = random.Random(0)
    outcomes, worst = [], 0.0
    for attempt in range(ATTEMPTS):
        directory = tmp_path / f"run{attempt}"
        directory.mkdir()
        start = time.monotonic()
        # train to step 4 (checkpoint step-0004.pt), then die (SIGKILL) part-way into the next save
        distcourse.launch(checkpoints.train_run, 2, args=(data, directory), kwargs={"steps": 4, "every": 4}, quiet=True)
        cut = rng.randrange(1, 4 * 2**20)
        try:
            distcourse.launch(
                checkpoints.save_and_die,
                1,
                args=(checkpoint_files.checkpoint_path(directory, 8), True),
                kwargs={"megabytes": 4, "die_after": cut},
                init_process_group=False,
                quiet=True,
            )
            killed = False
        except distcourse.RankFailed as exc:
            killed = "SIGKILL" in str(exc)
        latest = checkpoint_files.latest_checkpoint(directory)
        loads = (
            latest is not None
            and latest.name == "step-0004.pt"
            and checkpoint_files.load_checkpoint(latest)["step"] == 4
        )
        resumed = distcourse.launch(
            checkpoints.train_run,
            2,
            args=(data, directory),
            kwargs={"steps": 12, "every": 4, "resume": True},
            quiet=True,
        )[0]["weights"]
        same = resumed.keys() == reference.keys() and all(torch.equal(resumed[k], reference[k]) for k in resumed)
        worst = max(worst, time.monotonic() - start)
        outcomes.append(killed and loads and same and not stray_processes())
    record("kill -9 while writing a checkpoint, then resume", outcomes, worst)


def test_torchrun_restart_resumes_from_checkpoint(tmp_path):
    out = tmp_path / "reference"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        train.main(["--steps", "8", "--batch-size", "8", "--out", str(out)])
    expected = subprocesses.Result(["train.main"], 0, 0, printed.getvalue(), "", 0.0).json(0, "result")
    expected_weights = checkpoint_files.load_checkpoint(out / "final.pt")
    outcomes, worst = [], 0.0
    for attempt in range(ATTEMPTS):
        run_dir = tmp_path / f"elastic{attempt}"
        start = time.monotonic()
        try:
            run = subprocesses.run(
                subprocesses.torchrun(
                    "--standalone",
                    "--nproc-per-node=2",
                    "--max-restarts=2",
                    script_args=[
                        "--steps",
                        8,
                        "--batch-size",
                        4,
                        "--out",
                        run_dir,
                        "--ckpt-dir",
                        run_dir,
                        "--save-every",
                        3,
                        "--crash-at",
                        5,
                    ],
                ),
                timeout=120,
            )
            result = run.json(0, "result")
            weights = checkpoint_files.load_checkpoint(run_dir / "final.pt")
            ok = (
                any("resumed from step 3" in line for line in run.ranks[0])
                and abs(result["loss"] - expected["loss"]) < 1e-6
                and max((weights[k] - expected_weights[k]).abs().max().item() for k in weights) < 1e-6
            )
        except Exception as exc:  # a failed attempt; the count below reports it
            print(f"attempt {attempt}: {exc!r}"[:500])
            ok = False
        worst = max(worst, time.monotonic() - start)
        outcomes.append(ok and not stray_processes())
    record("torchrun --max-restarts, worker dies on attempt 0", outcomes, worst)
