"""Chapter 11: hangs, stacks, the flight recorder, crashes under torchrun, stragglers, profiles,
NaN agreement, replica checksums, reproducibility."""

from __future__ import annotations

import pytest

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
    assert debugging.behind([{"rank": 0, "entries": entries}, {"rank": 1, "entries": entries}])["0"]["behind"] == []


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
