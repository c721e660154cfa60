"""Chapter 13, experts and layouts: top-k routing, capacity and the load-balancing loss against
hand computations; expert parallelism on 4 ranks against one process (slow); the layout chooser
on a dense and an MoE model; a dry run on the fake process group against the traffic formulas."""

from __future__ import annotations

import math

import pytest
import torch

import distcourse
from distcourse import experts, layouts, meshes
from distcourse.common import numerics


def test_capacity_is_the_gshard_formula():
    assert experts.capacity(32, 8, 2, 1.25) == 10  # ceil(1.25 · 32 · 2 / 8)
    assert experts.capacity(256, 8, 2, 1.0) == 64
    assert experts.capacity(10, 4, 1, 1.0) == 3  # rounded up
    assert experts.capacity(32, 8, 2, None) is None


def test_route_keeps_the_first_tokens_of_each_expert():
    logits = torch.zeros(6, 4)
    logits[:, 2] = 5.0  # every token's first choice: expert 2
    logits[:, 1] = 3.0  # second choice: expert 1
    r = experts.route(logits, top_k=2, slots=4)
    assert r["load"].tolist() == [0, 6, 6, 0]
    assert r["keep"].tolist() == [[True, True]] * 4 + [[False, False]] * 2  # tokens 4 and 5 come too late
    assert experts.dropped(r["load"], 4) == 4 == int((~r["keep"]).sum())
    numerics.assert_close(r["weights"].sum(-1), torch.ones(6), terms=2)


def test_dropped_counts_match_the_keep_mask_on_random_routings():
    g = torch.Generator().manual_seed(0)
    for factor in (0.5, 1.0, 1.25, 2.0):
        logits = torch.randn(64, 8, generator=g) * 3
        slots = experts.capacity(64, 8, 2, factor)
        r = experts.route(logits, top_k=2, slots=slots)
        assert experts.dropped(r["load"], slots) == int((~r["keep"]).sum())
        kept_per_expert = torch.bincount(r["chosen"][r["keep"]], minlength=8)
        assert kept_per_expert.max() <= slots and torch.equal(kept_per_expert, r["load"].clamp(max=slots))


def test_aux_loss_is_alpha_when_balanced_and_grows_with_skew():
    tokens, e, k = 8, 4, 1
    uniform = torch.full((e,), tokens / e)
    numerics.assert_close(experts.aux_loss(uniform, uniform, tokens, k, alpha=0.01), 0.01, terms=e)
    # everything on expert 0, with probability 1: alpha · E · 1 · 1
    load, probs = torch.tensor([8.0, 0, 0, 0]), torch.tensor([8.0, 0, 0, 0])
    numerics.assert_close(experts.aux_loss(load, probs, tokens, k, alpha=0.01), 0.04, terms=e)
    # a hand computation of Switch's eq. 4: f = (0.5, 0.5, 0, 0), P = (0.25, 0.5, 0.125, 0.125)
    load, probs = torch.tensor([4.0, 4, 0, 0]), torch.tensor([2.0, 4, 1, 1])
    numerics.assert_close(experts.aux_loss(load, probs, tokens, k, alpha=1.0), 4 * (0.5 * 0.25 + 0.5 * 0.5), terms=e)
    # top-2: f counts each token's 2 choices (sum 8), P the mean probability: f = P = (0.5, 0.25, 0.25, 0)
    load, probs = torch.tensor([4.0, 2, 2, 0]), torch.tensor([2.0, 1, 1, 0])
    numerics.assert_close(experts.aux_loss(load, probs, 4, 2, alpha=1.0), 4 * (0.25 + 0.0625 + 0.0625), terms=e)


def test_reference_routes_each_group_with_its_own_capacity():
    ref = experts.reference()
    slots = experts.capacity(experts.TOKENS, 8, 2, experts.CAPACITY_FACTOR)
    assert ref["slots"] == slots == 10
    assert ref["kept"].max() <= slots  # no group sends an expert more than its slots
    assert int(ref["load"].sum()) == experts.WORLD * experts.TOKENS * 2
    assert ref["dropped"] == int(ref["load"].sum() - ref["kept"].sum()) > 0
    unlimited = experts.reference(factor=None)
    assert unlimited["dropped"] == 0 and torch.equal(unlimited["kept"].sum(0), unlimited["load"])


def test_expected_bytes_of_an_even_routing_equal_the_uniform_formula():
    kept = torch.full((4, 8), 16)  # every group sends every expert 16 rows: 32 tokens · top-2 / ... · 4 groups
    for rank in range(4):
        assert experts.expected_bytes(kept, rank)["step"] == experts.uniform_bytes(64, 2, 4, 16)


@pytest.mark.slow
def test_expert_parallel_step_equals_one_process():
    ref = experts.reference()
    runs = distcourse.launch(experts.ep_all, world_size=4, quiet=True)
    terms = experts.loss_terms()
    for rank, r in enumerate(runs):
        s = r["step"]
        numerics.assert_close(s["logits"], ref["logits"].split(experts.TOKENS)[rank], terms=terms, what="logits")
        numerics.assert_close([s["task"], s["aux"]], [ref["task"], ref["aux"]], terms=terms, what="losses")
        numerics.assert_close(s["grads"], {n: ref["grads"][n] for n in s["grads"]}, terms=terms, what="dense grads")
        a, b = s["experts"]
        expected = {"w1": ref["grads"]["w1"][a:b], "w2": ref["grads"]["w2"][a:b]}
        numerics.assert_close(s["expert grads"], expected, terms=terms, what="expert grads")
        assert s["token bytes"] == experts.expected_bytes(ref["kept"], rank)["step"]
    assert sum(r["step"]["dropped"] for r in runs) == ref["dropped"]
    biased = [r["imbalance"]["runs"][("biased", experts.CAPACITY_FACTOR)] for r in runs]
    tokens = runs[0]["imbalance"]["tokens"]
    for run in biased:
        assert run["sent per expert"][0] == run["slots"] == experts.capacity(tokens, 8, 2, experts.CAPACITY_FACTOR)
        assert run["dropped"] >= tokens - run["slots"]
    unlimited = [r["imbalance"]["runs"][("biased", None)] for r in runs]
    assert unlimited[0]["received per expert"][0] == 4 * tokens  # every token's first choice


