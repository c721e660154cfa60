"""Chapter 07: the training script, the torchrun helpers, the SLURM script, the self-checks.

Fast tests first; the repeated elastic restarts at the end are marked slow.
"""

import ast
import contextlib
import io
import json
import pathlib
import re
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import torch

from distcourse import launchers, train
from distcourse.common import checkpoint_files, subprocesses
from distcourse.exercises import ch07

CODE = pathlib.Path(train.__file__).parent
B, STEPS = 4, 8  # tiny runs: the tests check behaviour, not training


def script_args(out, *extra):
    return ["--steps", STEPS, "--batch-size", B, "--out", out, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process with the global batch 2B, run in this process: what every launch must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.main([str(a) for a in ["--steps", STEPS, "--batch-size", 2 * B, "--out", out]])
    result = subprocesses.Result(["train.main"], 0, 0, printed.getvalue(), "", 0.0).json(0, "result")
    return result, checkpoint_files.load_checkpoint(out / "final.pt")


def same_as(reference, result, out) -> None:
    ref_result, ref_weights = reference
    assert abs(result["loss"] - ref_result["loss"]) < 1e-6
    weights = checkpoint_files.load_checkpoint(out / "final.pt")
    assert max((weights[k] - ref_weights[k]).abs().max().item() for k in weights) < 1e-6


# --- the script ---------------------------------------------------------------------------


def test_ranks_slices_make_up_the_single_process_batch():
    data = train.make_data(0)
    for step in (0, 7):
        whole_x, _ = train.batch_for(data, step, rank=0, world_size=1, batch_size=2 * B)
        parts = [train.batch_for(data, step, rank=r, world_size=2, batch_size=B)[0] for r in (0, 1)]
        assert torch.equal(torch.cat(parts), whole_x)


def test_single_process_mode_needs_no_process_group(reference):
    result, _ = reference
    assert result["world_size"] == 1 and result["steps"] == STEPS
    assert not torch.distributed.is_initialized()


def test_source_rules():
    tree = ast.parse((CODE / "train.py").read_text())
    setup = ast.parse((CODE / "common" / "distributed.py").read_text())  # init_process_group lives there
    calls = [n for t in (tree, setup) for n in ast.walk(t) if isinstance(n, ast.Call)]
    inits = [c for c in calls if getattr(c.func, "attr", None) == "init_process_group"]
    assert inits and all("timeout" in {k.arg for k in c.keywords} for c in inits)
    loads = [c for c in calls if getattr(c.func, "attr", None) == "load" and ast.unparse(c.func) == "torch.load"]
    assert all(any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in c.keywords) for c in loads)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    finals = [t for t in ast.walk(main) if isinstance(t, ast.Try) and t.finalbody]
    assert any("destroy_process_group" in ast.unparse(t.finalbody) for t in finals)


def test_no_hard_coded_ports_outside_the_slurm_script():
    # torchrun's conventional ports (29400, 29500) belong in the cluster script only; the
    # code here always asks the OS for a free port on 127.0.0.1.
    for name in ("train.py", "common/subprocesses.py", "common/distributed.py"):
        text = (CODE / name).read_text()
        assert not re.search(r"\b29[45]00\b", text) and "0.0.0.0" not in text, name
    assert "29500" in launchers.SLURM_SCRIPT.read_text()


