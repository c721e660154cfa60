"""Chapter 09, second part: torch.compile (graphs, breaks, cost, cache, DDP, FSDP2) and FSDP2 options."""

from __future__ import annotations

import pytest
import torch

import distcourse
from distcourse import compiling, float8, fsdp_training
from distcourse.common import numerics
from distcourse.exercises import ch09


def test_a_python_branch_on_a_tensor_breaks_the_graph_and_where_does_not():
    x = torch.randn(8, 16)
    branchy = compiling.explain(compiling.Branchy(), x)
    assert (branchy["graphs"], branchy["breaks"]) == (2, 1) and len(branchy["reasons"]) == 1
    assert compiling.explain(compiling.Branchless(), x) == {"graphs": 1, "breaks": 0, "reasons": []}


def test_branchless_computes_what_branchy_computes():
    branchy, branchless = compiling.Branchy(), compiling.Branchless()
    branchless.load_state_dict(branchy.state_dict())
    for scale in (0.01, 10.0):  # both sides of the branch
        x = torch.randn(8, 16) * scale
        assert torch.equal(branchy(x), branchless(x))


def test_aot_eager_is_bitwise_eager_and_the_first_call_compiles():
    cost = compiling.compile_cost("aot_eager", steps=3, layers=1)
    assert cost["output_gap"] == 0.0 and cost["grad_gap"] == 0.0
    assert cost["compiled"]["graphs after each call"] == [1, 1, 1]  # compiled in the first call, reused after
    assert cost["eager"]["graphs after each call"] == [0, 0, 0]


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        compiling.compile_cost("tensorrt")


@pytest.mark.slow
def test_inductor_second_compile_hits_the_disk_cache():
    compiling.inductor_compile()
    again = compiling.inductor_compile()
    assert again["cache hits"] == 1 and again["cache misses"] == 0
    numerics.assert_close(again["output"], again["eager output"], terms=1)  # element-wise: no sums


@pytest.mark.slow
def test_compiled_ddp_has_one_graph_per_bucket_and_trains_as_eager():
    eager = distcourse.launch(compiling.ddp_train, world_size=2, kwargs={"compiled": False}, quiet=True)
    small = distcourse.launch(compiling.ddp_train, world_size=2, kwargs={"bucket_cap_mb": 1.0}, quiet=True)
    assert small[0]["losses"] == small[1]["losses"] == eager[0]["losses"]
    assert small[0]["graphs"] == small[0]["buckets"] == 3


@pytest.mark.slow
def test_per_block_compile_under_fsdp2_trains_as_eager():
    compiled = distcourse.launch(compiling.fsdp_train, world_size=2, kwargs={"layers": 2, "steps": 2}, quiet=True)
    eager = distcourse.launch(
        compiling.fsdp_train, world_size=2, kwargs={"compiled": False, "layers": 2, "steps": 2}, quiet=True
    )
    assert compiled[0]["losses"] == eager[0]["losses"]
    assert 0 < compiled[0]["graphs"] <= 2


@pytest.mark.slow
def test_per_block_compile_adds_no_graph_for_more_blocks():
    graphs = {
        layers: distcourse.launch(
            compiling.fsdp_train, world_size=2, kwargs={"layers": layers, "steps": 2}, quiet=True
        )[0]["graphs"]
        for layers in (2, 8)
    }
    assert graphs[2] == graphs[8] == 2  # the first block's input needs no gradient, the others' do


@pytest.mark.slow
def test_dynamo_caps_its_first_graph_at_one_mib_whatever_ddps_bucket_size():
    large = distcourse.launch(
        compiling.ddp_train, world_size=2, kwargs={"bucket_cap_mb": 25.0, "steps": 11}, quiet=True
    )
    assert large[0]["buckets"] == 1 and large[0]["graphs"] == 2


def test_clipping_sharded_gradients_uses_the_whole_norm():
    clipped = distcourse.launch(fsdp_training.clip, world_size=2, kwargs={"max_norm": 0.5}, quiet=True)
    single = fsdp_training.reference(world_size=2, max_norm=0.5)
    for rank in clipped:
        assert abs(rank["norm"] - single["norm"]) < 1e-5
        assert rank["collectives"] == {"all-reduce": 1}
        assert all(torch.allclose(rank["grads"][n], single["grads"][n], atol=1e-6) for n in single["grads"])


