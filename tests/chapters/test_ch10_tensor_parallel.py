"""Chapter 10: DTensor redistributions, Megatron TP by hand, parallelize_module with SP and loss
parallel, 2-D meshes (TP + FSDP2, HSDP) with their traffic, the volume formulas and the decision rule."""

from __future__ import annotations

import pytest
import torch

import distcourse
from distcourse import meshes
from distcourse import tensor_parallel as tp
from distcourse.common import numerics
from distcourse.common.models import GPT, gpt
from distcourse.exercises import ch10


def test_redistributions_issue_the_expected_collective_and_keep_the_values():
    rows = distcourse.launch(tp.redistribute_costs, world_size=2, quiet=True)[0]
    assert {(row["from"], row["to"]) for row in rows} == set(tp.REDISTRIBUTE_COLLECTIVE)
    for row in rows:
        assert row["same values"]  # Partial("max") too: a sum of its pieces would not give the full tensor
        issued = next(iter(row["collectives"]), None)
        assert issued == ("all-gather" if row["expected"] == "all-to-all" else row["expected"]), row  # a CPU mesh
        # gloo has an all-to-all of its own (DTensor just does not use it on CPU meshes), and it agrees
        assert row["backend all-to-all"] is (True if row["expected"] == "all-to-all" else None)


def test_async_tensor_parallel_is_off_by_default():
    import torch._inductor.config as inductor_config

    assert inductor_config._micro_pipeline_tp is False  # the chapter says "not on by default"


def test_context_parallel_defaults_are_all_gather_with_load_balancing():
    assert tp.context_parallel_defaults() == {"rotate method": "allgather", "load balancing": True}


@pytest.mark.numerics
def test_megatron_by_hand_is_the_unsplit_mlp_with_one_all_reduce_each_way():
    h, tokens = 64, 32
    for r in distcourse.launch(tp.megatron_by_hand, world_size=2, kwargs={"hidden": h, "tokens": tokens}, quiet=True):
        assert r["forward"] == r["backward"] == {"all-reduce": 1}
        split, unsplit = r["split"], r["unsplit"]
        # the sums' lengths: forward x W1ᵀ (h) then W2ᵀ (4h); backward dy W2 (h), then W1 (4h) or the tokens
        numerics.assert_close(split["output"], unsplit["output"], terms=5 * h, what="output")
        numerics.assert_close(split["input grad"], unsplit["input grad"], terms=10 * h, what="input gradient")
        numerics.assert_close(split["weight grads"], unsplit["weight grads"], terms=6 * h + tokens, what="weight grads")


def test_gpt_heads_follow_the_weights():
    model = gpt(hidden=32, heads=4, layers=1, vocab=50)
    assert model(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)
    with pytest.raises(ValueError, match="multiple of heads"):
        GPT(hidden=30, heads=4)


