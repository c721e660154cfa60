"""Chapter 10, FSDP2 with tensor parallelism in practice: torchtitan's order of the wrappers, the
root module, gradient clipping across meshes, each against one process (4 ranks, dp = 2 x tp = 2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distcourse
from distcourse import meshes, tp_fsdp
from distcourse import tensor_parallel as tp
from distcourse.common import numerics

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # 4 ranks each

TERMS = tp.loss_terms(batch=tp_fsdp.BATCH)


@pytest.fixture(scope="module")
def reference():
    return tp_fsdp.reference()


@pytest.fixture(scope="module")
def practice():
    return distcourse.launch(tp_fsdp.practice, world_size=4, quiet=True)


def params(reference) -> int:
    return sum(p.numel() for p in reference["params"].values())


def test_the_recipe_trains_like_one_process(practice, reference):
    for rank in practice:
        r = rank["train"]
        numerics.assert_close(r["losses"], reference["losses"], terms=TERMS, what="losses")
        numerics.assert_close(r["grads"], reference["grads"], terms=TERMS, what="gradients")
        numerics.assert_close(r["norms"], reference["norms"], terms=TERMS + params(reference), what="norms")
        numerics.assert_close(r["params"], reference["params"], terms=TERMS + params(reference), what="params")
        assert r["meshes"] == [("dp", "tp")]
    assert min(reference["norms"]) > tp_fsdp.MAX_NORM  # the clipping is exercised, not a no-op


def test_checkpointing_reruns_three_tp_collectives_per_layer(practice):
    with_checkpoints, without = practice[0]["train"]["collectives"], practice[0]["no checkpointing"]["collectives"]
    layers = tp.SIZES["layers"]
    assert with_checkpoints["tp"]["all-gather"] - without["tp"]["all-gather"] == 2 * layers
    assert with_checkpoints["tp"]["reduce-scatter"] - without["tp"]["reduce-scatter"] == layers
    assert meshes.tp_collectives_per_layer(recompute=True) - meshes.tp_collectives_per_layer() == 3
    assert with_checkpoints["dp"] == without["dp"]


def test_without_the_root_each_dp_row_keeps_its_own_gradient(practice, reference):
    rows = {r["no root"]["dp"]: r["no root"]["grads"] for r in practice}
    assert sorted(rows) == [0, 1]
    right = {n: reference["grads"][n] for n in tp_fsdp.ROOT_PARAMS}
    for grads in rows.values():
        assert not numerics.close(grads, right, terms=TERMS)
    mean = {n: (rows[0][n] + rows[1][n]) / 2 for n in tp_fsdp.ROOT_PARAMS}
    numerics.assert_close(mean, right, terms=TERMS, what="mean of the rows")
    assert "same mesh" in practice[0]["no root"]["clip error"]


def test_clipping_over_two_meshes(practice, reference):
    two = practice[0]["two meshes"]
    assert two["meshes"] == [("dp",), ("dp", "tp")]
    assert "same mesh" in two["clip error"]  # torch's clip_grad_norm_ refuses
    numerics.assert_close(two["norm"], reference["norms"][0], terms=TERMS + params(reference))
    numerics.assert_close(two["clipped grads"], reference["clipped"], terms=TERMS + params(reference))


def test_compiled_blocks_train_like_one_process(reference):
    """The page leaves compile out (seconds per block on a CPU); here each checkpointed block is
    compiled (``aot_eager``, no code generation) before ``fully_shard``, torchtitan's order."""
    r = distcourse.launch(tp_fsdp.train, world_size=4, kwargs={"compile_backend": "aot_eager"}, quiet=True)[0]
    numerics.assert_close(r["losses"], reference["losses"], terms=TERMS, what="losses")
    numerics.assert_close(r["params"], reference["params"], terms=TERMS + params(reference), what="params")


def test_clip_grad_norm_without_distribution_is_torchs():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 4)
    a(x).square().sum().backward()
    b(x).square().sum().backward()
    expected = nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    numerics.assert_close(tp_fsdp.clip_grad_norm(b.parameters(), 0.1), expected, terms=15)
    numerics.assert_close([p.grad for p in b.parameters()], [p.grad for p in a.parameters()], terms=15)


def test_plain_names_drop_the_wrappers():
    assert (
        tp_fsdp.plain_name("layers.0._checkpoint_wrapped_module.attention.wq.weight") == "layers.0.attention.wq.weight"
    )
    assert tp_fsdp.plain_name("layers.1._orig_mod.ffn_norm.bias") == "layers.1.ffn_norm.bias"


def test_an_odd_world_is_refused():
    with pytest.raises(distcourse.RankFailed, match="even number of ranks"):
        distcourse.launch(tp_fsdp.variants, world_size=3, quiet=True, timeout=120)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_combines_meshes_for_every_norm_type(norm_type):
    """Gradients on two meshes and a plain tensor: the combined norm is torch's norm of all of them
    (for inf the maximum of the per-mesh maxima, not their sum), and the clipped gradients agree."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from distcourse.common.distributed import pretend_ranks

    torch.manual_seed(0)
    grads = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2) * 3]
    plain = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(plain, grads):
        p.grad = g.clone()
    expected = nn.utils.clip_grad_norm_(plain, 0.1, norm_type=norm_type)
    with pretend_ranks(1):  # one rank: the all-reduces of full_tensor() change nothing
        first = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        second = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        mixed = []
        for mesh, g in zip((first, second, None), grads):
            value = g.clone() if mesh is None else distribute_tensor(g.clone(), mesh, [Replicate()])
            p = nn.Parameter(torch.zeros_like(value))
            p.grad = value
            mixed.append(p)
        total = tp_fsdp.clip_grad_norm(mixed, 0.1, norm_type=norm_type)
        clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in mixed]
    numerics.assert_close(total, expected, terms=20)
    numerics.assert_close(clipped, [p.grad for p in plain], terms=20)
    if norm_type == float("inf"):
        assert total == max(g.abs().max() for g in grads)  # a maximum, exactly