@pytest.mark.parametrize("sync", ["every", "last", "last, unsharded"])
def test_accumulation_gives_the_large_batch_gradient(sync):
    result = distcourse.launch(
        fsdp_training.accumulate, world_size=2, kwargs={"sync": sync, "micro_batches": 3}, quiet=True
    )
    single = fsdp_training.reference(world_size=2, micro_batches=3)
    assert all(torch.allclose(result[0]["grads"][n], single["grads"][n], atol=1e-6) for n in single["grads"])
    reductions = [c.get("reduce-scatter", 0) for c in result[0]["collectives"]]
    assert reductions == ([3, 3, 3] if sync == "every" else [0, 0, 3])


def test_unknown_sync_mode_is_refused():
    with pytest.raises(distcourse.RankFailed, match="sync must be one of"):
        distcourse.launch(fsdp_training.accumulate, world_size=2, kwargs={"sync": "never"}, quiet=True)


def test_reshard_after_forward_trades_an_all_gather_for_held_weights():
    on = distcourse.launch(fsdp_training.reshard, world_size=2, kwargs={"reshard_after_forward": True}, quiet=True)[0]
    off = distcourse.launch(fsdp_training.reshard, world_size=2, kwargs={"reshard_after_forward": False}, quiet=True)[0]
    assert on["forward"] == off["forward"] == {"all-gather": 3}
    assert on["backward"] == {"all-gather": 3, "reduce-scatter": 3} and off["backward"] == {"reduce-scatter": 3}
    assert off["bytes held after forward"] == 2 * on["bytes held after forward"] == on["full model bytes"]


@pytest.mark.skipif(distcourse.gpu_count() > 0, reason="pinning works where a GPU is present")
def test_cpu_offload_pinned_memory_needs_a_gpu_and_unpinned_trains():
    pinned = distcourse.launch(fsdp_training.offload, world_size=2, kwargs={"pin_memory": True}, quiet=True)[0]
    assert pinned["error"] is not None
    if torch.version.cuda is None and torch.version.hip is None:  # a CUDA build says "Found no NVIDIA driver"
        assert "Cannot access accelerator device" in pinned["error"]
    unpinned = distcourse.launch(fsdp_training.offload, world_size=2, kwargs={"pin_memory": False}, quiet=True)[0]
    assert unpinned["error"] is None and unpinned["shard device"] == "cpu" and len(unpinned["losses"]) == 3


def _right(layers, micro_batches, sync, reshard_after_forward):
    gathers = micro_batches * layers * (2 if reshard_after_forward else 1)
    return {"all-gather": gathers, "reduce-scatter": layers * (micro_batches if sync == "every" else 1)}


def test_collectives_exercise_accepts_the_rule_and_rejects_a_wrong_one(capsys):
    assert ch09.check_collectives(_right) is True
    wrong = lambda *args: {**_right(*args), "reduce-scatter": 1}  # noqa: E731
    assert ch09.check_collectives(wrong) is False
    assert "measured" in capsys.readouterr().out
    assert ch09.check_collectives(lambda *args: None) is False


def test_padded_batches_have_the_stated_numbers_of_valid_targets():
    counts = [
        [int((fsdp_training.padded_batch(r, 2, i)[1] != fsdp_training.IGNORE).sum()) for i in range(2)]
        for r in range(2)
    ]
    assert counts == [[32, 32], [8, 16]]
    assert fsdp_training.token_reference(world_size=2)["tokens"] == 88


@pytest.mark.numerics
def test_per_token_loss_equals_one_process_and_the_mean_of_means_does_not():
    runs = distcourse.launch(fsdp_training.token_mean, world_size=2, kwargs={"micro_batches": 2}, quiet=True)
    single = fsdp_training.token_reference(world_size=2, micro_batches=2)
    assert runs[0]["losses"] == runs[1]["losses"] and runs[0]["tokens"] == single["tokens"]
    numerics.assert_close(runs[0]["grads"]["per token"], single["grads"], terms=2 * 64)
    numerics.assert_close(runs[0]["losses"]["per token"], single["loss"], terms=2 * 64)
    assert numerics.relative_gap(runs[0]["grads"]["mean of means"], single["grads"]) > 0.1
    assert {fsdp_training.label(k) for k in runs[0]["grads"]} == {"mean of each rank's mean", "mean over all tokens"}


