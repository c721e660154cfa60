"""The rank launcher's contract (GUIDE section 4): results, output, failures, teardown.

Every test runs under the ``no_leftovers`` fixture, which lists the process tree
after the test and fails if any rank (or anything else) is still there.
"""

import os
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

import distcourse
import rank_workers as w
from distcourse import LaunchTimeout, RankFailed, launch
from interrupts import interrupt_when_ranks_run

pytestmark = pytest.mark.usefixtures("no_leftovers")
TESTS = os.path.dirname(__file__)


def test_returns_each_ranks_value_indexed_by_rank():
    results = launch(w.rank_and_sum, 2, quiet=True)
    assert list(results) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert results.plan.backend == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")


def test_world_size_one_and_three():
    assert launch(w.rank_and_sum, 1, quiet=True) == [(0, 1, 1.0)]
    assert [r[2] for r in launch(w.rank_and_sum, 3, quiet=True)] == [6.0] * 3


def test_output_is_labelled_by_rank_in_rank_order(capsys):
    launch(w.chatty, 2)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("launch: 2 ranks")
    rank_lines = [line for line in lines if line.startswith("[rank")]
    # grouped: every rank-0 line comes before every rank-1 line, even though rank 1 printed first
    assert [line[:8] for line in rank_lines] == ["[rank 0]"] * 4 + ["[rank 1]"] * 4
    assert "[rank 0] line 2 of rank 0" in lines
    # output written straight to file descriptor 2 (as C++ code does) is relayed too
    assert "[rank 1] raw fd-2 write of rank 1" in lines


def test_streamed_output_is_labelled(capsys):
    launch(w.chatty, 2, stream=True)
    out = capsys.readouterr().out
    assert "[rank 1] line 0 of rank 1" in out and "[rank 0] line 2 of rank 0" in out


def test_threads_per_rank_and_environment(capsys):
    cores = distcourse.cpu_cores()
    results = launch(w.threads_and_env, 2)
    expected = max(1, cores // 2)
    assert [r[0] for r in results] == [expected, expected]
    assert f"{expected} intra-op thread" in capsys.readouterr().out
    for rank, (_, env, _) in enumerate(results):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
    assert launch(w.threads_and_env, 2, threads=1, quiet=True)[0][0] == 1


def test_environment_at_the_launch_call_reaches_every_rank(monkeypatch):
    """Variables set after the fork server started reach the ranks, as under mp.spawn and torchrun."""
    distcourse.warm_up()  # the fork server starts with the environment of this moment
    names = ("DISTCOURSE_PROBE", "TORCH_DISTRIBUTED_DEBUG", "NCCL_DEBUG", "DISTCOURSE_EXTRA")
    monkeypatch.setenv("DISTCOURSE_PROBE", "set after warm_up")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    for seen, level in launch(w.environment_seen, 2, args=(names,), quiet=True):
        assert seen == {
            **dict.fromkeys(names),
            "DISTCOURSE_PROBE": "set after warm_up",
            "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
            "NCCL_DEBUG": "INFO",
        }
        assert level.endswith("DETAIL"), level  # applied before the process group was created

    monkeypatch.delenv("NCCL_DEBUG")  # removing a variable removes it in the ranks too
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    env = {"DISTCOURSE_EXTRA": "one launch only", "DISTCOURSE_PROBE": None}
    for seen, level in launch(w.environment_seen, 2, args=(names,), env=env, quiet=True):
        assert seen == {**dict.fromkeys(names), "DISTCOURSE_EXTRA": "one launch only"}
        assert level.endswith("OFF"), level
    assert "DISTCOURSE_EXTRA" not in os.environ and os.environ["DISTCOURSE_PROBE"] == "set after warm_up"


@pytest.mark.parametrize("env", [{"A=B": "1"}, {"": "1"}, {"X": 1}])
def test_bad_environment_is_refused_before_any_rank_starts(env):
    with pytest.raises(ValueError, match="env"):
        launch(w.rank_and_sum, 2, env=env, quiet=True)


def test_every_launch_gets_fresh_processes_and_port():
    first = launch(w.threads_and_env, 2, quiet=True)
    second = launch(w.threads_and_env, 2, quiet=True)
    assert {r[2] for r in first}.isdisjoint({r[2] for r in second})
    assert first[0][1]["MASTER_PORT"] != second[0][1]["MASTER_PORT"]


def test_arguments_and_results_travel():
    assert launch(w.echo, 2, args=(w.Payload(5),), quiet=True) == [5, 10]


def test_without_process_group():
    assert launch(w.no_process_group, 2, init_process_group=False, quiet=True) == [(False, 0), (False, 1)]


def test_failing_rank_stops_the_others_and_reports_its_traceback(capsys):
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(w.raise_on, 2, kwargs={"rank_to_fail": 1}, timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    message = str(info.value)
    assert "rank 1 failed" in message
    assert "Traceback" in message and "ValueError: deliberate failure on rank 1" in message
    assert "raise_on" in message  # the frame of the rank's own function


def test_nonzero_exit_is_a_failure():
    with pytest.raises(RankFailed, match="rank 1 exited with code 3"):
        launch(w.exit_with, 2, args=(3,), timeout=60)


def test_rank_killed_by_signal_is_a_failure():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="killed by signal SIGKILL"):
        launch(w.kill_self, 2, timeout=60)
    assert time.monotonic() - start < 10


def test_unpicklable_return_value_is_reported():
    with pytest.raises(RankFailed, match="cannot be pickled"):
        launch(w.unpicklable_result, 2, quiet=True)


def test_whole_run_timeout_stops_every_rank():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match="timeout") as info:
        launch(w.sleep_forever, 2, timeout=2)
    assert 2 <= time.monotonic() - start < 6
    assert info.value.running == [0, 1]


