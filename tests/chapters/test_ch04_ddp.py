"""The chapter 04 helpers do what the chapter says, and its self-check can fail."""

import json
import math
import multiprocessing
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import distcourse
from distcourse import data_parallel as dp
from distcourse import ddp, ddp_in_practice
from distcourse.common import numerics, replicas
from distcourse.exercises import ch04
from distcourse.runtime import i18n
from distcourse.runtime.processes import package_env
from distcourse.scripts import ddp_spawn_example

pytestmark = pytest.mark.usefixtures("no_leftovers")
MODEL = {"width": 16}
# The sums behind one gradient of mlp(width=16) on the 32-sample batch: forward and backward each
# add along the layers (64 inputs, 16 hidden units, 10 classes), then over the 32 samples
# (common.numerics: another order of the same sums rounds within that bound).
TERMS = 2 * (64 + 16 + 10) + 32


@pytest.fixture(scope="module")
def batch():
    generator = torch.Generator().manual_seed(0)  # random "digits": no scikit-learn needed here
    return torch.rand(32, 64, generator=generator), torch.randint(10, (32,), generator=generator)


def right_shard(size, world_size, rank, epoch, seed=0):
    """The answer to the exercise."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(size, generator=generator).tolist()
    order += order[: math.ceil(size / world_size) * world_size - size]
    return order[rank::world_size]


def test_spawn_script_trains_one_rank(tmp_path):
    """The script's rank function as a world of one, in a process of its own (the notebook runs it
    with mp.spawn). Not in this process: freeing a DDP model after destroy_process_group drops the
    last reference to the gloo group while holding the GIL, and its destructor can then wait
    forever for a gloo thread that needs the GIL (seen once in ~20 runs)."""
    code = (
        "import torch.distributed as dist\n"
        "from distcourse.scripts import ddp_spawn_example as s\n"
        "s.train(0, 1, s.free_port())\n"
        "print('initialized after train:', dist.is_initialized())\n"
        "assert s.ToyModel()(__import__('torch').randn(3, 10)).shape == (3, 5)\n"
    )
    env = package_env()
    env.pop("GLOO_SOCKET_IFNAME", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first, last = run.stdout.splitlines()[0], run.stdout.splitlines()[-1]
    assert first.startswith("rank 0/1 (gloo, cpu)") and "after the step" in first
    assert last == "initialized after train: False"  # destroyed in finally
    # The same numbers once more, for a program to read (the notebook compares them exactly).
    result = json.loads(run.stdout.splitlines()[1].removeprefix("result "))
    assert result["rank"] == 0 and result["wrapped"] == result["before"] != result["after"]


def test_spawn_script_speaks_the_language_it_is_given():
    """DISTCOURSE_LANG reaches mp.spawn's new interpreters: Russian numbers, Russian verdict."""
    code = "from distcourse.scripts import ddp_spawn_example as s\ns.main()\n"
    env = {**package_env(), "DISTCOURSE_LANG": "ru"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == i18n.tr("all ranks finished", language="ru")
    rank_lines = [line for line in lines if line.startswith(("rank 0/2", "rank 1/2", "ранг"))]
    assert len(rank_lines) == 2 and all(re.search(r"-?\d+,\d{6}\b", line) for line in rank_lines)  # decimal comma
    assert sorted(json.loads(line[7:])["rank"] for line in lines if line.startswith("result ")) == [0, 1]


def record_rank_setup(monkeypatch, accelerator, count):
    """Stand-ins for the accelerator and init_process_group that log the calls in order."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: accelerator)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda backend, **kwargs: calls.append(("init", backend, kwargs))
    )
    return calls


def test_spawn_script_binds_each_rank_to_its_gpu_before_joining(monkeypatch):
    calls = record_rank_setup(monkeypatch, torch.device("cuda"), count=2)
    device = ddp_spawn_example.rank_device(1, 2)
    assert device == torch.device("cuda", 1)
    assert ddp_spawn_example.join_group(1, 2, device) == "nccl"
    assert [call[0] for call in calls] == ["set_device", "init"] and calls[0] == ("set_device", 1)
    assert calls[1][2]["device_id"] == torch.device("cuda", 1) and calls[1][2]["rank"] == 1


def test_spawn_script_joins_without_device_id_on_the_cpu(monkeypatch):
    calls = record_rank_setup(monkeypatch, torch.device("cuda"), count=1)  # fewer GPUs than ranks
    device = ddp_spawn_example.rank_device(1, 2)
    assert device == torch.device("cpu")
    assert ddp_spawn_example.join_group(1, 2, device) == "gloo"
    assert len(calls) == 1 and calls[0][:2] == ("init", "gloo") and "device_id" not in calls[0][2]


def test_sampler_shards_are_disjoint_and_set_epoch_reshuffles():
    orders = distcourse.launch(
        ddp.sampler_demo, 2, args=({"fixed": dict(size=10, set_epoch=False), "moving": dict(size=11)},), quiet=True
    )
    for epoch in range(3):
        assert orders[0]["fixed"][epoch] == orders[0]["fixed"][0]
        r0, r1 = orders[0]["moving"][epoch], orders[1]["moving"][epoch]
        assert len(r0) == len(r1) == 6 and set(r0 + r1) == set(range(11))
        assert r0 == right_shard(11, 2, 0, epoch) and r1 == right_shard(11, 2, 1, epoch)
    assert orders[0]["moving"][0] != orders[0]["moving"][1]


@pytest.mark.numerics
def test_ddp_gradients_equal_the_full_batch(batch):
    x, y = batch
    grads = distcourse.launch(ddp.ddp_gradients, 2, args=(x, y, MODEL), quiet=True)
    reference = ddp.reference_gradients(x, y, MODEL)
    assert replicas.max_gap(grads[0]["local"], grads[1]["local"]) > 1e-4
    assert replicas.max_gap(grads[0]["ddp"], grads[1]["ddp"]) == 0  # one all-reduce: the same bytes on every rank
    numerics.assert_close(grads[0]["ddp"], reference, terms=TERMS)


@pytest.mark.numerics
def test_no_sync_saves_all_reduces_but_not_accuracy(batch):
    x, y = batch
    acc = distcourse.launch(ddp.accumulated_gradients, 2, args=(x, y, 4, MODEL), quiet=True)
    reference = ddp.reference_gradients(x, y, MODEL)
    assert acc[0]["plain"]["all_reduces"] == 4 and acc[0]["no_sync"]["all_reduces"] == 1
    for variant in ("plain", "no_sync"):
        numerics.assert_close(acc[1][variant]["grads"], reference, terms=TERMS, what=variant)


def test_smaller_buckets_are_more_and_overlap_backward(batch):
    x, y = batch
    model = {"width": 128, "depth": 2}
    out = distcourse.launch(ddp.bucket_timeline, 2, args=(x, y, [25, 0.05], model), quiet=True)[0]
    assert out[25]["buckets_per_step"] == [1, 1, 1]
    assert out[0.05]["buckets_per_step"][0] == 1 and out[0.05]["buckets_per_step"][-1] > 1
    n_params = sum(p.numel() for p in dp.mlp(**model).parameters())
    assert sum(out[0.05]["bucket_sizes"]) == n_params
    events = out[0.05]["timeline"]
    assert events[0][0] == "gradient" and events[-1][0] == "all-reduce"
    first_send = next(i for i, e in enumerate(events) if e[0] == "all-reduce")
    assert any(e[0] == "gradient" for e in events[first_send:])
    assert ddp.event_text(events[-1]).startswith("all-reduce of bucket")


def test_uneven_inputs_hang_without_join_and_finish_with_it():
    with pytest.raises((distcourse.RankFailed, distcourse.LaunchTimeout)) as caught:
        distcourse.launch(
            ddp_in_practice.uneven_inputs, 2, args=([1, 2], False, MODEL), collective_timeout=2, timeout=30, quiet=True
        )
    assert "timed out" in ddp_in_practice.key_line("\n".join(caught.value.outputs.values()), "timed out").lower()
    joined = distcourse.launch(
        ddp_in_practice.uneven_inputs, 2, args=([1, 2], True, MODEL), collective_timeout=5, quiet=True
    )
    assert [r["batches"] for r in joined] == [1, 2]
    assert replicas.max_gap(joined[0]["params"], joined[1]["params"]) == 0


def test_key_line_drops_the_cpp_location():
    text = "Traceback...\nRuntimeError: [/src/gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv\n"
    assert ddp_in_practice.key_line(text, "timed out") == "RuntimeError: Timed out waiting 3000ms for recv"
    assert ddp_in_practice.key_line("first\nlast line", "absent") == "last line"


def test_unused_parameters_fail_until_ddp_is_told(batch):
    x, y = batch
    with pytest.raises(distcourse.RankFailed, match="find_unused_parameters=True"):
        distcourse.launch(ddp_in_practice.unused_branch, 2, args=(x, y, False), quiet=True)
    fixed = distcourse.launch(ddp_in_practice.unused_branch, 2, args=(x, y, True), quiet=True)
    assert fixed[0]["aux_grad_is_none"] and replicas.max_gap(fixed[0]["params"], fixed[1]["params"]) == 0


def test_the_fast_rank_waits_for_the_slow_one(batch):
    x, y = batch
    skew = distcourse.launch(
        ddp_in_practice.skewed_speed, 2, args=(x, y, MODEL), kwargs={"extra_seconds": 0.04, "steps": 4}, quiet=True
    )
    backward = "backward (incl. waiting for the all-reduce)"
    assert skew[0][backward] > skew[1][backward] + 0.5 * 4 * 0.04
    assert skew[0][backward] >= 4 * 0.04  # by construction: rank 1 sleeps only after rank 0's forward


def test_allreduce_batchnorm_falls_back_to_batchnorm_without_a_group():
    torch.manual_seed(0)
    h = torch.randn(12, 5) * 2 + 1
    plain, synced = nn.BatchNorm1d(5), ddp_in_practice.with_allreduce_batchnorm(nn.Sequential(nn.BatchNorm1d(5)))[0]
    assert isinstance(synced, ddp_in_practice.AllReduceBatchNorm1d)
    # without a process group it is BatchNorm1d's own forward: the same kernels, bit for bit
    assert torch.equal(plain(h), synced(h)) and torch.equal(plain.running_var, synced.running_var)


@pytest.mark.numerics
def test_allreduce_batchnorm_is_full_batch_batchnorm(batch):
    x, y = batch
    reference = ddp_in_practice.reference_batchnorm_step(x, y, MODEL)
    # E[x²] - mean² of the BatchNorm input loses digits by E[x²] / var: the statistics' 32-term sums
    # count that many times more, before the step's other sums
    h = dp.mlp(batchnorm=True, **MODEL)[0](x).detach()
    cancel = ((h * h).mean(dim=0) / h.var(dim=0, unbiased=False)).max().item()
    terms = round(32 * cancel) + TERMS
    for kind, close in (("local", False), ("allreduce", True)):
        results = distcourse.launch(ddp_in_practice.batchnorm_step, 2, args=(x, y, MODEL, kind), quiet=True)
        out = torch.empty_like(reference["out"])
        for r in results:
            out[r["samples"]] = r["out"]
        assert numerics.close(out, reference["out"], terms=terms) is close
        if close:
            numerics.assert_close(results[1]["running_var"], reference["running_var"], terms=terms)
            numerics.assert_close(results[1]["params"], reference["params"], terms=terms)


def test_syncbatchnorm_refuses_cpu_tensors():
    messages = distcourse.launch(ddp_in_practice.syncbn_on_cpu, 2, quiet=True)
    assert all("expected input tensor to be on GPU" in m for m in messages)


@pytest.mark.numerics
def test_one_and_two_ranks_train_the_same_weights(batch):
    x, y = batch
    kwargs = dict(global_batch=16, steps=4, model_kwargs=MODEL)
    one = distcourse.launch(
        ddp_in_practice.throughput_run, 1, threads=1, backend="gloo", args=(x, y), kwargs=kwargs, quiet=True
    )
    two = distcourse.launch(
        ddp_in_practice.throughput_run, 2, threads=1, backend="gloo", args=(x, y), kwargs=kwargs, quiet=True
    )
    assert one[0]["samples"] == sum(r["samples"] for r in two) == 64
    # 4 steps of 16 samples, each adding the rounding of its sums
    numerics.assert_close(two[0]["params"], one[0]["params"], terms=4 * (2 * (64 + 16 + 10) + 16))


def test_self_check_rejects_wrong_answers_and_accepts_the_right_one(capsys):
    def no_padding(size, world_size, rank, epoch, seed=0):
        generator = torch.Generator().manual_seed(seed + epoch)
        return torch.randperm(size, generator=generator).tolist()[rank::world_size]

    def ignores_the_epoch(size, world_size, rank, epoch, seed=0):
        return right_shard(size, world_size, rank, 0, seed)

    def contiguous_blocks(size, world_size, rank, epoch, seed=0):
        order = right_shard(size, world_size, 0, epoch, seed) + right_shard(size, world_size, 1, epoch, seed)
        n = len(order) // 2
        return order[rank * n : (rank + 1) * n]

    assert ch04.check_shard(lambda *args, **kwargs: None) is False
    assert "returned None" in capsys.readouterr().out
    assert ch04.check_shard(no_padding) is False
    assert "pad" in capsys.readouterr().out
    assert ch04.check_shard(ignores_the_epoch) is False
    assert "seed + epoch" in capsys.readouterr().out
    assert ch04.check_shard(contiguous_blocks) is False
    assert ch04.check_shard(right_shard) is True
    assert "Correct" in capsys.readouterr().out


def test_first_backward_is_bucketed_by_size_only_with_find_unused_parameters(batch):
    x, y = batch
    model = {"width": 128, "depth": 2}
    first = {}
    for find_unused in (False, True):
        out = distcourse.launch(
            ddp.bucket_timeline,
            2,
            args=(x, y, [0.05], model),
            kwargs={"steps": 1, "find_unused_parameters": find_unused},
            quiet=True,
        )[0]
        first[find_unused] = out[0.05]["buckets_per_step"][0]
    assert first[False] == 1 and first[True] > 1


def test_mismatched_all_reduce_aborts_without_detail_and_names_both_shapes_with_it():
    with pytest.raises(distcourse.RankFailed, match="killed by signal SIGABRT"):
        distcourse.launch(
            ddp_in_practice.mismatched_all_reduce,
            2,
            args=([4, 5],),
            kwargs={"debug": None},
            backend="gloo",
            collective_timeout=5,
            timeout=30,
            quiet=True,
        )
    with pytest.raises(distcourse.RankFailed) as caught:
        distcourse.launch(
            ddp_in_practice.mismatched_all_reduce,
            2,
            args=([4, 5],),
            backend="gloo",
            collective_timeout=5,
            timeout=30,
            quiet=True,
        )
    for rank in range(2):
        said = caught.value.outputs[rank]
        assert (
            "Detected mismatch between collectives" in said and "TensorShape=[4]" in said and "TensorShape=[5]" in said
        )
    # Matching shapes pass the same checks.
    assert (
        distcourse.launch(ddp_in_practice.mismatched_all_reduce, 2, args=([3, 3],), backend="gloo", quiet=True)[0]
        == [2.0] * 3
    )


def test_ddp_training_with_two_dataloader_workers_per_rank():
    """The everyday loop: DistributedSampler, DataLoader(num_workers=2, persistent_workers=True), DDP, tqdm."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.rand(256, 64, generator=generator), torch.randint(10, (256,), generator=generator)
    runs = distcourse.launch(
        ddp_in_practice.train_with_loader,
        2,
        args=(x, y),
        kwargs={"epochs": 2, "batch_size": 16, "num_workers": 2, "model_kwargs": MODEL},
        quiet=True,
    )
    assert replicas.max_gap(runs[0]["params"], runs[1]["params"]) == 0  # equal parameters across ranks
    assert [r["steps"] for r in runs] == [16, 16]
    rank_pids = {r["pid"] for r in runs}
    for r in runs:
        assert len(r["loaders"]) == 2  # two workers per rank, children of that rank
        assert all(parent == r["pid"] and pid not in rank_pids for pid, parent in r["loaders"])
    assert "16/16" in runs.outputs[0] and "16/16" not in runs.outputs[1]  # the progress bar is rank 0's
    # The workers start the platform's way, not forced to fork: a rank already runs several threads.
    assert all(r["start_method"] == multiprocessing.get_start_method() for r in runs)
    assert all(r["threads"] is None or r["threads"] > 1 for r in runs)
    # Workers only change where batches are made, not what is learned.
    alone = distcourse.launch(
        ddp_in_practice.train_with_loader,
        2,
        args=(x, y),
        kwargs={"epochs": 2, "batch_size": 16, "num_workers": 0, "model_kwargs": MODEL},
        quiet=True,
    )
    assert alone[0]["loaders"] == [(-1, -1)]
    assert replicas.max_gap(alone[0]["params"], runs[0]["params"]) == 0


def test_a_rank_can_run_a_subprocess():
    runs = distcourse.launch(
        ddp_in_practice.run_subprocess, 2, args=("import os; print(os.getppid(), os.environ['RANK'])",), quiet=True
    )
    assert [r["stdout"].split() for r in runs] == [[str(r["pid"]), str(rank)] for rank, r in enumerate(runs)]


def test_global_stats_self_check_rejects_wrong_answers_and_accepts_the_right_one(capsys):
    def right(counts, sums, squares):
        n = sum(counts)
        mean = sum(sums) / n
        return mean, sum(squares) / n - mean**2

    def mean_of_means(counts, sums, squares):
        mean = torch.stack([s / n for s, n in zip(sums, counts)]).mean(0)
        return mean, right(counts, sums, squares)[1]

    def unbiased(counts, sums, squares):
        n = sum(counts)
        mean, var = right(counts, sums, squares)
        return mean, var * n / (n - 1)

    assert ch04.check_global_stats(lambda *args: (None, None)) is False
    assert "returned None" in capsys.readouterr().out
    assert ch04.check_global_stats(mean_of_means) is False
    assert "total count" in capsys.readouterr().out
    assert ch04.check_global_stats(unbiased) is False
    assert "unbiased" in capsys.readouterr().out
    assert ch04.check_global_stats(right) is True
    assert "Correct" in capsys.readouterr().out
