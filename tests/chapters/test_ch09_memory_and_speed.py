"""Chapter 09: number formats, autocast, loss scaling, activation counting, checkpointing, calculator."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

import distcourse
from distcourse import activations, mixed_precision
from distcourse.common import numerics
from distcourse.exercises import ch09


def test_formats_come_from_finfo():
    table = mixed_precision.format_table()
    assert table["fp16"]["max"] == 65504 and table["fp16"]["eps"] == 2**-10
    assert table["bf16"]["exponent_bits"] == 8 and table["bf16"]["mantissa_bits"] == 7
    assert all(1 + f["exponent_bits"] + f["mantissa_bits"] == f["bits"] for f in table.values())


def test_underflow_and_scaling():
    values = mixed_precision.underflow(gradient=2e-8, scale=65536.0)
    assert values["fp16"] == 0.0 and values["bf16"] == pytest.approx(2e-8, rel=1e-2)
    assert values["fp16, scaled then unscaled in fp32"] == pytest.approx(2e-8, rel=1e-3)
    # a gradient that fp16 can hold needs no scaling: the demonstration is about the small ones
    assert mixed_precision.underflow(gradient=1e-3)["fp16"] == pytest.approx(1e-3, rel=1e-3)


def test_grad_scaler_skips_a_step_with_inf():
    result = mixed_precision.scaler_skips_inf("cpu", init_scale=256.0)
    assert result == {"weight unchanged": True, "scale before": 256.0, "scale after": 128.0}


def test_autocast_keeps_parameters_and_loss_in_fp32():
    dtypes = mixed_precision.autocast_dtypes("cpu", torch.bfloat16)
    assert dtypes["linear"] == dtypes["matmul"] == torch.bfloat16
    assert dtypes["cross_entropy"] == dtypes["weight (parameter)"] == dtypes["weight.grad"] == torch.float32


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        mixed_precision.ddp_train("fp8")


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("shape", [(1, 8, 16, 2), (3, 24, 48, 6), (2, 40, 32, 4)])
def test_block_formula_is_exact(shape, attention):
    assert activations.measure_block(*shape, attention=attention) == activations.block_formula(*shape, attention)


def test_saved_bytes_leaves_parameters_out_and_counts_each_block_once():
    weight = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    # x @ weight keeps x and weight; x is counted once although two products keep it
    counted, _ = activations.saved_bytes(lambda: (x @ weight) + (x @ weight), [weight])
    assert counted == x.numel() * 4


def test_ring_sum_in_bf16_loses_digits_that_fp32_keeps():
    summed = mixed_precision.ring_sum(ranks=256, size=1024)
    u = numerics.unit_roundoff(torch.bfloat16)
    assert summed["gaps"]["exact sum, rounded once to bf16"] <= u
    assert summed["gaps"]["summed in bf16"] > 4 * u
    numerics.assert_close(summed["sums"]["summed in fp32"], summed["exact"], terms=256)
    assert all(mixed_precision.label(how) for how in summed["gaps"])


def test_matmul_precision_switches_are_read_back_and_restored():
    before = torch.get_float32_matmul_precision()
    switches = {p: mixed_precision.precision_switches(p) for p in ("highest", "high", "medium")}
    assert [s["torch.backends.cuda.matmul.allow_tf32"] for s in switches.values()] == [False, True, True]
    assert switches["medium"]["torch.backends.mkldnn.matmul.fp32_precision"] == "bf16"
    assert all(s["torch.backends.cudnn.allow_tf32"] for s in switches.values())  # convolutions: TF32 by default
    products = mixed_precision.matmul_precision("cpu", size=64, repeats=1)
    assert products["fp32, highest"]["dtype"] == products["fp32, high"]["dtype"] == torch.float32
    assert products["bf16"]["gap"] > products["fp32, highest"]["gap"]  # 8 mantissa bits against 24
    assert torch.get_float32_matmul_precision() == before
    with pytest.raises(RuntimeError), mixed_precision.float32_matmul_precision("highest"):
        raise RuntimeError("restored even when the block fails")
    assert torch.get_float32_matmul_precision() == before


def test_checkpointing_modes():
    modes = {
        mode: activations.forward_backward(mode, batch=2, seq=16, hidden=32, layers=2, repeats=1)
        for mode in activations.MODES
    }
    assert modes["full"]["saved"] == 2 * 2 * 16 * 32 * 4
    assert modes["none"]["saved"] == 2 * activations.block_formula(2, 16, 32, 4)
    assert modes["full"]["saved"] < modes["selective"]["saved"] < modes["none"]["saved"]
    assert modes["none"]["forward_matmuls"] == 2 * 6  # qkv, scores, weighted sum, proj, fc1, fc2 per block
    assert (
        modes["selective"]["backward_matmuls"] == modes["none"]["backward_matmuls"] < modes["full"]["backward_matmuls"]
    )
    for mode in ("full", "selective"):
        assert all(torch.equal(modes[mode]["grads"][k], g) for k, g in modes["none"]["grads"].items())
    with pytest.raises(ValueError, match="mode must be one of"):
        activations.run_blocks(activations.transformer(32, 4, 1), torch.randn(1, 4, 32), "sometimes")


def test_model_state_bytes_after_adam_step():
    model = activations.transformer(hidden=32, heads=4, layers=1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 4, 32)).sum().backward()
    optimizer.step()
    psi = sum(p.numel() for p in model.parameters())
    assert activations.model_state_bytes(model, optimizer) == {
        "params": 4 * psi,
        "grads": 4 * psi,
        "optimizer": 8 * psi,
    }


CALCULATOR_CASES = [
    dict(layers=32, hidden=4096, heads=32, batch=1, seq=4096, ranks=8, stage=3, flash=True, checkpoint=False),
    dict(layers=2, hidden=64, heads=4, batch=8, seq=64, ranks=1, stage=0, flash=False, checkpoint=True),
    dict(layers=80, hidden=8192, heads=64, batch=2, seq=2048, ranks=64, stage=1, flash=False, checkpoint=False),
    dict(layers=12, hidden=768, heads=12, batch=16, seq=1024, ranks=4, stage=2, flash=True, checkpoint=True),
]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
@pytest.mark.parametrize("layout", sorted(activations.LAYOUTS))
def test_calculator_widget_computes_what_python_computes(layout):
    """The page widget's JavaScript and activations.calculator agree, case by case, for both byte layouts."""
    parts = activations.LAYOUTS[layout]
    bytes_ = {"pbytes": parts["params"], "gbytes": parts["grads"], "obytes": parts["optimizer"], "abytes": 2}
    script = activations.calculator_js() + "\nconst cases = " + json.dumps(CALCULATOR_CASES) + ";\n"
    script += f"console.log(JSON.stringify(cases.map(c => distcourseMemory(Object.assign({json.dumps(bytes_)}, c)))));"
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True).stdout
    for case, js in zip(CALCULATOR_CASES, json.loads(out)):
        py = activations.calculator(**case, layout=layout)
        assert js == pytest.approx(py, rel=1e-12), case