def test_collective_timeout_raises_inside_the_rank():
    with pytest.raises(RankFailed, match="(?i)timed out") as info:
        launch(w.uneven_barrier, 2, timeout=30, collective_timeout=2)
    assert info.value.rank == 0


def test_interrupted_cell_stops_every_rank(tmp_path):
    # A notebook's "interrupt kernel" is SIGINT to the kernel, i.e. KeyboardInterrupt here,
    # sent once both ranks sleep; the stop itself must take seconds, not the launch's timeout.
    ended = threading.Event()
    interrupter = interrupt_when_ranks_run(str(tmp_path), ended)
    with pytest.raises(KeyboardInterrupt):
        try:
            launch(w.sleep_forever, 2, kwargs={"pid_dir": str(tmp_path)}, timeout=60)
        finally:
            interrupted = time.monotonic()
            ended.set()
    assert len(list(tmp_path.iterdir())) == 2, "the ranks never started"
    interrupter.join()
    assert interrupted - interrupter.sent_at < 6


def test_rendezvous_listens_on_loopback_only(tmp_path):
    box = {}
    kwargs = {"folder": str(tmp_path)}
    thread = threading.Thread(target=lambda: box.update(r=launch(w.wait_for_release, 2, kwargs=kwargs, quiet=True)))
    thread.start()
    # Look while both ranks are inside the rank function (process group up), as they say, not
    # after a guessed number of seconds: a busy machine can take longer than that to start them.
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("rank*.ready"))) < 2 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    family = [psutil.Process()] + psutil.Process().children(recursive=True)
    pids = {p.pid for p in family}
    listening = [c for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    (tmp_path / "release").touch()
    thread.join()
    assert box["r"] == [0, 1]
    assert listening, "expected the store (and gloo) to be listening"
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}, listening


