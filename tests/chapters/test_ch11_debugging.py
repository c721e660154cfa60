"""Chapter 11: hangs, stacks, the flight recorder, crashes under torchrun, stragglers, profiles,
NaN agreement, replica checksums, reproducibility."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import distcourse
from distcourse import debugging, profiling
from distcourse.exercises import ch11


def test_monitored_barrier_names_the_missing_rank():
    result = distcourse.launch(debugging.missing_rank, world_size=3, kwargs={"late": 2}, quiet=True)
    assert "Ranks 2 failed to pass monitoredBarrier" in result[0]["error"]


def test_stacks_show_where_each_rank_is():
    stacks = distcourse.launch(debugging.stuck_stacks, world_size=2, kwargs={"stuck": 0}, quiet=True)
    assert "load_next_batch" in stacks[0]["stack"] and "all_reduce" in stacks[1]["stack"]


def test_main_thread_is_picked_from_a_dump():
    dump = (
        'Thread 0x1 (most recent call first):\n  File "x.py", line 1 in _watch\n\n'
        'Current thread 0x2 (most recent call first):\n  File "d.py", line 9 in stuck_stacks\n'
    )
    assert debugging.main_thread(dump).splitlines() == [
        "Current thread 0x2 (most recent call first):",
        '  File "d.py", line 9 in stuck_stacks',
    ]


def test_flight_recorder_finds_the_rank_behind(tmp_path):
    records = distcourse.launch(
        debugging.flight_recorder, world_size=3, kwargs={"skip": 0, "dump_dir": str(tmp_path)}, quiet=True
    )
    (report,) = debugging.behind(list(records)).values()
    assert report["behind"] == [0] and report["last seq per rank"] == {0: 3, 1: 4, 2: 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0", "rank_1", "rank_2"]


def test_behind_is_empty_when_ranks_agree():
    entries = [{"seq": 1, "op": "gloo:all_reduce", "sizes": [[4]], "state": "scheduled", "group": "0"}]
    report = debugging.behind([{"rank": 0, "entries": entries}, {"rank": 1, "entries": entries}])
    assert report["0"]["behind"] == []
    assert (
        debugging.describe_behind(report)
        == "Process group 0, last collective per rank: 0 → #1, 1 → #1. No rank is behind."
    )


def test_describe_behind_says_who_and_where():
    report = {"1": {"last seq per rank": {0: 4, 1: 3}, "behind": [1], "waiting in": "gloo:all_reduce [[5]]"}}
    assert debugging.describe_behind(report) == (
        "Process group 1, last collective per rank: 0 → #4, 1 → #3. Behind: rank(s) 1; "
        "the others wait in gloo:all_reduce [[5]]."
    )


@pytest.mark.parametrize(("size", "kept"), [(None, [4, 3]), ("2", [2, 2]), ("0", [0, 0])])
def test_the_recorder_is_on_by_default_and_sized_by_the_ranks_environment(size, kept):
    """No variable: every collective recorded; TORCH_FR_BUFFER_SIZE, read when the ranks create their
    first process group, keeps the last N (0: none). The chapter states both with a source link."""
    env = dict.fromkeys(debugging.RECORDER_VARIABLES) | {"TORCH_FR_BUFFER_SIZE": size}
    records = distcourse.launch(
        debugging.flight_recorder, world_size=2, kwargs={"skip": 1}, backend="gloo", env=env, quiet=True
    )
    assert [len(r["entries"]) for r in records] == kept
    assert all(r["recorder variables"] == ({} if size is None else {"TORCH_FR_BUFFER_SIZE": size}) for r in records)
    if size == "2":  # the ring keeps the newest
        assert [e["seq"] for e in records[0]["entries"]] == [3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("fail", ["exception", "sigkill"])
def test_torchrun_names_the_root_cause(fail):
    crash = debugging.torchrun_crash(fail)
    assert crash["returncode"] != 0 and crash["root cause"]["rank"].startswith("1")
    if fail == "exception":
        assert crash["error file"]["message"]["message"].startswith("ValueError")
    else:
        assert crash["root cause"]["exitcode"].startswith("-9") and crash["error file"] is None
    assert [f["exitcode"].split()[0] for f in crash["other failures"]] == ["-15"]  # rank 0, stopped by torchrun


def test_root_cause_parser_without_a_failure():
    assert debugging.root_cause("all fine\n") == {}


def test_nan_agreement_stops_every_rank_at_the_same_step():
    together = distcourse.launch(debugging.nan_stop, world_size=2, kwargs={"agree": True, "bad_step": 1}, quiet=True)
    assert [r["stopped at"] for r in together] == [1, 1]
    assert [r["reason"] for r in together] == ["agreed", "agreed"]
    assert together[0]["why"] == "a rank reported a non-finite loss"  # the sentence, in the reader's language


def test_nan_stop_finishes_without_a_nan():
    clean = distcourse.launch(debugging.nan_stop, world_size=2, kwargs={"bad_step": 99, "steps": 2}, quiet=True)
    assert [(r["stopped at"], r["reason"]) for r in clean] == [(None, "finished"), (None, "finished")]


def test_checksum_finds_the_drifted_layer():
    drift = distcourse.launch(debugging.diverged_replicas, world_size=2, kwargs={"steps": 1}, quiet=True)[0]
    assert drift == {"before": [], "after": ["2.weight"]}


def test_same_seed_same_losses():
    a, b, c = distcourse.launch(debugging.reproducible_runs, world_size=2, kwargs={"steps": 3}, quiet=True)[0]
    assert a == b != c


def test_straggler_is_the_rank_that_waits_least():
    timings = distcourse.launch(
        profiling.straggler_times, world_size=3, kwargs={"slow_rank": 1, "extra": 0.03, "steps": 3}, quiet=True
    )
    assert profiling.find_straggler(timings[0]["per rank"])["rank"] == 1
    # By construction, not by the sleep's length: the others wait at least the slow rank's extra
    # time in every step, since it starts that work only once they have all computed.
    per_rank = timings[0]["per rank"]
    assert all(wait >= 0.03 for rank in (0, 2) for wait in per_rank[rank]["all-reduce"]), per_rank


def test_one_bucket_does_not_overlap_and_traces_are_written(tmp_path):
    one = distcourse.launch(
        profiling.profile_ddp,
        world_size=2,
        kwargs={"bucket_cap_mb": 100.0, "steps": 2, "trace_dir": str(tmp_path)},
        quiet=True,
    )
    assert one[0]["buckets per step"] == 1 and one[0]["overlap"] < 0.05
    assert (tmp_path / "ddp_bucket100MB_rank0.json").stat().st_size > 0


def test_interval_helpers():
    assert profiling._merge([(3, 4), (0, 2), (1, 3)]) == [[0, 4]]
    assert profiling._overlap([[0, 4]], [[3, 6]]) == 1


def _event(name, device, start, end, id=0, launched_by=0, parent=None):
    """A stand-in for a profiler event with the fields ``_gpu_intervals`` reads."""
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name,
        device_type=kind,
        time_range=SimpleNamespace(start=start, end=end),
        id=id,
        linked_correlation_id=launched_by,
        cpu_parent=parent,
    )


def test_gpu_overlap_is_measured_against_the_backward_window():
    """A launch-bound backward on a GPU: short kernels with gaps where the GPU waits for the CPU.

    NCCL's first bucket runs in such a gap, during backward; the last bucket runs after it.
    DDP's own kernels (copies into buckets in AccumulateGrad's hook, copies back after the
    all-reduce) are not backward compute.
    """
    step = _event("train step", "cpu", 0, 1000)
    backward = _event("autograd::engine::evaluate_function: AddmmBackward0", "cpu", 100, 500)
    accumulate = _event("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", "cpu", 420, 430)
    ops = [
        _event("aten::mm", "cpu", 110, 120, id=1, parent=backward),
        _event("aten::mm", "cpu", 300, 310, id=2, parent=backward),
        _event("aten::copy_", "cpu", 421, 422, id=3, parent=accumulate),
        _event("aten::copy_", "cpu", 600, 601, id=4),  # DDP's finalize, outside any backward function
    ]
    kernels = [
        _event("gemm", "cuda", 200, 210, launched_by=1),
        _event("gemm", "cuda", 400, 420, launched_by=2),
        _event("copy", "cuda", 430, 440, launched_by=3),
        _event("copy", "cuda", 500, 505, launched_by=4),
        _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "cuda", 300, 350),
        _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "cuda", 450, 480),
    ]
    events = [step, backward, accumulate, *ops, *kernels]
    compute, comm = profiling._gpu_intervals(events, [step], lambda us: us)
    assert compute == [(200, 420)] and comm == [(300, 350), (450, 480)]
    overlap = profiling._overlap(compute, profiling._merge(comm)) / sum(e - s for s, e in comm)
    assert overlap == 50 / 80
    # The kernels' union would have called the first bucket exposed: it ran between two gemms.
    union = profiling._merge((k.time_range.start, k.time_range.end) for k in kernels if "nccl" not in k.name)
    assert profiling._overlap(union, profiling._merge(comm)) == 0


def test_nccl_info_refuses_the_cpu(tmp_path):
    if distcourse.gpu_count() >= 2:
        pytest.skip("on GPUs the cell runs for real")
    with pytest.raises(distcourse.RankFailed, match="has no GPU"):
        distcourse.launch(debugging.nccl_info, world_size=2, kwargs={"directory": str(tmp_path)}, quiet=True)


def test_exercises_accept_solutions_and_reject_wrong_answers(capsys):
    def behind(last_seq):
        newest = max(last_seq.values())
        return sorted(r for r, s in last_seq.items() if s < newest)

    assert ch11.check_who_is_behind(behind) is True
    assert ch11.check_who_is_behind(lambda last_seq: []) is False
    assert "measured" in capsys.readouterr().out

    def slow(per_rank):
        waits = [sum(r["all-reduce"]) for r in per_rank]
        return waits.index(min(waits))

    assert ch11.check_find_slow_rank(slow) is True
    assert ch11.check_find_slow_rank(lambda per_rank: None) is False


def test_speaker_notes_quote_the_timeouts_the_code_uses():
    """The notes of 11-debugging name the demos' half second and the default timeouts; keep them in step."""
    import datetime
    import inspect
    import json
    import pathlib

    from torch.distributed import constants

    notebook = pathlib.Path(__file__).resolve().parents[2] / "chapters" / "en" / "11-debugging.ipynb"
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    notes = " ".join(
        "".join(c["source"]) for c in cells if c["metadata"].get("slideshow", {}).get("slide_type") == "notes"
    )
    notes = " ".join(notes.split())
    waits = [
        inspect.signature(debugging.missing_rank).parameters["timeout"].default,
        inspect.signature(debugging.stuck_stacks).parameters["after"].default,
        inspect.signature(debugging.flight_recorder).parameters["after"].default,
    ]
    assert waits == [0.5, 0.5, 0.5] and "half a second" in notes and "after 0.5 s" in notes
    assert constants.default_pg_timeout == datetime.timedelta(minutes=30) and "gloo 30 min" in notes
    # kProcessGroupNCCLDefaultTimeout in ProcessGroupNCCL.hpp; a CPU build has none
    assert constants.default_pg_nccl_timeout in (None, datetime.timedelta(minutes=10)) and "NCCL 10 min" in notes
