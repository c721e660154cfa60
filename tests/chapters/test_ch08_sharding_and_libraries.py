"""The chapter 08 helpers behave as the chapter says, and its self-check can fail."""

import pytest

import distcourse
from distcourse import libraries, sharding
from distcourse.common import numerics
from distcourse.exercises import ch08

GB = 1e9
# The sums behind a step of the libraries' MLP: along the layers (64 pixels, 64 hidden units,
# 10 classes) forward and backward, then over the global batch of 64.
STEP_TERMS = 2 * (64 + 64 + 10) + 64

# --- arithmetic ------------------------------------------------------------------------------


def test_zero_stages_shard_optimizer_then_gradients_then_parameters():
    psi, n = 1000, 4
    assert sharding.zero_bytes(psi, n, 0) == {"params": 2000, "grads": 2000, "optimizer": 12000}
    assert sharding.zero_bytes(psi, n, 1) == {"params": 2000, "grads": 2000, "optimizer": 3000}
    assert sharding.zero_bytes(psi, n, 2) == {"params": 2000, "grads": 500, "optimizer": 3000}
    assert sharding.zero_bytes(psi, n, 3) == {"params": 500, "grads": 500, "optimizer": 3000}
    assert sum(sharding.zero_bytes(psi, n, 0, sharding.FP32_ADAM).values()) == 16 * psi
    with pytest.raises(ValueError, match="stage"):
        sharding.zero_bytes(psi, n, 4)


def test_offloading_moves_optimizer_and_gradients_then_parameters():
    assert sharding.placement(7e9, 1, 2, offload_optimizer=True) == {"gpu": 14 * GB, "cpu": 98 * GB}
    assert sharding.placement(70e9, 8, 3) == {"gpu": 140 * GB, "cpu": 0}
    assert sharding.placement(70e9, 8, 3, offload_optimizer=True, offload_params=True) == {"gpu": 0, "cpu": 1120 * GB}
    with pytest.raises(ValueError, match="stage 3"):
        sharding.placement(7e9, 8, 2, offload_params=True)


def test_stage_3_sends_one_and_a_half_times_what_ddp_sends():
    assert sharding.ring_traffic(100, 4, 0) == sharding.ring_traffic(100, 4, 2) == 150
    assert sharding.ring_traffic(100, 4, 3) == 225
    # PyTorch's ZeroRedundancyOptimizer: DDP's all-reduce plus a broadcast of the parameters
    assert sharding.ring_traffic(100, 4, 1, zero_redundancy_optimizer=True) == 225
    with pytest.raises(ValueError):
        sharding.ring_traffic(100, 4, 2, zero_redundancy_optimizer=True)


def test_padding_rounds_the_first_dimension_up():
    assert sharding.padded_numel((256, 64), 3) == 86 * 64
    assert sharding.padded_numel((10,), 4) == 3


# --- the exercise's self-check ------------------------------------------------------------------


