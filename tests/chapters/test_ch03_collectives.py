"""Chapter 03: the collective demos, the ring all-reduce and its cost, and the self-check."""

import math
import time

import numpy as np
import pytest
import torch
from torch.torch_version import TorchVersion

import distcourse
from distcourse import collectives
from distcourse.common import numerics
from distcourse.exercises import ch03


def test_ranks_map_onto_two_nodes_of_two_gpus(no_leftovers):
    who = distcourse.launch(collectives.whoami, world_size=4, quiet=True)
    assert [(w["node_if_2x2"], w["local_rank_if_2x2"]) for w in who] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [w["env"] for w in who] == [{"RANK": r, "LOCAL_RANK": r, "WORLD_SIZE": 4} for r in range(4)]


def test_subgroup_reduces_among_members_only(no_leftovers):
    sub = distcourse.launch(collectives.subgroup_demo, world_size=4, kwargs={"members": (1, 2, 3)}, quiet=True)
    assert [s["after"] for s in sub] == [[1], [1110], [1110], [1110]]
    assert [s["rank_in_group"] for s in sub] == [-1, 0, 1, 2]


def test_point_to_point(no_leftovers):
    p2p = distcourse.launch(collectives.send_recv_demo, world_size=2, quiet=True)
    assert p2p[1]["after send/recv"] == [1, 2, 3] and p2p[0]["after isend/irecv"] == [10, 20, 30]
    shift = distcourse.launch(collectives.ring_shift_demo, world_size=3, quiet=True)
    assert [s["after"] for s in shift] == [[20, 21], [0, 1], [10, 11]]


def test_blocking_sends_in_a_ring_deadlock(no_leftovers):
    with pytest.raises(distcourse.LaunchTimeout):
        distcourse.launch(collectives.everyone_sends_first, world_size=2, timeout=1, collective_timeout=30, quiet=True)


@pytest.mark.parametrize("n", [2, 4])
def test_tour_of_collectives(n, no_leftovers):
    tour = distcourse.launch(collectives.tour, world_size=n, quiet=True)
    start = [[10 * r + i for i in range(n)] for r in range(n)]
    sums = [sum(col) for col in zip(*start)]
    assert all(t["broadcast"]["after"] == start[0] for t in tour)
    assert tour[0]["reduce"]["after"] == sums
    assert all(t["all_reduce SUM"]["after"] == sums for t in tour)
    assert all(t["all_reduce MAX"]["after"] == [n - 1, 0] for t in tour)
    assert tour[0]["gather"]["after"] == [[10 * r, 10 * r + 1] for r in range(n)]
    assert [t["scatter"]["after"] for t in tour] == [[2 * r, 2 * r + 1] for r in range(n)]
    assert [t["reduce_scatter"]["after"] for t in tour] == [[s] for s in sums]
    # The fallback (all_reduce, keep own chunk) gives the same pieces as the native operation.
    assert [t["reduce_scatter via all_reduce"]["after"] for t in tour] == [[s] for s in sums]
    assert tour[0]["reduce_scatter via all_reduce"]["how"] == "all_reduce, then keep own chunk"
    assert tour[0]["reduce_scatter"]["how"] == "native dist.reduce_scatter"  # gloo in every supported release
    assert all(t["all_gather"]["after"] == sums for t in tour)


