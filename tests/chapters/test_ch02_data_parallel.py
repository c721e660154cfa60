"""The chapter 02 helpers do what the chapter says, and its self-check can fail."""

import threading
import time

import pytest
import torch
from torch import nn

import distcourse
from distcourse import data_parallel as dp
from distcourse.common import numerics
from distcourse.exercises import ch02


# The sums of one step of mlp(width, depth): forward and backward each add along the layers (64
# pixels, the hidden units, 10 classes), then the loss and the weight gradients add the batch.
def step_terms(width, batch, depth=1):
    return 2 * (64 + depth * width + 10) + batch


def weighted_reduce(replicas, chunk_sizes):
    """The answer to exercise 1: weight each replica's gradient by its chunk's share."""
    total = sum(chunk_sizes)
    with torch.no_grad():
        for grads in zip(*([p.grad for p in r.parameters()] for r in replicas)):
            combined = sum(g.to(grads[0].device) * (n / total) for g, n in zip(grads, chunk_sizes))
            for g in grads:
                g.copy_(combined)


@pytest.mark.skipif(distcourse.gpu_count() > 0, reason="the CPU behaviour of nn.DataParallel")
def test_dataparallel_without_gpus_calls_the_module_once():
    model = dp.ShapeReporter(features=5, outputs=2)
    wrapped = nn.DataParallel(model)
    x = torch.randn(30, 5)
    out = wrapped(x)
    assert wrapped.device_ids == [] and wrapped.module is model
    assert model.calls == [((30, 5), "cpu")]
    assert torch.equal(out, model(x))
    assert not torch.cuda.is_initialized()


def test_scatter_gives_every_device_a_chunk():
    x = torch.arange(10)
    chunks = dp.scatter(x, [torch.device("cpu")] * 3)
    assert [len(c) for c in chunks] == [4, 3, 3]
    assert torch.equal(torch.cat(chunks), x)
    assert [len(c) for c in dp.scatter(torch.arange(2), [torch.device("cpu")] * 3)] == [1, 1, 0]


@pytest.mark.numerics
@pytest.mark.parametrize("k", [1, 2, 4])
def test_from_scratch_step_is_the_full_batch_step(k):
    x, y = dp.digits_batch(64)
    model = dp.mlp(width=32)
    before = dp.params_of(model)
    replicas, outputs, losses = dp.data_parallel_step(model, x, y, dp.devices_for(k), lr=0.1)
    reference, reference_out, reference_loss = dp.full_batch_step(model, x, y, lr=0.1)
    assert len(replicas) == k and all(dp.identical(replicas[0], r) for r in replicas)
    numerics.assert_close(dp.params_of(replicas[0]), dp.params_of(reference), terms=step_terms(32, 64))
    assert dp.max_difference(replicas[0], model) > 1e-3  # it did train...
    assert all(torch.equal(a, b) for a, b in zip(before, dp.params_of(model)))  # ...a copy
    numerics.assert_close(outputs, reference_out, terms=64 + 32)
    numerics.assert_close(sum(losses) / k, reference_loss, terms=step_terms(32, 64))


@pytest.mark.numerics
def test_unequal_chunks_need_a_weighted_reduce():
    x, y = dp.digits_batch(10)
    model = dp.mlp(width=16)
    with pytest.raises(ValueError, match="unequal size"):
        dp.data_parallel_step(model, x, y, dp.devices_for(3))
    replicas, _, _ = dp.data_parallel_step(model, x, y, dp.devices_for(3), reduce=weighted_reduce)
    reference, _, _ = dp.full_batch_step(model, x, y)
    numerics.assert_close(dp.params_of(replicas[0]), dp.params_of(reference), terms=step_terms(16, 10))


@pytest.mark.numerics
@pytest.mark.usefixtures("no_leftovers")
def test_processes_with_all_reduce_take_the_full_batch_step():
    x, y = dp.digits_batch(64)
    model = dp.mlp(width=32, depth=2)
    reference, _, _ = dp.full_batch_step(model, x, y, lr=0.1)
    results = distcourse.launch(
        dp.all_reduce_step, 2, args=(x, y, model.state_dict(), 0.1), kwargs={"width": 32, "depth": 2}, quiet=True
    )
    assert results[0]["loss"] != results[1]["loss"]
    # bit for bit: both ranks apply the same all-reduced gradient with the same kernels
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
    numerics.assert_close(results[0]["params"], dp.params_of(reference), terms=step_terms(32, 64, depth=2))


@pytest.mark.numerics
def test_dataparallel_style_step_is_the_plain_step():
    assert dp.same_update_as_plain(k=2) <= numerics.rounding_bound(terms=step_terms(64, 64, depth=2))
    # summing needs no weights
    assert dp.same_update_as_plain(k=3, batch_size=10) <= numerics.rounding_bound(terms=step_terms(64, 10, depth=2))


def test_breakdown_reports_every_phase():
    # Each phase is the fastest of `steps` rounds: enough rounds that a busy machine cannot
    # slow every round of one configuration (two rounds once gave the plain step 0.43 s).
    steps = 12
    start = time.perf_counter()
    breakdown = dp.step_time_breakdown(replica_counts=(2,), steps=steps, batch_size=32, width=32, depth=1)
    wall = time.perf_counter() - start
    (plain_label, plain), (dp_label, replicated) = breakdown.items()
    assert plain_label.startswith("plain step") and "2 replicas" in dp_label
    assert set(plain) == {"forward", "backward", "step"}
    assert set(replicated) == {"replicate", "scatter", "forward", "gather", "backward", "reduce", "step"}
    # Each phase is the fastest of `steps` timed rounds, so all rounds together cannot
    # take less than steps x the phase times: a clock that adds up across steps or reads
    # in other units breaks this.
    phase_seconds = sum(plain.values()) + sum(replicated.values())
    assert 0 < steps * phase_seconds <= wall
    # On one device the replicas add work (copies, a forward per replica, the reduction).
    if distcourse.gpu_count() < 2:
        assert sum(replicated.values()) > sum(plain.values())


