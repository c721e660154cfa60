"""The chapter 06 helpers do what the chapter says, and its self-check can fail."""

import time

import matplotlib
import pytest
import torch
import torch.nn.functional as F

import distcourse
from distcourse import data_parallel as dp
from distcourse import model_parallel, pipeline
from distcourse.common import numerics
from distcourse.exercises import ch06

matplotlib.use("Agg")


def one_f_one_b(stage, p, m):
    """The answer to exercise 1: warm up with p - stage - 1 forwards, then alternate."""
    warmup = min(m, p - stage - 1)
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < m:
        order += [("F", forward), ("B", backward)]
        forward, backward = forward + 1, backward + 1
    return order + [("B", i) for i in range(backward, m)]


def reference_grads(model_kwargs, x, y):
    whole = model_parallel.two_stage_model(**{**model_kwargs, "work": 0.0})
    loss = F.cross_entropy(whole(x), y)
    loss.backward()
    return loss.item(), dict(whole.named_parameters())


def grads_of(params: dict) -> dict:
    return {k: p.grad for k, p in params.items()}


# --- 1. the split -----------------------------------------------------------------------


def test_same_seed_same_model_and_stages_are_slices():
    a, b = (
        model_parallel.two_stage_model(width=16, depth=3, seed=4),
        model_parallel.two_stage_model(width=16, depth=3, seed=4),
    )
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a[0][0].weight, model_parallel.two_stage_model(width=16, depth=3, seed=5)[0][0].weight)
    works = [m for m in model_parallel.two_stage_model(work=(0.2, 0.1)).modules() if isinstance(m, model_parallel.Work)]
    assert [w.seconds_per_sample for w in works] == [0.2, 0.1]


@pytest.mark.numerics
def test_split_model_equals_the_whole_model():
    result = model_parallel.split_vs_whole(batch_size=32, width=16, depth=2)
    numerics.assert_close(result["outputs"]["split"], result["outputs"]["whole"], terms=64 + 3 * 16)
    numerics.assert_close(
        result["grads"]["split"], result["grads"]["whole"], terms=model_parallel.step_terms(16, 2, 32)
    )
    assert result["activation_shape"] == (32, 16)
    assert len(result["devices"]) == 2 and result["output_device"] == result["devices"][1]
    if distcourse.gpu_count() == 0:
        assert result["devices"] == ("cpu", "cpu")


def test_work_sleeps_twice_as_long_backward_and_is_an_identity():
    x = torch.randn(10, 3, requires_grad=True)
    work = model_parallel.Work(0.002)  # 20 ms forward, 40 ms backward for 10 samples
    start = time.perf_counter()
    out = work(x)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    out.sum().backward()
    backward = time.perf_counter() - start
    assert torch.equal(out, x) and torch.equal(x.grad, torch.ones_like(x))
    assert 0.019 < forward and 0.039 < backward
    assert model_parallel.Work(0.0)(x) is x


# --- 3. schedules on paper ----------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_simulated_gpipe_has_the_predicted_bubble(p, m):
    events = model_parallel.simulate([model_parallel.gpipe_order(s, p, m) for s in range(p)], forward=1, backward=2)
    assert model_parallel.step_seconds(events) == (m + p - 1) * 3
    assert all(abs(b - model_parallel.predicted_bubble(p, m)) < 1e-12 for b in model_parallel.bubble_fractions(events))
    assert all(model_parallel.peak_in_flight(e) == m for e in events)


def test_simulate_follows_dependencies_and_unequal_costs():
    events = model_parallel.simulate(
        [model_parallel.gpipe_order(s, 2, 2) for s in range(2)], forward=[2, 1], backward=[4, 2]
    )
    (s0, s1) = events
    assert [e[2:] for e in s0] == [(0, 2), (2, 4), (7, 11), (11, 15)]
    assert [e[2:] for e in s1] == [(2, 3), (4, 5), (5, 7), (7, 9)]


def test_simulate_rejects_bad_orders():
    with pytest.raises(ValueError, match="deadlocks"):
        model_parallel.simulate([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])
    with pytest.raises(ValueError, match="exactly one"):
        model_parallel.simulate([[("F", 0), ("B", 0)], [("F", 0)]])
    with pytest.raises(ValueError, match="no forward"):
        model_parallel.simulate([[], []])


