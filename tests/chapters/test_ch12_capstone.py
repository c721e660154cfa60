"""Chapter 12: the capstone script (data, sampler, checkpoints, exact resume, layouts) and the
RPC parameter server."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import distcourse
import rank_workers
from distcourse import capstone, launchers, parameter_server, sharding
from distcourse.capstone import checkpointing, metrics, optim, parallelize
from distcourse.common import numerics, subprocesses
from distcourse.exercises import ch12
from distcourse.runtime import gpus

QUICK = ["--steps", "6", "--log-every", "2", "--eval-every", "3", "--eval-batches", "1", "--workers", "0"]
QUICK += ["--progress", "off", "--sample-bytes", "8", "--limit-windows", "40"]
# fp32 everywhere: with "auto", a run on GPUs would be bf16 and one on the CPU fp32, not comparable.
QUICK += ["--precision", "fp32"]
TOKENS = 8 * 64  # a step's global batch of the runs compared below, each loss a sum over them


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def test_corpus_is_the_course_prose_and_splits_in_two():
    text = capstone.corpus_text(capstone.COURSE_CHAPTERS)
    train, held = capstone.split_corpus(text, 0.1)
    assert "## What you will learn" in text and "[![Open In Colab]" not in text  # no header cells
    assert len(train) + len(held) == len(text.encode("utf-8")) and abs(len(held) / len(text.encode()) - 0.1) < 0.01


def test_missing_or_empty_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no corpus at .*pass --corpus"):
        capstone.corpus_text(tmp_path / "nowhere.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        capstone.corpus_text(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="--held-out must be between 0 and 1"):
        capstone.split_corpus("some text", 1.5)


def test_windows_give_inputs_and_targets_one_byte_later():
    data = torch.arange(100, dtype=torch.uint8)
    windows = capstone.Windows(data, seq_len=8)
    inputs, targets = windows[3]
    assert len(windows) == 12 and inputs.tolist() == list(range(24, 32)) and targets.tolist() == list(range(25, 33))
    assert len(capstone.Windows(data, seq_len=8, limit=5)) == 5
    with pytest.raises(ValueError, match="hold no window"):
        capstone.Windows(data[:5], seq_len=8)


def test_step_samples_deal_the_same_global_batch_differently_at_another_dp_size():
    dataset = capstone.Windows(torch.zeros(2000, dtype=torch.uint8), seq_len=8, limit=200)
    for step in (0, 7, 30):
        two, four = (capstone.step_samples(dataset, dp, 16 // dp, step) for dp in (2, 4))
        assert [len(s) for s in two] == [8, 8] and [len(s) for s in four] == [4] * 4
        assert sorted(sum(two, [])) == sorted(sum(four, [])) and two[0] != four[0]
    # what train() does at a step: the sampler pointed at it, the first batch of what it yields
    sampler = capstone.ResumableSampler(dataset, num_replicas=2, rank=1, seed=0, drop_last=True)
    capstone.start_at(sampler, 30, len(sampler) // 8, 8)
    assert list(sampler)[:8] == capstone.step_samples(dataset, 2, 8, 30)[1]
    # another global batch (8): step 30 falls in another epoch, on other samples
    assert not set(sum(capstone.step_samples(dataset, 2, 4, 30), [])) <= set(sum(two, []))


def test_resumable_sampler_continues_the_epoch_where_it_stopped():
    dataset = capstone.Windows(torch.zeros(2000, dtype=torch.uint8), seq_len=8)
    sampler = capstone.ResumableSampler(dataset, num_replicas=2, rank=1, seed=3, drop_last=True)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.skip = 40
    assert list(sampler) == full[40:] and len(sampler) == len(full) - 40
    sampler.skip = 0
    sampler.set_epoch(3)
    assert list(sampler) != full  # set_epoch: a new order every epoch


# --------------------------------------------------------------------------------------
# Checkpoints and the script in one process
# --------------------------------------------------------------------------------------


def test_latest_complete_skips_a_save_cut_short(tmp_path):
    for step, complete in ((10, True), (20, True), (30, False)):
        folder = capstone.checkpoint_dir(tmp_path, step)
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (folder / ".metadata").write_bytes(b"x")
    assert capstone.latest_complete(tmp_path) == (20, tmp_path / "step-000020", ["step-000030"])
    assert capstone.latest_complete(tmp_path / "absent") == (0, None, [])


def test_bad_arguments_fail_before_training():
    with pytest.raises(SystemExit):
        capstone.parse_args(["--steps", "0"])
    with pytest.raises(ValueError, match="--tp 2 needs 2 or more ranks"):
        capstone.main(["--tp", "2", *QUICK])


def test_one_process_writes_metrics_final_weights_and_sample(tmp_path):
    result = capstone.main([*QUICK, "--out", str(tmp_path)])
    curves = capstone.read_metrics(tmp_path)
    assert result["world size"] == 1 and result["precision"] == "fp32" and result["tokens per second"] > 0
    assert sorted(curves["loss"]) == list(range(6)) and sorted(curves["held-out"]) == [3, 6]
    assert {int(k): v for k, v in result["loss"].items()} == curves["loss"]
    final = capstone.gpt(None, vocab=256)
    final.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    assert capstone.generate(final, "Distributed training ", 8, context=64) == result["sample"]
    assert (tmp_path / "sample.txt").read_text(encoding="utf-8") == result["sample"]


def test_saves_report_what_they_cost_the_loop(tmp_path):
    ckpt = ["--save-every", "3", "--steps", "6"]
    waited = capstone.main([*QUICK, *ckpt, "--ckpt-dir", str(tmp_path / "sync"), "--sync-save"])["saves"]
    background = capstone.main([*QUICK, *ckpt, "--ckpt-dir", str(tmp_path / "async")])["saves"]
    assert [s["step"] for s in waited] == [s["step"] for s in background] == [3, 6]
    assert all(s["complete after"] == s["waited"] > 0 and not s["writing on return"] for s in waited)
    assert all(s["complete after"] >= s["waited"] > 0 for s in background)
    assert capstone.latest_complete(tmp_path / "async")[0] == capstone.latest_complete(tmp_path / "sync")[0] == 6


@pytest.fixture
def restore_determinism(monkeypatch):
    """``--deterministic`` sets process-wide state: give the test process its own back."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def test_deterministic_flag_sets_what_gpus_need_and_changes_nothing_on_a_cpu(restore_determinism, tmp_path):
    corpus = tmp_path / "corpus.txt"  # fixed text: the chapters may change between the two runs
    corpus.write_text(capstone.corpus_text(capstone.COURSE_CHAPTERS), encoding="utf-8")
    torch.use_deterministic_algorithms(False)
    plain = capstone.main([*QUICK, "--corpus", str(corpus)])
    assert not torch.are_deterministic_algorithms_enabled()
    deterministic = capstone.main([*QUICK, "--corpus", str(corpus), "--deterministic"])
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # cuBLAS reads it at its first call
    assert deterministic["loss"] == plain["loss"] and deterministic["held-out"] == plain["held-out"]
    assert deterministic["sample"] == plain["sample"]