def test_thread_speedup_restores_the_thread_count():
    before = torch.get_num_threads()
    speedup = dp.thread_speedup("many small ops", repeats=1)
    assert torch.get_num_threads() == before
    # Two threads sharing the GIL cannot finish two jobs in less than half the time of one.
    assert 0 < speedup < 2.5


def test_thread_speedup_runs_the_jobs_in_threads_and_compares_the_fastest_runs(monkeypatch):
    ran_in = []  # (thread id, intra-op threads) of every job call

    def fake_work(kind):
        def job():
            torch.set_num_threads(1)
            ran_in.append((threading.get_ident(), torch.get_num_threads()))

        return job

    monkeypatch.setattr(dp, "_work", fake_work)
    dp.thread_speedup("many small ops", threads=3, repeats=2)
    main = threading.get_ident()
    in_main = [ident for ident, _ in ran_in if ident == main]
    assert len(in_main) == 1 + 2 * 3  # the warm-up, then `repeats` sequential rounds of 3 jobs
    assert len(ran_in) - len(in_main) == 2 * 3  # `repeats` threaded rounds, off the main thread
    assert {n for _, n in ran_in} == {1}

    times = iter([4.0, 2.0, 3.0, 1.5])  # sequential, threaded, sequential, threaded
    monkeypatch.setattr(dp, "_seconds", lambda jobs, threaded: next(times))
    assert dp.thread_speedup("many small ops", repeats=2) == pytest.approx(3.0 / 1.5)


def test_batchnorm_replicas_differ_from_the_full_batch():
    x, y = dp.digits_batch(64)
    model = dp.mlp(width=32, batchnorm=True)
    replicas, outputs, _ = dp.data_parallel_step(model, x, y, dp.devices_for(2))
    reference, reference_out, _ = dp.full_batch_step(model, x, y)
    assert not torch.allclose(outputs.cpu(), reference_out, atol=1e-3)
    assert dp.identical(replicas[0], replicas[1])
    bn0, bn1 = (dp.batchnorm_layers(r)[0] for r in replicas)
    assert not torch.allclose(bn0.running_mean, bn1.running_mean)


@pytest.mark.numerics
def test_combined_moments_are_the_full_batch_moments():
    h = torch.randn(10, 6) * 3 + 1
    mean, var = dp.combined_moments(h.tensor_split(3))
    numerics.assert_close(mean, h.mean(0), terms=10)
    # E[x²] - mean²: the rounding of the 10-term sums is relative to E[x²], `cancel` times the variance
    cancel = ((h * h).mean(0) / h.var(0, unbiased=False)).max().item()
    numerics.assert_close(var, h.var(0, unbiased=False), terms=round(10 * cancel))


def test_self_check_rejects_wrong_answers_and_accepts_the_right_one(capsys):
    assert ch02.check_weighted_reduce(None) is False
    assert ch02.check_weighted_reduce(lambda replicas, sizes: None) is False
    assert "replicas differ" in capsys.readouterr().out
    assert ch02.check_weighted_reduce(lambda replicas, sizes: dp.average_gradients(replicas)) is False
    assert "share of the batch" in capsys.readouterr().out

    def raises(replicas, sizes):
        raise KeyError("oops")

    assert ch02.check_weighted_reduce(raises) is False
    assert "KeyError" in capsys.readouterr().out
    assert ch02.check_weighted_reduce(weighted_reduce) is True


def test_sync_batchnorm_gathers_mean_invstd_and_count():
    """What the chapter says PyTorch's SyncBatchNorm exchanges in forward: each replica's mean,
    1/sqrt(variance + eps) and count, all-gathered (torch/nn/modules/_functions.py)."""
    import inspect

    from torch.nn.modules import _functions

    forward = inspect.getsource(_functions.SyncBatchNorm.forward)
    assert "mean, invstd = torch.batch_norm_stats(" in forward
    assert "torch.cat([mean, invstd, count]" in forward
    assert "all_gather" in forward and "all_reduce" not in forward


@pytest.mark.numerics
def test_mean_invstd_and_count_carry_the_full_batch_moments():
    """The same information as count, sum and sum of squares: the whole batch's mean and variance."""
    h, eps = (torch.randn(30, 4) * 3 + 1).double(), 1e-5
    chunks = h.tensor_split(3)
    gathered = [(c.mean(0), 1 / torch.sqrt(c.var(0, unbiased=False) + eps), len(c)) for c in chunks]
    total = sum(n for _, _, n in gathered)
    mean = sum(n * m for m, _, n in gathered) / total
    second = sum(n * (1 / s**2 - eps + m**2) for m, s, n in gathered) / total  # E[x²] from each chunk
    numerics.assert_close(mean, h.mean(0), terms=30, dtype=torch.float64)
    cancel = ((h * h).mean(0) / h.var(0, unbiased=False)).max().item()
    numerics.assert_close(second - mean**2, h.var(0, unbiased=False), terms=round(30 * cancel), dtype=torch.float64)