@pytest.mark.numerics
def test_gradient_divide_factor_is_per_module_and_the_loop_matches_one_process():
    run = distcourse.launch(fsdp_training.divide_factor, world_size=2, quiet=True)[0]
    single = fsdp_training.token_reference(world_size=2, micro_batches=2)
    root_owns = run["root owns"]
    blocks = [n for n in single["grads"] if n not in root_owns]
    assert root_owns == ["4.weight", "4.bias"] and blocks
    numerics.assert_close(run["grads"]["every module"], single["grads"], terms=2 * 64)
    root_only = run["grads"]["root only"]
    numerics.assert_close({n: root_only[n] for n in root_owns}, {n: single["grads"][n] for n in root_owns}, terms=128)
    numerics.assert_close({n: 2 * root_only[n] for n in blocks}, {n: single["grads"][n] for n in blocks}, terms=128)


def test_forward_prefetch_issues_all_gathers_earlier_not_more_and_the_root_stays_gathered():
    run = distcourse.launch(fsdp_training.forward_prefetch, world_size=2, quiet=True)[0]
    assert run["issued"] == {0: [1, 2, 3, 4], 1: [2, 2, 3, 4], 2: [3, 3, 3, 4]}
    assert len(set(run["losses"].values())) == 1
    assert run["gathered after forward"] == [False, False, True]


# ---------------------------------------------------------------- float8
def test_float8_formats_bound_rounding_by_their_mantissa_bits():
    e4m3, e5m2 = (float8.format_facts(d) for d in float8.FORMATS.values())
    assert (e4m3["mantissa bits"], e4m3["rel"], e4m3["max"]) == (3, 2**-4, 448.0)
    assert (e5m2["mantissa bits"], e5m2["rel"], e5m2["max"]) == (2, 2**-3, 57344.0)
    assert e4m3["half_subnormal"] == 2**-10 and e5m2["half_subnormal"] == 2**-17


def test_every_cast_stays_within_the_formats_bound_and_rowwise_ignores_the_outliers():
    table = float8.compare()
    assert all(r["within bound everywhere"] and r["error"] <= r["bound"] for r in table.values())
    assert all(r["error"] >= r["flushed"] for r in table.values())
    rowwise = {r["error"] for (_, name, g), r in table.items() if name == "e4m3" and g == "rowwise"}
    assert len(rowwise) == 1
    big = max(o for o, _, _ in table)
    assert table[(big, "e4m3", "tensorwise")]["flushed"] > table[(big, "e4m3", "rowwise")]["bound"]


def test_power_of_two_scales_keep_the_amax_within_the_format():
    x = torch.tensor([[3.0, -1000.0], [0.25, 0.5]])
    for dtype in float8.FORMATS.values():
        for granularity in float8.GRANULARITIES:
            scale = float8.scale_for(float8.amax(x, granularity), dtype)
            scaled = float8.amax(x, granularity) * scale
            assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))
            largest = float8.format_facts(dtype)["max"]
            assert torch.all(scaled <= largest) and torch.all(scaled > largest / 2)
    with pytest.raises(ValueError, match="granularity"):
        float8.amax(x, "blockwise")


def test_float8_recipes_follow_the_gpu_profile():
    from distcourse.runtime import gpus

    assert float8.recipes(None) == ()
    for profile in gpus.PROFILES.values():
        expected = float8.RECIPES if profile.capability >= float8.FP8_CAPABILITY else ()
        assert float8.recipes(profile) == expected, profile.key
    assert float8.recipes(gpus.PROFILES["H100-SXM"]) and not float8.recipes(gpus.PROFILES["A100-80GB-SXM"])


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_torchao_float8_linear_emulated_on_cpu_stays_within_the_bound(recipe):
    pytest.importorskip("torchao")
    run = float8.float8_linear(recipe, device="cpu", emulate=True)
    assert run["module"] == "Float8Linear" and run["weight dtype"] == "torch.bfloat16"
    assert run["within bound"] and run["grads finite"] and 0 < run["relative gap"]