def test_resume_from_a_checkpoint_gives_the_uninterrupted_curve(tmp_path, restore_determinism):
    """Schedule, loader position and the step come from the checkpoint: drop one and the curves part."""
    exact = [*QUICK, "--deterministic", "--steps", "9"]  # bitwise comparisons: on GPUs only with deterministic kernels
    whole = capstone.main([*exact, "--out", str(tmp_path / "whole")])
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt")]
    capstone.main([*exact, *ckpt, "--save-every", "3", "--background-staging"])  # saves steps 3, 6 and 9
    for later in ("step-000006", "step-000009"):
        (tmp_path / "ckpt" / later).rename(tmp_path / later)  # resume from step 3: mid-epoch, mid-warm-up
    resumed = capstone.main([*exact, *ckpt, "--save-every", "100", "--out", str(tmp_path / "cut")])
    assert resumed["resumed from"] == 3 and resumed["steps per epoch"] == 5
    cut, full = capstone.read_metrics(tmp_path / "cut"), capstone.read_metrics(tmp_path / "whole")
    for curve in ("loss", "grad norm", "lr"):
        assert cut[curve] == {step: value for step, value in full[curve].items() if step >= 3}, curve
    assert resumed["sample"] == whole["sample"]


def test_a_checkpoint_holds_the_schedule_the_loader_position_and_the_loss_scale(tmp_path):
    capstone.main([*QUICK, "--precision", "fp16", "--steps", "7", "--ckpt-dir", str(tmp_path), "--save-every", "7"])
    state = {"scheduler": {"last_epoch": -1}, "loader": {"epoch": -1, "samples": -1}, "scaler": {"scale": 0.0}}
    dcp.load(state, checkpoint_id=tmp_path / "step-000007", no_dist=True)  # a partial load: these entries only
    assert state["loader"] == {"epoch": 1, "samples": 16}  # 5 steps of 8 windows per epoch: step 7 is 2 batches in
    assert state["scheduler"]["last_epoch"] == 7
    assert state["scaler"]["scale"] == 2.0**16  # GradScaler's initial scale: no overflow, no growth yet