def test_the_two_layouts_agree_at_zero_3_and_differ_at_stages_1_and_2():
    shape = dict(layers=4, hidden=256, heads=4, batch=1, seq=16, ranks=8)
    model = {
        (stage, layout): activations.calculator(**shape, stage=stage, layout=layout)["model"]
        for stage in range(4)
        for layout in activations.LAYOUTS
    }
    params = 12 * 4 * 256 * 256
    assert model[0, "pytorch"] == model[0, "master weights"] == 16 * params
    assert model[3, "pytorch"] == model[3, "master weights"] == 16 * params / 8
    assert model[1, "pytorch"] == 9 * params and model[1, "master weights"] == 5.5 * params  # 4+4+8/8 vs 2+2+12/8
    assert model[2, "pytorch"] == 5.5 * params and model[2, "master weights"] == 3.75 * params
    with pytest.raises(KeyError):
        activations.calculator(**shape, layout="fp8")


def test_calculator_page_holds_the_labels_and_both_layouts():
    keys = ("layers", "hidden", "heads", "batch", "seq", "ranks", "stage", "flash", "checkpoint")
    labels = {k: f"<{k}>" for k in (*keys, "params", "model", "activations", "total")}
    page = activations.calculator_html(labels, language="ru")
    assert "<script>" in page and "distcourseMemory" in page and '"language": "ru"' in page
    assert all(label in page for label in labels.values())
    assert all(activations.layout_label(name) in page for name in activations.LAYOUTS)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_calculator_page_script_runs_and_prints_one_line_per_layout():
    """The page's own script, run against a minimal stand-in for the browser's document."""
    keys = ("layers", "hidden", "heads", "batch", "seq", "ranks", "stage", "flash", "checkpoint")
    page = activations.calculator_html({k: k for k in (*keys, "params", "model", "activations", "total")})
    script = page[page.index("<script>") + len("<script>") : page.index("</script>")]
    values = {"layers": 32, "hidden": 4096, "heads": 32, "batch": 1, "seq": 4096, "ranks": 8, "stage": 1}
    document = (
        "const values = " + json.dumps(values) + "; const out = {};\n"
        "globalThis.document = {getElementById: id => { const k = id.slice(8);"
        " if (k === 'out') return out; if (k === 'flash') return {checked: true};"
        " if (k === 'checkpoint') return {checked: false}; return {value: String(values[k])}; },"
        " querySelectorAll: () => []};\n"
    )
    run = subprocess.run(
        ["node", "-e", document + script + "\nconsole.log(out.textContent);"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 + len(activations.LAYOUTS)
    assert lines[1].startswith(activations.layout_label("pytorch")) and "58.0 GB" in lines[1]  # ZeRO-1: 9 B/param
    assert lines[2].startswith(activations.layout_label("master weights")) and "35.4 GB" in lines[2]  # 5.5 B/param


def test_exercise_check_accepts_the_formula_and_names_what_is_missing(capsys):
    def right(b, s, h, a):
        return 4 * 16 * b * s * h + 16 * b * s + 4 * a * b * s * s + s * s

    assert ch09.check_block_bytes(right) is True
    assert ch09.check_block_bytes(lambda b, s, h, a: right(b, s, h, a) - s * s) is False
    assert "causal mask" in capsys.readouterr().out
    assert ch09.check_block_bytes(lambda b, s, h, a: 4 * 16 * b * s * h + 16 * b * s) is False
    assert "attention scores" in capsys.readouterr().out
    assert ch09.check_block_bytes(lambda b, s, h, a: None) is False


@pytest.mark.slow
def test_mixed_precision_ddp_follows_fp32():
    runs = {
        p: distcourse.launch(mixed_precision.ddp_train, world_size=2, kwargs={"precision": p, "steps": 8}, quiet=True)
        for p in mixed_precision.PRECISIONS
    }
    fp32 = runs["fp32"][0]["losses"]
    assert runs["fp32"][0]["losses"] == runs["fp32"][1]["losses"]  # the global mean: the same on every rank
    for precision in ("bf16", "fp16"):
        assert max(abs(a - b) for a, b in zip(runs[precision][0]["losses"], fp32)) < 1e-2


@pytest.mark.slow
def test_fsdp_policy_dtypes():
    mixed = distcourse.launch(mixed_precision.fsdp_policy, world_size=2, kwargs={"steps": 2}, quiet=True)
    assert mixed[0]["dtypes"]["gathered parameter"] == torch.bfloat16
    assert mixed[0]["dtypes"]["sharded parameter"] == mixed[0]["dtypes"]["sharded gradient"] == torch.float32


@pytest.mark.slow
def test_reduce_dtype_none_reduces_in_bf16():
    """MixedPrecisionPolicy(param_dtype=bf16) alone: reduce_dtype None, gradients reduced in bf16
    (every value of the fp32 sharded gradient is a bf16 number); with reduce_dtype=fp32 they are not."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert MixedPrecisionPolicy(param_dtype=torch.bfloat16).reduce_dtype is None
    policies = {"fp32 reduce": ("bf16", "fp32"), "default reduce": ("bf16", None)}
    runs = distcourse.launch(mixed_precision.fsdp_policies, world_size=2, kwargs={"policies": policies, "steps": 1})
    for rank in runs:
        assert rank["default reduce"]["bf16-exact gradients"] == 1.0
        assert rank["fp32 reduce"]["bf16-exact gradients"] < 1.0
        assert rank["default reduce"]["dtypes"]["sharded gradient"] == torch.float32  # stored as fp32 all the same


def test_memory_estimate_on_fake_tensors_agrees_with_the_counts():
    """FSDPMemTracker on fake tensors and a fake group of 8 ranks, against counts of the real model."""
    import torch.distributed as dist

    layers, hidden, heads, batch, seq, ranks = 2, 32, 4, 4, 16, 8
    estimate = activations.estimate_memory(ranks, layers=layers, hidden=hidden, heads=heads, batch=batch, seq=seq)
    assert not dist.is_initialized()  # the pretend group is gone
    model = activations.transformer(hidden, heads, layers)
    psi, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    saved, _ = activations.saved_bytes(lambda: model(torch.randn(batch, seq, hidden)), model.parameters())
    peak, after = estimate["peak"], estimate["after step"]
    assert after["Sharded Param"] == after["Sharded Grad"] == 4 * psi // ranks
    assert after["OptState"] == 8 * psi // ranks + 4 * tensors
    assert peak["Unsharded Param"] == peak["All Gather"] == 4 * psi // layers
    assert saved <= peak["Activation"] <= saved + activations.block_formula(batch, seq, hidden, heads)
    assert peak["Total"] == sum(v for k, v in peak.items() if k != "Total")


def test_pretend_ranks_leaves_no_group_behind_after_an_error():
    import torch.distributed as dist

    with pytest.raises(ValueError), activations.pretend_ranks(4):
        assert dist.get_world_size() == 4 and dist.get_backend() == "fake"
        raise ValueError("inside")
    assert not dist.is_initialized()


def test_tracked_labels_cover_every_category():
    assert {activations.tracked_label(kind) for kind in activations.TRACKED} >= {"sharded weights", "Adam states"}
    assert activations.tracked_label("something new") == "something new"


@pytest.mark.skipif(distcourse.gpu_count() > 0, reason="on a GPU the allocator answers")
def test_measure_memory_has_no_allocator_to_ask_on_a_cpu():
    nothing = {"peak": None, "peaks": None, "totals": None, "snapshot": None}
    assert activations.measure_memory(layers=1, hidden=8, heads=2, batch=1, seq=4) == nothing


@pytest.mark.slow
@pytest.mark.skipif(distcourse.plan(1).device_type != "cuda", reason="needs a GPU")
def test_memory_estimate_is_within_ten_percent_of_the_gpu_allocator(tmp_path):
    shape = dict(layers=4, hidden=1024, heads=16, batch=8, seq=512)
    predicted = activations.estimate_memory(1, device_type="cuda", **shape)["peak"]["Total"]
    snapshot = str(tmp_path / "snapshot.pickle")
    measured = distcourse.launch(activations.measure_memory, world_size=1, kwargs=shape | {"snapshot": snapshot})[0]
    assert abs(measured["peak"] / predicted - 1) < 0.1
    assert (tmp_path / "snapshot.pickle").stat().st_size > 0
