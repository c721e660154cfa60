"""Chapter 13, pipeline schedules in practice: the bubble formula and the order-based simulation,
activation counts, FSDP2's all-gathers inside a pipeline, and clipping over the pp group, each
against one process."""

from __future__ import annotations

import pytest
import torch

import distcourse
from distcourse import model_parallel
from distcourse import pipeline_schedules as ps
from distcourse.common import numerics
from distcourse.common.models import gpt

TERMS = ps.loss_terms()


def _gpipe(p: int, m: int) -> list[list[tuple]]:
    return [[(kind, s, i) for kind, i in model_parallel.gpipe_order(s, p, m)] for s in range(p)]


def test_bubble_formula():
    assert ps.predicted_bubble(2, 4) == pytest.approx(1 / 5)
    assert ps.predicted_bubble(4, 8) == pytest.approx(3 / 11)
    assert ps.predicted_bubble(2, 4, v=2) == pytest.approx(1 / 9)  # interleaving shrinks the fill and drain v times
    assert ps.predicted_bubble(1, 8) == 0
    for p, m in ((2, 4), (3, 6), (4, 16)):
        assert ps.predicted_bubble(p, m) == pytest.approx(model_parallel.predicted_bubble(p, m))
    with pytest.raises(ValueError):
        ps.predicted_bubble(2, 0)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8)])
def test_simulated_gpipe_and_1f1b_have_the_formulas_bubble(p, m):
    for orders in (_gpipe(p, m), [ps.one_f_one_b_order(s, p, m) for s in range(p)]):
        assert ps.bubble(ps.simulate(orders)) == pytest.approx([ps.predicted_bubble(p, m)] * p)


def test_simulate_refuses_orders_that_wait_on_each_other():
    orders = [[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]]  # stage 0's backward before its forward
    with pytest.raises(ValueError, match="wait on each other"):
        ps.simulate(orders)


def test_peak_live_counts_held_micro_batches():
    p, m = 4, 8
    assert [ps.peak_live(o) for o in _gpipe(p, m)] == [{s: m} for s in range(p)]
    assert [ps.peak_live(ps.one_f_one_b_order(s, p, m)) for s in range(p)] == [{s: p - s} for s in range(p)]
    split = [("F", 1, 0), ("F", 1, 1), ("I", 1, 0), ("I", 1, 1), ("W", 1, 0), ("W", 1, 1)]
    assert ps.peak_live(split) == {1: 2}  # an I frees nothing: W still needs the inputs
    assert ps.peak_held([("F", 0, 0), ("F", 2, 0), ("B", 2, 0), ("B", 0, 0)], v=2) == 1.0


def test_all_gathers_of_an_fsdp_unit_in_a_pipeline():
    stage0 = ps.one_f_one_b_order(0, 2, 4)
    stage1 = ps.one_f_one_b_order(1, 2, 4)
    assert [ps.predicted_all_gathers(o, True) for o in (stage0, stage1)] == [5, 5]
    assert [ps.predicted_all_gathers(o, False) for o in (stage0, stage1)] == [1, 1]
    assert ps.predicted_all_gathers(_gpipe(2, 4)[0], True) == 4 + 1  # every forward, then the first backward


def test_hand_split_is_the_whole_model():
    model = gpt(**ps.SIZES)
    inputs, _ = ps.tokens()
    for n in (2, 4, 8):
        stages = ps.split(model, n)
        names = [name for stage in stages for name, _ in stage.named_parameters()]
        assert sorted(names) == sorted(name for name, _ in model.named_parameters())
        x = inputs
        for stage in stages:
            x = stage(x)
        assert torch.equal(x, model(inputs))  # the same modules in the same order
    with pytest.raises(ValueError):
        ps.split(model, 3)
    assert ps.stage_indices(1, p=4, v=2) == [1, 5]


def test_traced_split():
    traced = ps.traced_split(4)
    assert traced["stages"] == 2 and traced["gap"] == 0.0
    assert traced["names"][0][0] == "tok_embeddings.weight" and traced["names"][1][-1] == "output.weight"
    assert {n.split(".")[1] for n in traced["names"][1] if n.startswith("layers.")} == {"4", "5", "6", "7"}


@pytest.mark.slow
def test_four_schedules_on_two_ranks_train_like_one_process():
    run = distcourse.launch(ps.schedule_sweep, world_size=2, args=(list(ps.SCHEDULES), 4), quiet=True)
    reference = ps.reference()
    for name, (_, v) in ps.SCHEDULES.items():
        ranks = [r[name] for r in run]
        grads = {k: g for r in ranks for k, g in r["grads"].items()}
        numerics.assert_close(grads, reference["grads"], terms=TERMS, what=name)
        losses = [loss for r in ranks for loss in r["losses"]]
        numerics.assert_close(sum(losses) / 4, reference["loss"], terms=TERMS, what=name)
        simulated = ps.bubble(ps.simulate(ps.orders(ranks)))
        if name == "InterleavedZeroBubble":
            assert max(simulated) < ps.predicted_bubble(2, 4, v)
        else:
            assert simulated == pytest.approx([ps.predicted_bubble(2, 4, v)] * 2)


@pytest.fixture(scope="module")
def pp_fsdp():
    return distcourse.launch(ps.pp_fsdp_step, world_size=4, quiet=True)


@pytest.mark.slow
def test_clipping_over_the_pp_group_is_one_process(pp_fsdp):
    """Fails if ``clip_grad_norm_pp`` stops combining the stages' norms."""
    reference = ps.reference()
    params = sum(p.numel() for p in reference["params"].values())
    assert reference["norm"] > ps.MAX_NORM  # clipping is exercised
    for key, expected in (("grads", "grads"), ("clipped", "clipped"), ("params", "params")):
        got = {k: g for r in pp_fsdp for k, g in r[key].items()}
        numerics.assert_close(got, reference[expected], terms=TERMS + params, what=key)
    for r in pp_fsdp:
        numerics.assert_close(r["norm"], reference["norm"], terms=TERMS + params, what="norm")
        assert r["clip_error"] is None  # torch's clip_grad_norm_ raises nothing...
        assert r["stage_norm"] < reference["norm"]  # ...and saw this stage only
    naive = {k: g for r in pp_fsdp for k, g in r["naive_clipped"].items()}
    assert not numerics.close(naive, reference["clipped"], terms=TERMS + params)


@pytest.mark.slow
def test_fsdp_collectives_in_a_pipeline(pp_fsdp):
    for r in pp_fsdp:
        for key, reshard in (("reshard", True), ("keep", False)):
            step = r[key]
            order = [e[:3] for e in step["events"]]
            expected = step["units"] * ps.predicted_all_gathers(order, reshard)
            assert step["collectives"] == {"all-gather": expected, "reduce-scatter": step["units"]}
            assert all(e[5]["reduce-scatter"] == 0 for e in step["events"])  # none before the last backward ended