def test_memory_states_are_sixteen_bytes_per_parameter_over_all_gpus():
    model = layouts.MODELS["DeepSeek-V3"]
    layout = {"pp": 16, "dp": 128, "tp": 1, "ep": 64}
    numerics.assert_close(layouts.memory(model, layout)["states"], 16 * model["params"] / 2048, terms=4)
    # with pp, the whole stage stays gathered: expert weights divided by ep
    stage = model["expert_params"] / 16 / 64 + (model["params"] - model["expert_params"]) / 16
    numerics.assert_close(layouts.memory(model, layout)["gathered"], 2 * stage, terms=4)


def test_traffic_without_pp_and_ep_is_chapter_10s_volume():
    model = layouts.MODELS["Llama 3 70B"]
    sizes = dict(params=model["params"], layers=model["layers"], hidden=model["hidden"], recompute=True)
    for layout, name in (
        ({"pp": 1, "dp": 4, "tp": 8, "ep": 1}, "tp+fsdp"),
        ({"pp": 1, "dp": 32, "tp": 1, "ep": 1}, "fsdp"),
    ):
        tokens = layouts.microbatches(model, layout) * model["seq"]
        volume = meshes.volume(name, **sizes, tokens=tokens, gpus_per_node=8, nodes=4)
        ours = layouts.traffic(model, layout)
        assert math.isclose(ours["tp"], volume["inside"], rel_tol=1e-12)
        assert math.isclose(ours["dp"], volume["between"], rel_tol=1e-12)


def test_choose_a_dense_model():
    model, cluster = layouts.MODELS["Llama 3 70B"], layouts.CLUSTERS["H100"]
    assert layouts.choose(model, cluster, 1)["layout"] is None  # 16 · 70.6e9 / 8 GPUs > 80 GB
    pick = layouts.choose(model, cluster, 8)
    layout = pick["layout"]
    assert layout["ep"] == 1 and layout["pp"] * layout["dp"] * layout["tp"] == 64
    assert pick["best"]["memory"]["total"] <= cluster["memory"]
    assert all(r["total"] >= pick["best"]["total"] - 1e-3 for r in pick["rows"] if r["fits"])


def test_choose_an_moe_model():
    model, cluster = layouts.MODELS["DeepSeek-V3"], layouts.CLUSTERS["H800"]
    assert layouts.choose(model, cluster, 8)["layout"] is None  # 16 · 671e9 / 64 GPUs > 80 GB
    layout = layouts.choose(model, cluster, 256)["layout"]
    assert (layout["pp"], layout["dp"], layout["tp"]) == (16, 128, 1)  # the report's PP 16, no TP
    assert layout["ep"] > 1 and layout["ep"] * layout["tp"] <= 8  # exposed all-to-all: EP inside a node
    hidden = layouts.choose(model, cluster, 256, overlap=("ep",))["layout"]
    assert hidden["ep"] > layout["ep"]  # all-to-all hidden behind compute: more experts per group


@pytest.mark.parametrize(
    "model, layout",
    [
        ("Llama 3 70B", {"pp": 2, "dp": 16, "tp": 2, "ep": 1}),
        ("DeepSeek-V3", {"pp": 4, "dp": 8, "tp": 2, "ep": 4}),
    ],
)
def test_dry_run_counts_what_the_formulas_say(model, layout):
    run = layouts.dry_run(layouts.MODELS[model], layout)
    assert run["world"] == 64
    formula = layouts.traffic(run["standin"], layout, recompute=False, bytes_=4, sublayers=1)
    counted = {dim: c["bytes"] for dim, c in run["counted"].items()}
    assert set(counted) == {dim for dim, b in formula.items() if b > 0}
    for dim, sent in counted.items():
        assert math.isclose(sent, formula[dim], rel_tol=1e-12), (dim, sent, formula[dim])
    m = layouts.microbatches(run["standin"], layout)
    assert run["counted"]["dp"]["calls"] == 2  # with pp: one all-gather and one reduce-scatter per step
    assert run["counted"]["tp"]["calls"] == 4 * m  # per block and micro-batch: all-gather, reduce-scatter, twice


@pytest.mark.slow
def test_dry_run_at_512_ranks():
    layout = {"pp": 16, "dp": 32, "tp": 1, "ep": 2}
    run = layouts.dry_run(layouts.MODELS["DeepSeek-V3"], layout)
    assert run["world"] == 512
    formula = layouts.traffic(run["standin"], layout, recompute=False, bytes_=4, sublayers=1)
    for dim, c in run["counted"].items():
        assert math.isclose(c["bytes"], formula[dim], rel_tol=1e-12), dim
    assert run["counted"]["ep"]["calls"] == 4 * layouts.microbatches(run["standin"], layout)