def test_bubble_overlap_and_in_flight_of_handmade_events():
    stage0 = [("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0), ("B", 0, 3.0, 4.0), ("B", 1, 4.0, 5.0)]
    stage1 = [("F", 0, 1.0, 2.0), ("B", 0, 2.0, 3.0), ("F", 1, 3.0, 4.0), ("B", 1, 4.0, 4.5)]
    assert model_parallel.bubble_fractions([stage0, stage1]) == pytest.approx([0.2, 0.3])
    assert model_parallel.overlap(stage0, stage1) == pytest.approx(2.5)
    assert model_parallel.peak_in_flight(stage0) == 2 and model_parallel.peak_in_flight(stage1) == 1
    assert model_parallel.step_seconds([stage0, stage1]) == 5.0


def test_plot_schedule_draws_one_bar_per_event():
    import matplotlib.pyplot as plt

    events = model_parallel.simulate([model_parallel.gpipe_order(s, 2, 3) for s in range(2)])
    fig, ax = plt.subplots()
    model_parallel.plot_schedule(ax, events, "test", unit=1)
    assert len(ax.collections) == 12
    assert ax.get_xlim()[1] >= model_parallel.step_seconds(events)
    plt.close(fig)


# --- 2. timing a pipeline on a GPU, checked without one ----------------------------------


class _Stream:
    """Stands in for a CUDA stream: records which device's stream was waited for."""

    def __init__(self, device, waited: list):
        self.device, self.waited = device, waited

    def synchronize(self):
        self.waited.append(self.device)


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda`` whose device-wide synchronize fails the test and whose streams record waits.

    A device-wide synchronize would also wait for the irecvs that stage 1 posts up front
    (NCCL runs them on streams of its own), so the timeline would show no overlap.
    """
    waited = []

    def device_wide(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize() waits for NCCL's pending receives too")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(device, waited))
    return waited


def test_pipeline_clocks_wait_for_the_compute_stream_only(fake_cuda):
    gpu = torch.device("cuda", 1)
    before = time.perf_counter()
    assert model_parallel.clock(gpu) >= before
    assert fake_cuda == [gpu]


def test_recorded_pipeline_stages_wait_for_the_compute_stream_only(fake_cuda):
    class Stage:  # the two methods the schedules call, doing nothing
        def forward_one_chunk(self, i):
            return f"F{i}"

        def backward_one_chunk(self, i):
            return f"B{i}"

    stage, events, gpu = Stage(), [], torch.device("cuda", 1)
    pipeline._record(stage, events, gpu)
    assert (stage.forward_one_chunk(0), stage.backward_one_chunk(0)) == ("F0", "B0")
    assert [event[:2] for event in events] == [("F", 0), ("B", 0)]
    assert fake_cuda == [gpu] * 4  # before and after each forward and backward


# --- 2., 4., 5. real processes -------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.usefixtures("no_leftovers")
def test_hand_written_pipeline_gives_the_full_batch_gradient():
    x, y = dp.digits_batch(10)  # 3 micro-batches of 4, 3 and 3 samples: the weighting matters
    model_kwargs = {"width": 16, "depth": 2}
    results = distcourse.launch(
        model_parallel.pipeline_run,
        2,
        args=(model_kwargs, x, y, [1, 3]),
        kwargs={"repeats": 1},
        backend="gloo",
        quiet=True,
    )
    loss, expected = reference_grads(model_kwargs, x, y)
    terms = model_parallel.step_terms(16, 2, len(x))
    for m in (1, 3):
        grads = model_parallel.stage_grads(results, m)
        numerics.assert_close(grads, list(grads_of(expected).values()), terms=terms, what=f"m={m}")
        assert results[0][m]["loss"] is None
        numerics.assert_close(results[1][m]["loss"], loss, terms=terms)
        (step,) = model_parallel.stage_steps(results, m)
        assert [[e[:2] for e in events] for events in step] == [model_parallel.gpipe_order(s, 2, m) for s in range(2)]
        # One stage does one thing at a time: its timestamps never go back.
        for events in step:
            stamps = [t for *_, start, end in events for t in (start, end)]
            assert stamps == sorted(stamps) and stamps[-1] > stamps[0], events


@pytest.mark.numerics
@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_torch_schedules_match_the_unsplit_model(schedule):
    x, y = dp.digits_batch(32)
    model_kwargs = {"width": 16, "depth": 2}
    run = distcourse.launch(pipeline.torch_pipeline_step, 2, args=(schedule, model_kwargs, x, y, 4), quiet=True)
    loss, expected = reference_grads(model_kwargs, x, y)
    grads = {**run[0]["grads"], **run[1]["grads"]}
    assert grads.keys() == expected.keys()
    terms = model_parallel.step_terms(16, 2, len(x))
    numerics.assert_close(grads, grads_of(expected), terms=terms)
    numerics.assert_close(sum(run[1]["losses"]) / 4, loss, terms=terms)
    in_flight = [model_parallel.peak_in_flight(r["events"]) for r in run]
    assert in_flight == ([4, 4] if schedule == "GPipe" else [2, 1])
    orders = [[e[:2] for e in r["events"]] for r in run]
    assert orders == [(model_parallel.gpipe_order if schedule == "GPipe" else one_f_one_b)(s, 2, 4) for s in range(2)]


@pytest.mark.numerics
@pytest.mark.usefixtures("no_leftovers")
def test_two_replicas_of_a_pipeline_take_the_full_batch_step():
    x, y = dp.digits_batch(32)
    grid = distcourse.launch(
        pipeline.ddp_pipeline_step,
        4,
        args=({"width": 16, "depth": 2}, x, y, 2),
        kwargs={"lr": 0.5},
        backend="gloo",
        quiet=True,
    )
    trained, _, loss = dp.full_batch_step(model_parallel.two_stage_model(width=16, depth=2), x, y, lr=0.5)
    expected = dict(trained.named_parameters())
    assert [(g["replica"], g["stage"]) for g in grid] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [g["dp_group"] for g in grid] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g["all_reduces"] == 1 for g in grid)
    terms = model_parallel.step_terms(16, 2, len(x))
    numerics.assert_close((grid[1]["loss"] + grid[3]["loss"]) / 2, loss, terms=terms)
    for stage in (0, 1):
        a, b = grid[stage]["params"], grid[2 + stage]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a)  # the same all-reduced gradients: bit for bit
        numerics.assert_close(a, {k: expected[k] for k in a}, terms=terms, what=f"stage {stage}")


# --- the exercise's self-check ---------------------------------------------------------------


def test_self_check_rejects_wrong_answers_and_accepts_the_right_one(capsys):
    assert ch06.check_one_f_one_b(lambda stage, p, m: []) is False
    assert "exactly one" in capsys.readouterr().out
    assert ch06.check_one_f_one_b(lambda stage, p, m: None) is False
    assert ch06.check_one_f_one_b(model_parallel.gpipe_order) is False  # right result, too much memory
    assert "at most p - s" in capsys.readouterr().out
    one_at_a_time = lambda stage, p, m: [a for i in range(m) for a in (("F", i), ("B", i))]  # noqa: E731
    assert ch06.check_one_f_one_b(one_at_a_time) is False  # little memory, no pipelining
    assert "GPipe only" in capsys.readouterr().out
    backwards_first = lambda stage, p, m: [("B", i) for i in range(m)] + [("F", i) for i in range(m)]  # noqa: E731
    assert ch06.check_one_f_one_b(backwards_first) is False
    assert "deadlocks" in capsys.readouterr().out

    def raises(stage, p, m):
        raise KeyError("oops")

    assert ch06.check_one_f_one_b(raises) is False
    assert "KeyError" in capsys.readouterr().out
    assert ch06.check_one_f_one_b(one_f_one_b) is True
    # Only p=2 hard-coded (section 4's printed order) is not general enough.
    torch_order = {0: [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]}
    assert ch06.check_one_f_one_b(lambda stage, p, m: torch_order.get(stage, one_f_one_b(stage, p, m))) is False