def test_a_loader_refuses_a_position_that_is_not_a_whole_number_of_batches():
    dataset = capstone.Windows(torch.zeros(2000, dtype=torch.uint8), seq_len=8, limit=40)
    _, loader, _ = capstone.make_loader(capstone.parse_args(QUICK), dataset, 1, 0, torch.device("cpu"))
    loader.load_state_dict({"epoch": 2, "samples": 16})
    assert (loader.epoch, loader.batches) == (2, 2) and len(list(loader)) == 3 and loader.state_dict()["epoch"] == 3
    with pytest.raises(ValueError, match="global batch"):
        loader.load_state_dict({"epoch": 0, "samples": 12})


# --------------------------------------------------------------------------------------
# What a team's job has: schedule, weight decay, clipping, fp16, MFU
# --------------------------------------------------------------------------------------


def test_learning_rate_warms_up_then_follows_a_cosine_to_a_tenth():
    lr = capstone.main([*QUICK, "--steps", "12", "--warmup", "4", "--lr", "0.01"])["lr"]
    assert [lr[s] for s in range(4)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])  # (step + 1) / warmup
    assert all(lr[s] > lr[s + 1] for s in range(3, 11)) and lr[11] == pytest.approx(0.01 * optim.FLOOR)
    assert lr[7] == pytest.approx(0.01 * (0.1 + 0.9 * 0.5))  # half-way through the cosine
    assert optim.lr_factor(12, 4, 12) == pytest.approx(optim.FLOOR)


def test_weight_decay_falls_on_the_linear_layers_weights_only():
    model = capstone.gpt(0, vocab=256)
    linear = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert optim.decayed_names(model) == linear and not any("norm" in n or "embed" in n for n in linear)
    optimizer, _ = optim.build_optimizer(model, capstone.parse_args(["--lr", "0.01", "--weight-decay", "0.5"]))
    lr = optimizer.param_groups[0]["lr"]  # step 0 of the warm-up
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: AdamW's step is its decay alone
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - lr * 0.5 if name in linear else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1.3e-6, atol=0, msg=name)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in linear)