@pytest.mark.numerics
@pytest.mark.parametrize("sequence_parallel, loss_parallel", [(False, False), (True, True)])
def test_tensor_parallel_gpt_trains_like_one_process(sequence_parallel, loss_parallel):
    single = tp.reference_train(steps=2)
    r = distcourse.launch(
        tp.tp_train,
        world_size=2,
        kwargs={"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel, "steps": 2},
        quiet=True,
    )[0]
    numerics.assert_close(r["losses"], single["losses"], terms=tp.loss_terms(), what="losses")
    # AdamW (lr 1e-2) moves every parameter about lr per step: rounding changes a fraction of a step
    assert numerics.gap(r["params"], single["params"]) < 1e-2
    forward = r["collectives"]["forward"]
    if sequence_parallel:  # reduce-scatters instead of all-reduces; loss parallel adds its 3 small ones
        assert forward.get("all-reduce", 0) == (3 if loss_parallel else 0) and forward["reduce-scatter"] == 5
    else:
        assert forward["all-reduce"] == 5
    assert r["activation bytes"] < tp.activation_bytes_one_process()


@pytest.mark.numerics
def test_tp_variants_in_one_launch_match_separate_runs():
    together = distcourse.launch(tp.tp_variants, world_size=2, kwargs={"steps": 1}, quiet=True)[0]
    assert list(together) == list(tp.TP_VARIANTS)
    alone = distcourse.launch(tp.tp_train, world_size=2, kwargs={"steps": 1, **tp.TP_VARIANTS["TP + SP"]}, quiet=True)[
        0
    ]
    assert together["TP + SP"]["collectives"] == alone["collectives"]
    assert together["TP + SP"]["losses"] == alone["losses"]  # the same kernels on the same data: bitwise


@pytest.mark.slow
@pytest.mark.numerics
def test_two_dimensional_layouts_train_like_one_process():
    reference = meshes.reference(steps=2)
    runs = distcourse.launch(meshes.mesh_train_all, world_size=4, kwargs={"steps": 2}, quiet=True)[0]
    assert list(runs) == list(meshes.LAYOUTS)
    for layout, r in runs.items():
        numerics.assert_close(r["losses"], reference["losses"], terms=tp.loss_terms(batch=meshes.GLOBAL_BATCH))
        assert numerics.gap(r["params"], reference["params"]) < 1e-2  # less than one AdamW step (lr 1e-2)
        dims = {dim for dim, _ in r["traffic"]}
        assert dims == {"fsdp": {"dp"}, "tp+fsdp": {"dp", "tp"}, "hsdp": {"replicate", "shard"}}[layout]


def test_a_layout_needs_an_even_number_of_ranks():
    with pytest.raises(distcourse.RankFailed, match="even number of ranks"):
        distcourse.launch(meshes.mesh_train, world_size=3, kwargs={"layout": "hsdp"}, quiet=True, timeout=120)


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layout must be one of"):
        meshes.volume("zero4", params=1, layers=1, hidden=1, tokens=1, gpus_per_node=1, nodes=1)


def test_volume_formulas():
    shape = dict(params=1000, layers=2, hidden=8, tokens=16, pbytes=1, abytes=1)
    assert meshes.volume("ddp", **shape, gpus_per_node=4, nodes=1) == {"inside": 2 * 3 / 4 * 1000, "between": 0.0}
    assert meshes.volume("fsdp", **shape, gpus_per_node=2, nodes=2) == {"inside": 0.0, "between": 3 * 3 / 4 * 1000}
    assert meshes.volume("hsdp", **shape, gpus_per_node=2, nodes=2) == {"inside": 1500.0, "between": 500.0}
    assert meshes.volume("tp+fsdp", **shape, gpus_per_node=2, nodes=2) == {
        "inside": 8 * 2 * 0.5 * 16 * 8,
        "between": 750.0,
    }
    # full activation checkpointing: 11 TP collectives per layer instead of 8; FSDP's traffic unchanged
    recomputed = meshes.volume("tp+fsdp", **shape, gpus_per_node=2, nodes=2, recompute=True)
    assert recomputed == {"inside": 11 * 2 * 0.5 * 16 * 8, "between": 750.0}
    assert (meshes.tp_collectives_per_layer(), meshes.tp_collectives_per_layer(recompute=True)) == (8, 11)


def test_step_time_with_checkpointing_recomputes_the_forward():
    size = dict(params=70e9, layers=80, hidden=8192, seq=4096, batch=1, gpus_per_node=8, nodes=2)
    plain, checkpointed = meshes.step_time("tp+fsdp", **size), meshes.step_time("tp+fsdp", **size, checkpointing=True)
    assert checkpointed["compute"] == pytest.approx(plain["compute"] * 8 / 6)  # forward twice: 8 P T, not 6 P T
    shape = dict(params=70e9, layers=80, hidden=8192, tokens=8 * 4096, gpus_per_node=8, nodes=2)
    tp_seconds = meshes.volume("tp+fsdp", **shape)["inside"] / meshes.LINK_SPEEDS["nvlink"]
    extra = checkpointed["communication"] - plain["communication"]
    assert extra == pytest.approx(tp_seconds * 3 / 8)  # 11 TP collectives per layer instead of 8
    fsdp = meshes.step_time("fsdp", **size)
    assert fsdp == meshes.step_time("fsdp", **size, checkpointing=False)  # the default: what chapter 12 uses


def test_links_are_named_in_the_readers_language():
    assert list(meshes.links().values()) == list(meshes.LINK_SPEEDS.values())
    assert all(isinstance(name, str) and name for name in meshes.links())


def test_decision_rule_follows_memory_and_traffic():
    def pick(params, layers, hidden, heads, nodes):
        return meshes.choose(
            params=params,
            layers=layers,
            hidden=hidden,
            heads=heads,
            seq=4096,
            batch=1,
            gpu_memory=80e9,
            gpus_per_node=8,
            nodes=nodes,
        )["layout"]

    assert pick(1.3e9, 24, 2048, 16, 1) == "ddp"
    assert pick(6.7e9, 32, 4096, 32, 1) == "fsdp"
    assert pick(6.7e9, 32, 4096, 32, 4) == "hsdp"
    assert pick(70e9, 80, 8192, 64, 16) == "tp+fsdp"
    assert pick(70e9, 80, 8192, 64, 1) is None  # 16 B x 70e9 = 1.12 TB of model states > 8 x 80 GB


def test_decision_rule_says_when_nothing_fits():
    size = dict(params=70e9, layers=80, hidden=8192, heads=64, seq=4096, batch=1, gpus_per_node=8, nodes=1)
    choice = meshes.choose(**size, gpu_memory=80e9)
    assert choice["layout"] is None and "does not fit" in choice["verdict"]
    assert "pipeline" not in choice["verdict"]  # pipeline stages do not shrink sharded model states
    assert not any(r["fits"] for r in choice["rows"])
    assert meshes.choose(**size, gpu_memory=200e9)["layout"] == "fsdp"  # bigger GPUs: it fits again


def test_context_parallel_refuses_the_cpu():
    if distcourse.gpu_count() >= 2:
        pytest.skip("on GPUs the cell runs for real")
    with pytest.raises(distcourse.RankFailed, match="needs CUDA attention kernels"):
        distcourse.launch(tp.context_parallel_attention, world_size=2, quiet=True)


def _right(source, target):
    if source == target or source == "Replicate()":
        return None
    if source == "Partial()":
        return "all-reduce" if target == "Replicate()" else "reduce-scatter"
    return "all-gather" if target == "Replicate()" else "all-to-all"


def test_exercise_accepts_the_solution_and_names_a_wrong_answer(capsys):
    assert ch10.check_collective_for(_right) is True
    assert ch10.check_collective_for(lambda s, t: "all-reduce") is False
    assert "DTensor issued" in capsys.readouterr().out
    assert ch10.check_collective_for(lambda s, t: "broadcast") is False