@pytest.mark.numerics
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_reduce_matches_dist_all_reduce(n, no_leftovers):
    # 1 element on 3-4 ranks leaves empty chunks; 7 and 1001 do not divide evenly.
    rows = distcourse.launch(collectives.ring_matches_builtin, world_size=n, args=([1, 7, 1001, 4096],), quiet=True)
    for rank_rows in rows:
        for row in rank_rows:
            if row["values"] == "integers" or n == 2:
                assert row["equal"], row
            assert row["relative_gap"] <= numerics.rounding_bound(terms=n), row  # a sum of n terms, reordered


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_sends_two_n_minus_one_over_n_of_the_tensor(n, no_leftovers):
    numel = 12 * 100
    report = distcourse.launch(collectives.traffic_report, world_size=n, args=(numel,), quiet=True)
    for r, rep in enumerate(report):
        assert rep["ring"] == {"messages": 2 * (n - 1), "bytes": 2 * (n - 1) * numel * 4 // n}
        assert rep["naive"]["bytes"] == ((n - 1) if r == 0 else 1) * numel * 4
        assert rep["same_result"]


def test_bandwidth_sweep_is_sane(no_leftovers):
    sizes, repeats = [1024, 2**16], [2, 2]
    start = time.perf_counter()
    sweep = distcourse.launch(collectives.bandwidth_sweep, world_size=2, args=(sizes, repeats), quiet=True)
    wall = time.perf_counter() - start
    for r in sweep:
        assert r["sizes"] == sizes and all(r["equal"]) and len(r["equal"]) == len(sizes)
        for name in ("ring", "dist.all_reduce"):
            assert len(r[name]) == len(sizes)
            # Seconds of one call, the fastest of several timed within the run.
            assert all(0 < t < wall / (reps + 1) for t, reps in zip(r[name], repeats)), (name, r[name], wall)
    assert collectives.bus_bandwidth(1000, 0.5, 4) == pytest.approx(3000)


SWEEP = [2**k for k in range(10, 25)]  # the chapter's sizes: 1 KiB ... 16 MiB
MiB = 2**20


def alpha_beta_curve(alpha, beta, n=2, jitter=0.0):
    """Times T = α + 2(n-1)/n · S/β over SWEEP, each off by up to ``jitter`` (relative), deterministically."""
    return [(alpha + 2 * (n - 1) / n * s / beta) * (1 + jitter * math.sin(3 * i)) for i, s in enumerate(SWEEP)]


def old_bend_assert_holds(knee):
    """The chapter's first check, applied to every curve: steeper at the small end than at the large end."""
    return knee["small"] > knee["large"] + 0.2


def test_a_cpu_like_curve_bends_inside_the_sweep():
    # gloo over loopback on a 2-core machine: ~0.3 ms per call, ~1 GB/s; one call disturbed 3x.
    times = alpha_beta_curve(300e-6, 1e9, jitter=0.15)
    times[3] *= 3
    knee = collectives.knee(SWEEP, times, 2)
    assert knee["where"] == "inside" and 64 * 1024 < knee["s_half"] < 1024 * 1024
    assert old_bend_assert_holds(knee)


def test_an_overhead_bound_curve_is_not_asked_to_bend():
    # A Python ring on NVLink: T(1 MiB) = 100 µs, T(16 MiB) = 140 µs; T is linear in S, as the model says.
    b = 40e-6 / (15 * MiB)
    times = [(100e-6 - b * MiB + b * s) * (1 + 0.03 * math.sin(3 * i)) for i, s in enumerate(SWEEP)]
    assert times[SWEEP.index(MiB)] == pytest.approx(100e-6, rel=0.05)
    assert times[-1] == pytest.approx(140e-6, rel=0.05)
    knee = collectives.knee(SWEEP, times, 2)
    assert not old_bend_assert_holds(knee)  # the old assert fails on it...
    assert knee["where"] == "beyond" and knee["s_half"] > 16 * MiB  # ...and the fit says why: no knee to see
    assert knee["large"] > 0.25  # what the chapter checks instead: bus bandwidth still rising at 16 MiB
    # an exact α-β curve gives back its own α and β
    exact = collectives.knee(SWEEP, alpha_beta_curve(20e-6, 5e10, n=4), 4)
    assert exact["alpha"] == pytest.approx(20e-6) and exact["beta"] == pytest.approx(5e10)
    assert exact["s_half"] == pytest.approx(20e-6 * 5e10 * 4 / 6)


def test_nccl_like_and_bandwidth_bound_curves():
    # nccl's own all-reduce on the same link: ~15 µs, ~150 GB/s: the knee (~2 MiB) lies inside, and bends.
    knee = collectives.knee(SWEEP, alpha_beta_curve(15e-6, 150e9, jitter=0.05), 2)
    assert knee["where"] == "inside" and old_bend_assert_holds(knee)
    # a link so slow that even 1 KiB is bandwidth-bound: the knee lies below the sweep, the curve is flat
    knee = collectives.knee(SWEEP, alpha_beta_curve(1e-6, 1e8, jitter=0.05), 2)
    assert knee["where"] == "below" and knee["small"] < 0.75
    # time that does not grow with size at all: overhead-bound at any size
    assert collectives.knee(SWEEP, [1e-3] * len(SWEEP), 2)["where"] == "beyond"
    assert collectives.log_log_slope([1, 2, 4], [3, 6, 12]) == pytest.approx(1)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_simulated_ring_sums_in_both_directions(n):
    values = [torch.arange(2 * n + 1.0) * (r + 1) for r in range(n)]
    for final in collectives.simulate_ring(values):
        assert torch.equal(final, sum(values))
    left = collectives.simulate_ring(values, lambda r, s, n: (r + s) % n, lambda r, s, n: (r - 1 + s) % n, direction=-1)
    assert all(torch.equal(final, sum(values)) for final in left)


def test_self_check_rejects_wrong_answers_and_accepts_right_ones(capsys):
    stub = lambda rank, step, n: None  # noqa: E731  (the notebook's starting point)
    assert ch03.check_left_ring(stub, stub) is False
    assert "Not yet" in capsys.readouterr().out
    # The chapter's rightward schedule is right for 2 ranks but wrong for a leftward ring of 3.
    assert ch03.check_left_ring(collectives.reduce_scatter_chunk, collectives.all_gather_chunk) is False
    assert "n=3" in capsys.readouterr().out
    assert ch03.check_left_ring(lambda r, s, n: (r + s) % n, lambda r, s, n: (r + s) % n) is False
    assert ch03.check_left_ring(lambda r, s, n: (r + s) % n, lambda r, s, n: r + s) is False  # index >= n
    capsys.readouterr()
    assert ch03.check_left_ring(lambda r, s, n: (r + s) % n, lambda r, s, n: (r - 1 + s) % n) is True
    assert "Correct" in capsys.readouterr().out
    # Integer types other than int are fine (numpy), floats are not.
    assert ch03.check_left_ring(lambda r, s, n: np.int64((r + s) % n), lambda r, s, n: (r - 1 + s) % n) is True
    assert ch03.check_left_ring(lambda r, s, n: float((r + s) % n), lambda r, s, n: (r - 1 + s) % n) is False


def test_markdown_helpers():
    table = collectives.markdown_table(["rank", "after"], [(0, [60.0, 64.5]), (1, None)])
    assert table.splitlines() == ["| rank | after |", "|---|---|", "| 0 | [60, 64.5] |", "| 1 | — |"]
    assert collectives.source(collectives.reduce_scatter_chunk).startswith("```python\ndef reduce_scatter_chunk")


@pytest.mark.parametrize("n", [2, 4])
def test_single_tensor_collectives_and_avg(n, no_leftovers):
    import torch.distributed as dist

    tour = distcourse.launch(collectives.tour, world_size=n, quiet=True)
    start = [[10 * r + i for i in range(n)] for r in range(n)]
    sums = [sum(col) for col in zip(*start)]
    single = [t["single-tensor"] for t in tour]
    assert [s["piece"] for s in single] == [[x] for x in sums]  # reduce_scatter_single: rank r keeps piece r
    assert all(s["after"] == sums for s in single)  # then all_gather_single: the all_reduce result
    assert all(s["old names, same result"] for s in single)
    # the names these replace warn and point to them in PyTorch 2.13 and 2.14; 2.15 dropped the warning
    if hasattr(dist, "all_gather_single") and TorchVersion(torch.__version__) < "2.15":
        for s in single:
            assert len(s["warnings"]) == 2 and all(w.startswith("FutureWarning") for w in s["warnings"])
            assert "reduce_scatter_single" in s["warnings"][0] and "all_gather_single" in s["warnings"][1]
    avg = [t["all_reduce AVG"] for t in tour]
    assert all(a["after"] == a["sum / world size"] == [x / n for x in sums] for a in avg)
    assert avg[0]["how"] == "ReduceOp.AVG"  # gloo in every supported release (2.11 and later)


def test_tables_write_numbers_the_readers_way():
    """Floats in the tables take the reader's decimal sign; a list whose items then carry a comma
    separates them with semicolons, so that [1,5; 2] cannot be read as three numbers."""
    from distcourse.runtime import i18n

    table = collectives.markdown_table(["x"], [([1.5, 2.0, None],), (1e-05,), (7,)])
    assert table.splitlines()[2:] == ["| [1.5, 2, —] |", "| 1e-05 |", "| 7 |"]
    i18n.use("ru")
    try:
        table = collectives.markdown_table(["x"], [([1.5, 2.0, None],), ([1.0, 2.0],)])
        assert table.splitlines()[2:] == ["| [1,5; 2; —] |", "| [1, 2] |"]
    finally:
        i18n.use("en")


def test_how_labels_keep_the_api_names():
    assert collectives.how_label("native dist.reduce_scatter") == "native dist.reduce_scatter"
    assert collectives.how_label("ReduceOp.AVG") == "ReduceOp.AVG"  # a name: nothing to translate