def test_clipping_scales_the_gradients_to_max_norm_and_changes_the_training():
    model = capstone.gpt(0, vocab=256)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    capstone.loss_of(model, tokens[:, :-1], tokens[:, 1:]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert torch.equal(optim.clip(model, 0), nn.utils.get_total_norm(grads))  # 0: measured, not clipped
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    norm = optim.clip(model, 0.01)
    after = nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert norm > 0.1 and after.item() == pytest.approx(0.01, rel=1e-5)
    clipped, free = (capstone.main([*QUICK, "--max-norm", m]) for m in ("0.01", "0"))
    assert clipped["grad norm"][0] == free["grad norm"][0] > 0.01  # the same first step, measured before clipping
    assert clipped["loss"][5] != free["loss"][5]


def test_fp16_with_a_loss_scaler_trains_like_fp32_on_this_cpu():
    assert optim.grad_scaler(torch.device("cpu"), "fp16").is_enabled()
    assert not optim.grad_scaler(torch.device("cpu"), "bf16").is_enabled()
    fp32, fp16 = capstone.main(QUICK), capstone.main([*QUICK, "--precision", "fp16"])
    assert fp16["precision"] == "fp16"
    # fp16 keeps 11 significant bits (bf16 8): its gap stays under chapter 12's bound for bf16.
    assert 0 < numerics.gap(fp16["loss"], fp32["loss"]) < 5e-3


def test_precision_auto_follows_the_gpu_profile(monkeypatch):
    for profile in gpus.PROFILES.values():
        expected = "bf16" if profile.native_bf16 else "fp16"
        assert parallelize.choose_precision("auto", profile) == expected, profile.key
    assert parallelize.choose_precision("auto", gpus.PROFILES["T4"]) == "fp16"  # emulated bf16 is not fast bf16
    assert parallelize.choose_precision("auto", gpus.PROFILES["A100-80GB-SXM"]) == "bf16"
    assert parallelize.choose_precision("auto", None) == "fp32"  # a CPU
    assert parallelize.choose_precision("bf16", gpus.PROFILES["T4"]) == "bf16"  # a flag given is a flag obeyed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    assert parallelize.profile_of(torch.device("cuda", 0)).key == "V100-SXM2-32GB"
    assert parallelize.profile_of(torch.device("cpu")) is None


def test_mfu_comes_from_tokens_per_second_and_the_profile_peak(capsys):
    h100 = gpus.PROFILES["H100-SXM"]
    flops = metrics.flops_per_token(130_000, layers=2, hidden=64, seq_len=64)
    assert flops == 6 * 130_000 + 12 * 2 * 64 * 64
    mfu = metrics.model_flops_utilization(4e6, flops, 4, metrics.peak_of(h100, "bf16"))
    assert mfu == pytest.approx(4e6 * flops / 4 / 989.5e12)
    assert metrics.peak_of(h100, "fp32") == 67 and metrics.peak_of(None, "bf16") is None
    result = capstone.main(QUICK)
    assert result["mfu"] is None and "[rank 0] MFU needs a GPU profile" in capsys.readouterr().out


# --------------------------------------------------------------------------------------
# Distributed layouts
# --------------------------------------------------------------------------------------


def test_fsdp_on_two_ranks_trains_what_one_process_trains():
    one = capstone.main([*QUICK, "--batch-size", "8"])
    two = distcourse.launch(capstone.main, 2, args=([*QUICK, "--batch-size", "4"],), quiet=True)
    assert two[0]["dp"] == two[1]["dp"] == 2
    numerics.assert_close(two[0]["loss"], one["loss"], terms=TOKENS)
    # clipping under FSDP2: the norm of the sharded gradients is the whole model's
    numerics.assert_close(two[0]["grad norm"], one["grad norm"], terms=TOKENS, what="gradient norm")
    assert min(one["grad norm"].values()) > 1.0  # above --max-norm 1: every step was clipped
    # fp16 on two ranks: ShardedGradScaler unscales the shards and agrees on overflows across ranks
    half = distcourse.launch(capstone.main, 2, args=([*QUICK, "--batch-size", "4", "--precision", "fp16"],), quiet=True)
    assert half[0]["precision"] == "fp16" and 0 < numerics.gap(half[0]["loss"], one["loss"]) < 5e-3
    assert "sample" not in two[1]  # only rank 0 generates and reports


@pytest.mark.slow
def test_tensor_parallel_mesh_and_activation_checkpointing_train_the_same_model():
    reference = distcourse.launch(
        capstone.main, 4, args=([*QUICK, "--batch-size", "2", "--deterministic"],), quiet=True
    )[0]
    mesh = distcourse.launch(capstone.main, 4, args=([*QUICK, "--batch-size", "4", "--tp", "2"],), quiet=True)[0]
    checkpointed = distcourse.launch(
        capstone.main,
        4,
        args=([*QUICK, "--batch-size", "2", "--activation-checkpointing", "--deterministic"],),
        quiet=True,
    )[0]
    assert (mesh["dp"], mesh["tp"]) == (2, 2)
    numerics.assert_close(mesh["loss"], reference["loss"], terms=TOKENS)
    # clipping across the (dp, tp) mesh with sequence parallelism: the same norms as FSDP2 alone
    numerics.assert_close(mesh["grad norm"], reference["grad norm"], terms=TOKENS, what="gradient norm")
    assert checkpointed["loss"] == reference["loss"]  # bitwise: the recomputation repeats the same kernels


@pytest.mark.slow
@pytest.mark.numerics
def test_a_two_rank_checkpoint_resumes_on_four_ranks_and_on_a_mesh(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    common = [*QUICK, "--steps", "6", "--log-every", "1", "--eval-every", "6"]
    two = distcourse.launch(
        capstone.main,
        2,
        args=([*common, "--batch-size", "4", "--ckpt-dir", str(tmp_path), "--save-every", "3"],),
        quiet=True,
    )[0]
    (tmp_path / "step-000006").rename(tmp_path / "later")  # resume from step 3
    argv = [*common, "--ckpt-dir", str(tmp_path), "--save-every", "100"]
    layouts = {"flat": ["--batch-size", "2"], "mesh": ["--batch-size", "4", "--tp", "2"]}
    ranks = distcourse.launch(capstone.resume_resharded, 4, args=(argv, layouts), quiet=True)
    dcp_to_torch_save(tmp_path / "step-000003", tmp_path / "step-3.pt")
    converted = torch.load(tmp_path / "step-3.pt", weights_only=True)["model"]
    weights = checkpointing.model_weights(tmp_path / "step-000003")  # the model's entries only
    assert weights.keys() == converted.keys() and all(torch.equal(weights[k], converted[k]) for k in converted)
    w2 = "layers.0.feed_forward.w2.weight"
    assert [r["flat"]["loaded"]["local shapes"][w2] for r in ranks] == [(16, 256)] * 4
    assert [r["mesh"]["loaded"]["local shapes"][w2] for r in ranks] == [(32, 128)] * 4
    # sequence parallelism: every parameter, the norms' included, on the one (dp, tp) mesh
    assert set(ranks[0]["mesh"]["loaded"]["meshes"].values()) == {("dp", "tp")}
    assert set(ranks[0]["flat"]["loaded"]["meshes"].values()) == {("dp",)}
    for name in layouts:
        loaded, run = ranks[0][name]["loaded"], ranks[0][name]["run"]
        assert loaded["step"] == run["resumed from"] == 3 and ranks[1][name]["loaded"]["model"] is None
        assert loaded["model"].keys() == converted.keys()
        assert all(torch.equal(loaded["model"][k], converted[k]) for k in converted)
        numerics.assert_close(run["loss"], {s: two["loss"][s] for s in (3, 4, 5)}, terms=TOKENS, what=name)


def test_loading_needs_a_complete_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        capstone.loaded_model(capstone.parse_args(["--ckpt-dir", str(tmp_path)]), torch.device("cpu"), 1)


def test_tensor_parallel_degree_must_divide_the_ranks():
    with pytest.raises(distcourse.RankFailed, match="must divide the world size"):
        distcourse.launch(capstone.main, 2, args=([*QUICK, "--tp", "3"],), quiet=True)


@pytest.mark.slow
def test_torchrun_kill_and_restart_resumes_exactly(tmp_path):
    corpus = tmp_path / "corpus.txt"  # fixed text: the chapters may change between the two runs
    corpus.write_text(capstone.corpus_text(capstone.COURSE_CHAPTERS), encoding="utf-8")
    common = [
        *QUICK,
        "--steps",
        "8",
        "--log-every",
        "1",
        "--deterministic",
        "--corpus",
        corpus,
    ]  # bitwise, also on GPUs
    plain = subprocesses.run(
        subprocesses.torchrun(
            "--standalone",
            "--nproc-per-node=2",
            module="distcourse.capstone",
            script_args=[*common, "--out", tmp_path / "a"],
        ),
        timeout=120,
    )
    killed = subprocesses.run(
        subprocesses.torchrun(
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            module="distcourse.capstone",
            script_args=[*common, "--out", tmp_path / "b", "--ckpt-dir", tmp_path / "b" / "ckpt", "--save-every", "3"]
            + ["--kill-at", "5"],
        ),
        timeout=120,
    )
    assert killed.all_json(1, "kill") == [{"step": 5}] and len(killed.ranks[1]) == 2  # the kill's sentence and tag
    assert killed.json(0, "resume") == {"step": 3, "checkpoint": "step-000003", "ignored": []}
    assert capstone.read_metrics(tmp_path / "a") == capstone.read_metrics(tmp_path / "b")
    assert plain.json(0, "result")["sample"] == killed.json(0, "result")["sample"]


def test_every_rank_resumes_from_the_checkpoint_rank_0_sees(tmp_path):
    # Rank 1's folder shows a newer complete checkpoint than rank 0's (as a node with stale
    # attribute caches can): both resume from rank 0's, and nobody loads a step the other skips.
    roots = [tmp_path / "rank0", tmp_path / "rank1"]
    for root, steps in zip(roots, ([4], [4, 8])):
        for step in steps:
            checkpointing.checkpoint_dir(root, step).mkdir(parents=True)
            (checkpointing.checkpoint_dir(root, step) / ".metadata").write_bytes(b"")
    checkpointing.checkpoint_dir(roots[0], 6).mkdir()  # started, never finished: no .metadata
    seen = distcourse.launch(rank_workers.resume_point_seen, 2, args=([str(r) for r in roots],), quiet=True)
    assert checkpointing.latest_complete(roots[1])[0] == 8  # alone, rank 1 would have chosen step 8
    assert seen == [(4, str(roots[0] / "step-000004"), ["step-000006"])] * 2


def test_slurm_script_runs_the_module_it_is_given():
    (call,) = launchers.slurm_dry_run(args=["-m", "distcourse.capstone", "--steps", "7"])
    assert call[call.index("-m") :] == ["-m", "distcourse.capstone", "--steps", "7"]
    (default,) = launchers.slurm_dry_run()
    assert default[default.index("-m") + 1] == "distcourse.train"


# --------------------------------------------------------------------------------------
# RPC
# --------------------------------------------------------------------------------------


def _gap(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_synchronous_parameter_server_equals_one_process():
    result = distcourse.launch(
        parameter_server.parameter_server, 3, kwargs={"port": subprocesses.free_port(), "steps": 4}, quiet=True
    )[0]
    reference = parameter_server.one_process(4, trainers=2, batch=32, width=32, lr=0.5)
    params = sum(p.numel() for p in reference)
    assert _gap(result["params"], reference) < 1e-6
    assert result["bytes"] == {"in": 2 * 4 * params * 4, "out": 2 * 4 * params * 4}


def test_allreduce_and_remote_autograd_equal_one_process():
    allreduce = distcourse.launch(parameter_server.allreduce_training, 2, kwargs={"steps": 4}, quiet=True)[0]
    remote = distcourse.launch(
        parameter_server.remote_autograd, 2, kwargs={"port": subprocesses.free_port(), "steps": 4}, quiet=True
    )
    assert _gap(allreduce["params"], parameter_server.one_process(4, 2, 32, 32, 0.5)) < 1e-6
    assert _gap(remote[1]["params"], parameter_server.one_process(4, 1, 32, 32, 0.5)) < 1e-6
    assert any("TorchScript" in w for w in remote[0]["warnings"])


def test_parameter_server_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="mode must be 'sync' or 'async'"):
        parameter_server.ParameterServer("sometimes", trainers=2, width=8, lr=0.1)
    with pytest.raises(distcourse.RankFailed, match="remote_autograd runs on 2 ranks"):
        distcourse.launch(parameter_server.remote_autograd, 3, kwargs={"port": subprocesses.free_port()}, quiet=True)


def test_ring_all_reduce_bytes_per_rank_is_chapter_03s_formula():
    assert sharding.ring_traffic(1000, 4, stage=0) * 4 == 2 * 3 / 4 * 1000 * 4
    assert sharding.ring_traffic(1000, 1, stage=0) == 0


# --------------------------------------------------------------------------------------
# Exercises
# --------------------------------------------------------------------------------------


def test_resume_point_check_accepts_the_answer_and_rejects_a_wrong_one():
    assert ch12.check_resume_point(lambda step, per_epoch, batch: (step // per_epoch, step % per_epoch * batch))
    assert not ch12.check_resume_point(lambda step, per_epoch, batch: (step // per_epoch, 0))
    assert not ch12.check_resume_point(lambda step, per_epoch, batch: None)


@pytest.mark.slow
def test_server_bytes_check_uses_a_real_server():
    assert ch12.check_server_bytes(lambda params, trainers: 2 * trainers * params * 4)
    assert not ch12.check_server_bytes(lambda params, trainers: trainers * params * 4)


def test_result_line_is_json_without_the_curves(capsys):
    capstone.main(QUICK)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[rank 0] result ")][0]
    assert "loss" not in json.loads(line.split("result ", 1)[1])


def test_a_slower_trainer_computes_while_the_other_pushes():
    """The overlap chapter 12 shows holds by construction, not by how long a sleep lasts.

    Trainer 2 is barely slower (0.1 ms): with sleeps alone, the two trainers' pushes would land in
    any order. It starts its extra work only once trainer 1 has pushed since its pull: its first
    asynchronous push is stale, and in a synchronous round trainer 1's push waits at least for
    trainer 2's whole delay.
    """
    delays = (0.02, 0.0201)
    runs = {
        mode: distcourse.launch(
            parameter_server.parameter_server,
            3,
            kwargs={"port": subprocesses.free_port(), "mode": mode, "steps": 3, "delays": delays},
            quiet=True,
        )[0]
        for mode in ("sync", "async")
    }
    assert runs["async"]["staleness"][2][0] >= 1, runs["async"]["staleness"]
    assert runs["async"]["steps taken"] == 6
    assert min(runs["sync"]["trainers"][0]["push seconds"]) >= delays[1]
    assert runs["sync"]["staleness"] == {1: [0, 0, 0], 2: [0, 0, 0]}