def test_ranks_die_with_their_kernel(tmp_path):
    """A kernel that dies (kill -9) while ranks run takes its ranks with it."""
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {TESTS!r})
        import distcourse, rank_workers
        distcourse.launch(rank_workers.sleep_forever, 2, args=({str(tmp_path)!r},), timeout=600)
        """
    )
    kernel = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.pid"))) < 2:
        assert time.monotonic() < deadline and kernel.poll() is None, "ranks never started"
        time.sleep(0.1)
    rank_pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    helpers = [c.pid for c in psutil.Process(kernel.pid).children()]
    kernel.kill()
    kernel.wait()
    deadline = time.monotonic() + 10
    alive = rank_pids + helpers
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        time.sleep(0.1)
    assert not alive, f"still running after the kernel died: {alive}"


@pytest.mark.parametrize(
    "world_size, message",
    [(0, "at least 1"), (-2, "at least 1"), (10_000, "more processes"), ("2", "integer"), (True, "integer")],
)
def test_bad_world_size_is_rejected_before_starting(world_size, message):
    with pytest.raises(ValueError, match=message):
        launch(w.rank_and_sum, world_size)


def test_backend_the_machine_lacks_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        launch(w.rank_and_sum, 2, backend="mpi")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="nccl"):
            launch(w.rank_and_sum, 64, backend="nccl")


def test_notebook_functions_are_rejected_with_a_fix():
    def inner():
        return 1

    notebook_fn = lambda: 1  # noqa: E731
    notebook_fn.__module__ = "__main__"
    for fn in (inner, notebook_fn, lambda: 1):
        with pytest.raises(ValueError, match="move it into a file"):
            launch(fn, 2)


def test_notebook_objects_in_arguments_are_rejected():
    Local = type("Local", (), {"__module__": "__main__"})
    with pytest.raises(ValueError, match="defined in the notebook"):
        launch(w.echo, 2, args=(Local(),))


@pytest.mark.parametrize("kwargs", [{"timeout": 0}, {"timeout": -1}, {"collective_timeout": 0}, {"threads": 0}])
def test_bad_timeouts_and_threads_are_rejected(kwargs):
    with pytest.raises(ValueError):
        launch(w.rank_and_sum, 2, **kwargs)


def test_two_launchers_at_once_do_not_collide():
    """Two independent kernels (like two pytest workers) launching repeatedly at the same time."""
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {TESTS!r})
        import distcourse, rank_workers
        for _ in range(8):
            assert distcourse.launch(rank_workers.rank_and_sum, 2, quiet=True) == [(0, 2, 3.0), (1, 2, 3.0)]
        print("ok")
        """
    )
    kernels = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [k.communicate(timeout=120)[0] for k in kernels]
    assert [k.returncode for k in kernels] == [0, 0] and outputs == ["ok\n", "ok\n"]


def test_importing_the_package_does_not_initialise_cuda():
    code = "import distcourse, torch; distcourse.plan(1); print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --- ranks with children of their own (DataLoader workers, pools, subprocesses) -------------


def _all_gone(pids, grace=5.0):
    deadline = time.monotonic() + grace
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        time.sleep(0.05)
    return alive


def _recorded_pids(folder):
    pids = [int(pid) for path in folder.glob("*.pids") for pid in path.read_text().split()]
    return pids


def test_ranks_train_ddp_with_dataloader_workers():
    results = launch(w.ddp_with_loader_workers, 2, kwargs={"steps": 4, "num_workers": 2}, quiet=True)
    assert torch.equal(results[0]["params"], results[1]["params"]), "DDP replicas diverged"
    for r in results:
        assert len(r["workers"]) == 2 and r["pid"] not in r["workers"], r
    assert set(results[0]["workers"]).isdisjoint(results[1]["workers"])


def test_a_rank_starts_processes_the_way_a_script_would():
    import multiprocessing

    expected = multiprocessing.get_context().get_start_method()  # not the launcher's fork server
    assert launch(w.start_method, 2, quiet=True) == [expected] * 2