def test_torchrun_and_single_process_agree(reference, tmp_path, no_leftovers):
    run = subprocesses.run(
        subprocesses.torchrun(
            "--standalone", "--nproc-per-node=2", script_args=script_args(tmp_path, "--print-env", "--progress", "on")
        ),
        timeout=120,
    )
    # The progress bar, asked for on every rank, is drawn by rank 0 only, to stderr.
    assert "rank 0, attempt 0: 100%" in run.stderr and "rank 1, attempt" not in run.stderr
    assert run.json(0, "store") == {"store": "agent's, prefix attempt0/", "left_over": []}
    result = run.json(0, "result")
    assert result["world_size"] == 2
    same_as(reference, result, tmp_path)
    workers = {r: run.json(r, "worker") for r in run.ranks}
    assert sorted(workers) == [0, 1]
    for rank, w in workers.items():
        env = w["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert env["GROUP_RANK"] == "0" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert not any(a.startswith("--local") for a in w["argv"])  # torchrun adds no --local-rank
    assert [r for r in run.ranks if run.all_json(r, "result")] == [0]  # only the master reports


def test_progress_bar_on_rank_0_only_where_it_keeps_logs_clean(tmp_path):
    for progress, drawn in (("on", True), ("off", False), ("auto", False)):  # auto: pytest's stderr is no terminal
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            train.main(["--steps", "3", "--progress", progress])
        assert ("rank 0, attempt 0: 100%" in err.getvalue()) == drawn, (progress, err.getvalue())


def test_shared_store_with_restarts_on_several_nodes_is_refused(monkeypatch):
    """Restart counts are per agent: with torchrun's shared store they cannot name an attempt on 2 nodes."""
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(subprocesses.free_port()),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        train.main(["--steps", "1", "--timeout", "2"])


def test_legacy_launcher_passes_local_rank_and_torchrun_does_not():
    args = ["--standalone", "--nproc-per-node=2", "-m", "distcourse.train"]
    assert launchers.worker_command("torchrun", args, 1)[1:] == ["-u", "-m", "distcourse.train"]
    assert launchers.worker_command("torch.distributed.launch", args, 1)[-1] == "--local-rank=1"
    assert launchers.worker_command("torch.distributed.launch", ["--use-env"] + args, 1) == launchers.worker_command(
        "torchrun", args, 1
    )


# --- helpers: ports, parsing, teardown ----------------------------------------------------


def test_free_port_is_a_free_loopback_port():
    port = subprocesses.free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_per_rank_parsing():
    text = '[rank 1] worker {"pid": 2}\nnoise\n[rank 0] result {"loss": 1.5}\n[rank 0] result {"loss": 0.5}\n'
    result = subprocesses.Result(["x"], 1, 0, text, "", 0.0)
    assert result.ranks == {0: ['result {"loss": 1.5}', 'result {"loss": 0.5}'], 1: ['worker {"pid": 2}']}
    assert result.json(0, "result") == {"loss": 0.5} and len(result.all_json(0, "result")) == 2
    assert subprocesses.find_json([subprocesses.Result(["y"], 2, 0, "", "", 0.0), result], 1, "worker") == {"pid": 2}
    with pytest.raises(KeyError):
        result.json(1, "result")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow  # waits for an 8 s timeout
def test_timeout_stops_agent_and_workers(tmp_path, no_leftovers):
    # The last rank hangs; the other waits in a collective: only the timeout can end this.
    cmd = subprocesses.torchrun(
        "--standalone", "--nproc-per-node=2", script_args=script_args(tmp_path, "--print-env", "--hang-at", 2)
    )
    started = time.monotonic()
    with pytest.raises(subprocesses.TorchrunTimeout) as info:
        subprocesses.run(cmd, timeout=8)
    assert time.monotonic() - started < 8 + 10  # the teardown itself is quick
    agent = info.value.results[0]
    pids = [agent.json(r, "worker")["pid"] for r in agent.ranks]
    assert len(pids) == 2  # the workers were running when the timeout came...
    assert all(_gone(pid) for pid in pids)  # ...and are gone now, though torchrun gave them their own sessions
    assert not subprocesses.group_alive(agent.pid)


def test_failure_of_one_agent_stops_the_other(no_leftovers):
    fails = [sys.executable, "-c", "import sys; print('[rank 0] bye'); sys.exit(3)"]
    sleeps = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    with pytest.raises(subprocesses.TorchrunError) as info:
        subprocesses.run_together([fails, sleeps], timeout=60, grace=0.5)
    assert time.monotonic() - started < 15
    first, second = info.value.results
    assert first.returncode == 3 and first.ranks == {0: ["bye"]}
    assert second.returncode is not None and second.returncode < 0  # stopped by a signal
    assert not subprocesses.group_alive(second.pid)


def test_run_together_starts_a_command_when_its_moment_comes(tmp_path, no_leftovers):
    flag = tmp_path / "flag"
    first = [sys.executable, "-c", f"import pathlib, time; time.sleep(0.3); pathlib.Path({str(flag)!r}).touch()"]
    second = [
        sys.executable,
        "-c",
        f"import pathlib; print('[rank 0] flag there:', pathlib.Path({str(flag)!r}).exists())",
    ]
    _, late = subprocesses.run_together([first, second], timeout=30, start_when=[None, flag.exists])
    assert late.ranks == {0: ["flag there: True"]}
    with pytest.raises(subprocesses.TorchrunTimeout) as err:  # a moment that never comes is a timeout
        subprocesses.run_together([first, second], timeout=1.5, start_when=[None, lambda: False])
    assert err.value.results[0].returncode == 0 and err.value.results[1].returncode is None


def test_interrupted_wait_stops_everything(monkeypatch, no_leftovers):
    def interrupted(*args, **kwargs):
        time.sleep(0.3)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocesses, "_wait_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        subprocesses.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=60)


def test_child_env_makes_distcourse_importable_anywhere(tmp_path):
    env = subprocesses.child_env()
    assert env["OMP_NUM_THREADS"] == "1"
    out = subprocess.run(
        [sys.executable, "-c", "import distcourse.train, os; print(os.environ['OMP_NUM_THREADS'])"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "1"


# --- SLURM ----------------------------------------------------------------------------


def test_slurm_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(launchers.SLURM_SCRIPT)], check=True)


def test_slurm_script_runs_torchrun_once_per_node_with_c10d_rendezvous():
    options = launchers.sbatch_options()
    assert options["nodes"] == "2" and options["ntasks-per-node"] == "1" and "gpus-per-node" in options
    seen = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": None, "SRUN_CPUS_PER_TASK": None, "OMP_NUM_THREADS": None}
    calls = launchers.slurm_dry_run(nodes=("gpu17", "gpu18"), job_id="991", srun_env=seen)
    assert seen["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a new store each round: restarts on 2 nodes work
    # Slurm >= 22.05: srun passes the job's CPUs on to its task only through SRUN_CPUS_PER_TASK (or -c)
    assert seen["SRUN_CPUS_PER_TASK"] == options["cpus-per-task"]
    assert int(seen["OMP_NUM_THREADS"]) * int(options["gpus-per-node"]) == int(options["cpus-per-task"])
    assert len(calls) == 1
    words = calls[0]
    assert words[0] == "torchrun"
    flags = dict(w.split("=", 1) for w in words if w.startswith("--") and "=" in w)
    assert flags["--nnodes"] == "2"  # from $SLURM_NNODES
    assert flags["--nproc-per-node"] == options["gpus-per-node"]
    assert flags["--rdzv-backend"] == "c10d"
    assert flags["--rdzv-endpoint"] == "gpu17:29500"  # the first node of the allocation
    assert flags["--rdzv-id"] == "991"
    assert words[words.index("-m") + 1] == "distcourse.train"
    assert words.index("-m") > max(i for i, w in enumerate(words) if w.startswith("--rdzv"))  # launcher flags first
    # torchrun's own parser accepts the command as it stands
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(words[1:])
    assert args.module and args.training_script == "distcourse.train" and args.max_restarts >= 1
    # room for checkpoint writes and evaluation, more than the default meant for one machine
    assert train.parse_args(args.training_script_args).timeout >= 600 > train.parse_args([]).timeout


def test_slurm_dry_run_sees_a_missing_cpu_export(tmp_path, monkeypatch):
    """The check above can fail: without the export srun sees no SRUN_CPUS_PER_TASK, even when
    the dry run itself runs inside a job that has one."""
    text = launchers.SLURM_SCRIPT.read_text()
    line = "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK\n"
    assert text.count(line) == 1
    old_script = tmp_path / "old.sbatch"
    old_script.write_text(text.replace(line, ""))
    monkeypatch.setenv("SRUN_CPUS_PER_TASK", "32")  # as in a real allocation
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    seen = {"SRUN_CPUS_PER_TASK": None, "SLURM_JOB_ID": None}
    launchers.slurm_dry_run(old_script, job_id="5", srun_env=seen)
    assert seen == {"SRUN_CPUS_PER_TASK": None, "SLURM_JOB_ID": "5"}


def test_slurm_script_follows_the_head_node():
    calls = launchers.slurm_dry_run(nodes=("alpha", "beta", "gamma"), job_id="5")
    flags = dict(w.split("=", 1) for w in calls[0] if w.startswith("--") and "=" in w)
    assert flags["--rdzv-endpoint"] == "alpha:29500" and flags["--nnodes"] == "3"


# --- self-checks ------------------------------------------------------------------------


def test_global_rank_check_rejects_wrong_and_accepts_right(capsys):
    assert ch07.check_global_rank(lambda node, local, nproc: None) is False
    assert "Not yet" in capsys.readouterr().out
    assert ch07.check_global_rank(lambda node, local, nproc: local * nproc + node) is False
    assert ch07.check_global_rank(lambda node, local, nproc: node + local) is False
    assert ch07.check_global_rank(lambda node, local, nproc: node * nproc + local) is True
    assert "Correct" in capsys.readouterr().out


def test_torchrun_command_check_rejects_wrong_and_accepts_right(capsys):
    right = (
        "torchrun --nnodes=4 --nproc-per-node=8 --rdzv-id=777 --rdzv-backend=c10d "
        "--rdzv-endpoint=gpu-node-01:29500 -m distcourse.train"
    )
    assert ch07.check_torchrun_command(right) is True
    assert ch07.check_torchrun_command(right.replace("--nproc-per-node=8", "--nproc_per_node 8") + " --steps 5")
    wrong = [
        "",
        "python train.py",
        right.replace("--nnodes=4", "--nnodes=2"),
        right.replace("gpu-node-01:29500", "localhost:29500"),
        right.replace("--rdzv-backend=c10d", "--rdzv-backend=static"),
        right.replace("-m distcourse.train", "distcourse/train.py"),
        right.replace("torchrun ", "torchrun --standalone "),
        "torchrun --nonsense",
    ]
    capsys.readouterr()
    for command in wrong:
        assert ch07.check_torchrun_command(command) is False, command
    assert capsys.readouterr().out.count("Not yet") == len(wrong)


def test_notebook_exercise_cells_hold_stubs():
    import nbformat

    nb = nbformat.read(CODE.parents[1] / "chapters/en/07-torchrun.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert "    pass" in code[-2] and ".check_global_rank(my_global_rank)" in code[-2]
    assert 'my_command = ""' in code[-1] and ".check_torchrun_command(my_command)" in code[-1]


# --- several agents on one machine: one GPU each, or none ---------------------------------


def fake_gpus(monkeypatch, count: int, visible: str | None = None) -> None:
    """This process sees ``count`` GPUs (and a torch built with NCCL); nothing touches a driver."""
    from distcourse.runtime import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(hardware, "nvidia_smi_gpus", lambda: ())
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def worker_gpus(envs: list[dict], visible_here: str | None) -> list[str | None]:
    """The GPU (as the machine names it) that each agent's only worker takes: ``cuda:LOCAL_RANK``,
    i.e. the first of the GPUs its environment leaves visible; None for the CPU."""
    taken = []
    for env in envs:
        visible = env.get("CUDA_VISIBLE_DEVICES", visible_here)
        ids = visible.split(",") if visible is not None else ["0"]  # unset: all GPUs, cuda:0 first
        taken.append(ids[0] if ids[0] else None)
    return taken


@pytest.mark.parametrize("gpus, visible", [(2, None), (4, None), (2, "3,5"), (1, None), (0, None)])
def test_agents_on_one_machine_never_share_a_gpu(monkeypatch, gpus, visible):
    """Two agents with one worker each both start LOCAL_RANK 0: without an environment of its
    own, each would take cuda:0 and NCCL would refuse the pair ("Duplicate GPU detected")."""
    fake_gpus(monkeypatch, gpus, visible)
    taken = worker_gpus(subprocesses.node_envs(2), visible)
    if gpus >= 2:
        assert None not in taken and len(set(taken)) == 2, taken  # a GPU each, distinct
        assert set(taken) <= set((visible or "0,1,2,3").split(","))  # named as this process sees them
    else:
        assert taken == [None, None]  # too few GPUs: both on the CPU, gloo
    assert all(e["OMP_NUM_THREADS"] == "1" for e in subprocesses.node_envs(2))  # still child_env underneath


def test_two_node_cells_give_each_agent_its_own_environment():
    """Every notebook cell that starts several torchrun agents of one job on this machine
    passes ``env=tt.node_envs(...)``."""
    import nbformat

    for name in ("07-torchrun", "07-torchrun-elastic", "12-capstone-at-scale"):
        nb = nbformat.read(CODE.parents[1] / f"chapters/en/{name}.ipynb", as_version=4)
        cells = [c.source for c in nb.cells if c.cell_type == "code" and "tt.run_together" in c.source]
        multi_node = [c for c in cells if "--nnodes" in c or "node_command(" in c or "node(" in c]
        assert multi_node, name
        assert all("env=tt.node_envs(" in c or "env=node_env" in c for c in multi_node), name


# --- slow: multi-node and repeated elastic restarts --------------------------------------


@pytest.mark.slow
def test_two_agents_as_two_nodes(reference, tmp_path, no_leftovers):
    port, run_id = subprocesses.free_port(), uuid.uuid4().hex
    nodes = [
        subprocesses.torchrun(
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={n}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--local-addr=127.0.0.1",
            script_args=script_args(tmp_path, "--print-env"),
        )
        for n in (0, 1)
    ]
    env = subprocesses.child_env(CUDA_VISIBLE_DEVICES="")
    agents = subprocesses.run_together(nodes, env=env, timeout=120)
    same_as(reference, subprocesses.find_json(agents, 0, "result"), tmp_path)
    group_ranks = sorted(a.json(r, "worker")["env"]["GROUP_RANK"] for a in agents for r in a.ranks)
    assert group_ranks == ["0", "1"]


ELASTIC_ATTEMPTS = 1  # the stress suite (tests/test_stress_recovery.py) repeats it 20 times
ELASTIC_RESULTS: list[bool] = []


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(ELASTIC_ATTEMPTS))
def test_elastic_restart_resumes_and_matches(reference, tmp_path, attempt, no_leftovers):
    ok = False
    try:
        run = subprocesses.run(
            subprocesses.torchrun(
                "--standalone",
                "--nproc-per-node=2",
                "--max-restarts=2",
                script_args=script_args(
                    tmp_path, "--ckpt-dir", tmp_path, "--save-every", 3, "--crash-at", 5, "--print-env"
                ),
            ),
            timeout=120,
        )
        restarts = [w["env"]["TORCHELASTIC_RESTART_COUNT"] for w in run.all_json(0, "worker")]
        assert restarts == ["0", "1"]
        assert run.ranks[1].count("simulated crash in step 5") == 1
        assert "resumed from step 3 (step-0003.pt)" in run.ranks[0]
        same_as(reference, run.json(0, "result"), tmp_path)
        log = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == [0, 1, 2, 3, 4] + list(range(3, STEPS))
        ok = True
    finally:
        ELASTIC_RESULTS.append(ok)
        print(f"elastic restarts: {sum(ELASTIC_RESULTS)}/{len(ELASTIC_RESULTS)} passed")


# --- bad environment values -----------------------------------------------------------


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"RANK": "zero", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
            "RANK='zero' is not an integer",
        ),
        (
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "0", "LOCAL_WORLD_SIZE": "1"},
            "WORLD_SIZE=0 must be at least 1",
        ),
        ({"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "do not fit"),
        ({"RANK": "0"}, "LOCAL_RANK is not set"),
    ],
)
def test_bad_launcher_environment_is_a_clear_error(monkeypatch, env, message):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        train.main(["--steps", "1"])


def test_store_text_says_what_init_distributed_reports():
    from distcourse.common import distributed

    assert distributed.store_text("new each round") == "new each round"
    assert distributed.store_text("agent's, prefix attempt1/") == "the agent's, prefix attempt1/"