def right(gpu_bytes, world_size, stage):
    params = 2 / world_size if stage >= 3 else 2
    grads = 2 / world_size if stage >= 2 else 2
    optimizer = 12 / world_size if stage >= 1 else 12
    return int(gpu_bytes // (params + grads + optimizer))


def test_self_check_rejects_wrong_answers_and_accepts_the_right_one(capsys):
    assert ch08.check_max_params(lambda g, n, s: None) is False
    assert "Not yet" in capsys.readouterr().out
    assert ch08.check_max_params(lambda g, n, s: int(g * n // 16)) is False  # everything sharded
    assert "stage 0" in capsys.readouterr().out
    assert ch08.check_max_params(lambda g, n, s: right(g, n, min(s, 1))) is False  # forgets stages 2, 3
    assert "stage 2" in capsys.readouterr().out
    assert ch08.check_max_params(lambda g, n, s: right(g, n, s) + 1) is False  # one too many
    assert ch08.check_max_params(lambda g, n, s: right(g, n, s) / 1) is False  # a float
    assert "whole number" in capsys.readouterr().out
    assert ch08.check_max_params(lambda g, n, s: 1 // 0) is False
    assert "raised" in capsys.readouterr().out
    assert ch08.check_max_params(right) is True
    assert "Correct" in capsys.readouterr().out


# --- real ranks --------------------------------------------------------------------------------


@pytest.mark.slow
def test_measured_bytes_match_the_formulas(no_leftovers):
    memory = distcourse.launch(sharding.measure_memory, 2, quiet=True)
    psi = sum(p.numel() for p in sharding.make_model().parameters())
    for report in memory:
        for name in ("ddp", "ddp_view"):
            assert {k: report[name][k] for k in sharding.PARTS} == sharding.zero_bytes(psi, 2, 0, sharding.FP32_ADAM)
        assert {k: report["fsdp"][k] for k in sharding.PARTS} == sharding.zero_bytes(psi, 2, 3, sharding.FP32_ADAM)
        # DDP's default buckets are a second copy of the fp32 gradients; as views they are the gradients
        assert report["ddp"]["buckets"] == report["zero1"]["buckets"] == 4 * psi
        assert report["ddp_view"]["buckets"] == report["zero1_view"]["buckets"] == report["fsdp"]["buckets"] == 0
    assert sum(r["zero1"]["optimizer"] for r in memory) == sum(r["zero1_view"]["optimizer"] for r in memory) == 8 * psi


def llama2_7b_shapes(vocab=32000, hidden=4096, ffn=11008, layers=32):
    """The parameter tensors of Llama 2 7B: embedding, per block 2 norms, q k v o, gate up down; head."""
    block = [(hidden,)] * 2 + [(hidden, hidden)] * 4 + [(ffn, hidden)] * 2 + [(hidden, ffn)]
    return [(vocab, hidden)] + block * layers + [(hidden,), (vocab, hidden)]


def gpt2_small_shapes(vocab=50257, hidden=768, context=1024, layers=12):
    """GPT-2 small: token and position embeddings (the head shares the token embedding), 12 blocks."""
    h = hidden
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    return [(vocab, h), (context, h)] + block * layers + [(h,), (h,)]


@pytest.mark.slow  # importing torch.distributed.optim takes seconds
def test_zero1_splits_transformers_evenly_unless_one_tensor_dominates():
    """What chapter 08 says of ZeroRedundancyOptimizer's greedy split, on real models' shapes."""
    import math

    llama = sharding.zero1_split(llama2_7b_shapes(), 8)
    assert sum(llama) == sum(math.prod(s) for s in llama2_7b_shapes()) == 6_738_415_616
    assert max(llama) < 1.02 * sum(llama) / 8  # many similar tensors: within 2% of the even share
    gpt2 = sharding.zero1_split(gpt2_small_shapes(), 8)
    assert sum(gpt2) == 124_439_808 and max(gpt2) == 50257 * 768  # one rank gets the embedding...
    assert max(gpt2) > 2 * sum(gpt2) / 8  # ...more than twice the even share
    # the chapter's MLP on 2 ranks: the 256 x 256 weight on one rank, everything else on the other
    assert sorted(sharding.zero1_split([tuple(p.shape) for p in sharding.make_model().parameters()], 2)) == [
        19466,
        65536,
    ]


@pytest.mark.slow
@pytest.mark.numerics
def test_fsdp_training_equals_one_process_and_unshards_while_computing(no_leftovers):
    sharded = distcourse.launch(sharding.fsdp_train, 2, quiet=True)
    reference = sharding.reference_train(world_size=2, steps=3)
    # Adam moves a weight by about lr (1e-3) per step: rounding changes a step by a fraction of it
    assert numerics.gap(sharded[0]["weights"], reference) < 1e-3
    seen = distcourse.launch(sharding.watch_unsharding, 2, quiet=True)
    assert [s[1:] for s in seen[0]] == [("DTensor", (128, 64)), ("Parameter", (256, 64)), ("DTensor", (128, 64))]


@pytest.mark.slow
def test_root_keeps_its_weights_after_forward_unless_told(no_leftovers):
    """FSDP2's reshard_after_forward: the default frees every unit's weights after forward but the root's."""
    seen = {
        option: distcourse.launch(sharding.root_after_forward, 2, args=(option,), quiet=True)[0]
        for option in (None, True, False)
    }
    assert seen[None] == {"unit": ("DTensor", (128, 64)), "root": ("Parameter", (10, 256))}
    assert seen[True] == {"unit": ("DTensor", (128, 64)), "root": ("DTensor", (5, 256))}
    assert seen[False] == {"unit": ("Parameter", (256, 64)), "root": ("Parameter", (10, 256))}


@pytest.fixture(scope="module")
def task():
    data = libraries.task_data(2)  # two steps: the runs are about start-up anyway
    return data, distcourse.launch(libraries.ddp_train, 2, args=(data,), quiet=True)[0]


@pytest.mark.numerics
def test_ddp_equals_one_process(task):
    data, ddp = task
    reference = libraries.reference_train(data)
    numerics.assert_close(ddp["losses"], reference["losses"], terms=len(reference["losses"]) * STEP_TERMS)
    assert libraries.max_weight_difference(ddp, reference) < libraries.LR  # less than one Adam step


def _agrees(run, ddp):
    """The same training: losses up to the rounding of every step so far, weights within one Adam step."""
    assert run["world_size"] == 2 and len(run["losses"]) == len(ddp["losses"])
    numerics.assert_close(run["losses"], ddp["losses"], terms=len(ddp["losses"]) * STEP_TERMS, what="losses")
    assert libraries.max_weight_difference(run, ddp) < libraries.LR


# The notebook runs ZeRO stage 2; stage 3 is the path that needs GatheredParameters.
SCRIPTS = {"lightning": (), "deepspeed": ("--zero-stage", "3")}


@pytest.fixture(scope="module")
def library_runs(task):
    """Both library scripts at once: their start-up is mostly waiting and importing, so they overlap well."""
    from concurrent.futures import ThreadPoolExecutor

    data, _ = task
    installed = [name for name in SCRIPTS if libraries.version(name)]
    with ThreadPoolExecutor(len(installed) or 1) as pool:
        futures = {name: pool.submit(libraries.run_script, name, data, extra_args=SCRIPTS[name]) for name in installed}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
def test_lightning_reruns_the_script_and_matches_ddp(task, library_runs, no_leftovers):
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (see requirements.txt)")
    run = library_runs["lightning"]
    _agrees(run, task[1])
    assert run["ranks"][1]["parent"] == run["ranks"][0]["pid"]
    assert run["default_sampler"] == ["DistributedSampler", True, 0]


@pytest.mark.slow
def test_deepspeed_zero3_runs_on_cpu_and_matches_ddp(task, library_runs, no_leftovers):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (see requirements.txt)")
    run = library_runs["deepspeed"]
    _agrees(run, task[1])
    assert run["zero_stage"] == 3 and run["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert run["backend"] == ("nccl" if distcourse.gpu_count() >= 2 else "gloo")


def test_launch_commands_name_the_real_launchers():
    assert libraries.command_line("lightning").startswith("python -m distcourse.scripts.lightning_train")
    for library in ("accelerate", "deepspeed"):
        assert libraries.command_line(library).startswith("python -m torch.distributed.run --standalone")
    with pytest.raises(ValueError, match="unknown library"):
        libraries.launch_command("horovod", [])


def _fake_launcher(monkeypatch, code):
    import sys

    monkeypatch.setattr(libraries, "launch_command", lambda library, args: [sys.executable, "-c", code])


def test_a_failing_script_raises_with_its_log(monkeypatch):
    _fake_launcher(monkeypatch, "print('[rank 0] about to fail'); raise SystemExit(3)")
    with pytest.raises(RuntimeError, match=r"(?s)accelerate run failed \(exit code 3\).*about to fail"):
        libraries.run_script("accelerate", libraries.task_data(1), timeout=30)


@pytest.mark.slow
def test_a_hanging_script_is_stopped_with_all_its_children(monkeypatch, tmp_path, no_leftovers):
    import psutil

    # Like torchrun, the "launcher" starts its rank in a session of its own; then both sleep.
    pid_file = tmp_path / "rank.pid"
    _fake_launcher(
        monkeypatch,
        "import subprocess, sys, time; "
        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        f"start_new_session=True); open({str(pid_file)!r}, 'w').write(str(rank.pid)); "
        "time.sleep(60)",
    )
    with pytest.raises(TimeoutError, match="did not finish in 3 s"):
        libraries.run_script("deepspeed", libraries.task_data(1), timeout=3)
    rank_pid = int(pid_file.read_text())
    try:
        assert psutil.Process(rank_pid).status() == psutil.STATUS_ZOMBIE  # dead, not yet reaped by init
    except psutil.NoSuchProcess:
        pass  # dead and gone