def test_a_rank_may_run_a_subprocess_and_a_pool():
    assert launch(w.uses_subprocess_and_pool, 2, quiet=True) == [(42, [1, 2, 3])] * 2


@pytest.mark.parametrize("then", ["raise", "hang", "orphan", "interrupt"])
def test_no_worker_or_grandchild_outlives_the_launch(tmp_path, then):
    """A failing rank, a timeout, an orphaned grandchild that ignores SIGTERM, an interrupted cell:
    every DataLoader worker and grandchild the run started is gone afterwards."""
    kwargs = {"pid_dir": str(tmp_path), "then": "hang" if then == "interrupt" else then}
    ended = threading.Event()
    interrupter = interrupt_when_ranks_run(str(tmp_path), ended) if then == "interrupt" else None
    expected = {"raise": RankFailed, "hang": LaunchTimeout, "orphan": RankFailed, "interrupt": KeyboardInterrupt}
    with pytest.raises(expected[then]):
        try:
            launch(w.ddp_with_loader_workers, 2, kwargs=kwargs, timeout=4 if then == "hang" else 60, quiet=True)
        finally:
            ended.set()
    if interrupter:
        interrupter.join()
    recorded = _recorded_pids(tmp_path)
    assert len(recorded) >= (3 if then == "orphan" else 2), f"the ranks recorded too few children: {recorded}"
    assert not _all_gone(recorded), "children of ranks outlived the launch"


def test_tensors_come_back_through_shared_memory_or_the_pipe():
    shared = launch(w.big_tensor, 2, args=(4,), quiet=True)
    piped = launch(w.big_tensor, 2, args=(4,), quiet=True, share_tensors=False)
    for rank in (0, 1):
        assert torch.equal(shared[rank], piped[rank]) and shared[rank].numel() == 2**20
        assert shared[rank][0].item() == rank
    assert shared[0].is_shared() and not piped[0].is_shared()


def test_progress_bar_ends_as_one_line_in_its_final_state(capsys):
    results = launch(w.progress_bar, 2, args=(30,))
    out = capsys.readouterr().out
    bars = [line for line in out.splitlines() if "train:" in line]
    assert len(bars) == 1 and bars[0].startswith("[rank 0] train: 100%") and "30/30" in bars[0], bars
    assert "\r" not in out and results.outputs[0].count("train:") == 1


def test_live_view_in_jupyter_updates_one_area_then_shows_the_grouped_output(monkeypatch):
    from distcourse.runtime import output

    shown = []
    monkeypatch.setattr(output, "_in_jupyter", lambda: True)
    monkeypatch.setattr(output.RankOutput, "_show", lambda self, text: shown.append(text))
    view = output.RankOutput(2)
    view.feed(1, b"hello from 1\n")
    view.feed(0, b"train:  10%|#\rtrain:  50%|#####")
    view.refresh(force=True)
    assert shown[-1] == "[rank 1] hello from 1\n[rank 0] train:  50%|#####\n"  # live: arrival order, bar redrawn
    view.feed(0, b"\rtrain: 100%|##########\n")
    view.close()
    assert shown[-1] == "[rank 0] train: 100%|##########\n[rank 1] hello from 1\n"  # final: grouped by rank


@pytest.mark.slow
def test_in_a_notebook_the_cell_keeps_one_final_grouped_view():
    """Executed by a real kernel: the live area is updated in place, and the saved cell holds the
    grouped output with the bar in its final state (what the rendered book shows)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {TESTS!r})\nimport distcourse, rank_workers"),
        nbformat.v4.new_code_cell("distcourse.launch(rank_workers.progress_bar, 2, args=(40,));"),
    ]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[1].outputs
    views = [o for o in outputs if o.output_type == "display_data"]
    assert len(views) == 1, outputs
    text = views[0].data["text/plain"]
    assert text.splitlines()[0].startswith("[rank 0] train: 100%") and "40/40" in text and "\r" not in text
    assert text.index("[rank 0] done") < text.index("[rank 1] done")
