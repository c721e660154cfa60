"""Chapter 09: number formats, autocast, loss scaling, activation counting, checkpointing, calculator."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

import distcourse
from distcourse import activations, mixed_precision
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


def test_checkpointing_modes():
    modes = {
        mode: activations.forward_backward(mode, batch=2, seq=16, hidden=32, layers=2, repeats=1)
        for mode in activations.MODES
    }
    assert modes["full"]["saved"] == 2 * 2 * 16 * 32 * 4
    assert modes["none"]["saved"] == 2 * activations.block_formula(2, 16, 32, 4)
    assert modes["full"]["saved"] < modes["selective"]["saved"] < modes["none"]["saved"]
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
def test_calculator_widget_computes_what_python_computes():
    """The page widget's JavaScript and activations.calculator agree, case by case."""
    script = activations.calculator_js() + "\nconst cases = " + json.dumps(CALCULATOR_CASES) + ";\n"
    script += "console.log(JSON.stringify(cases.map(c => distcourseMemory(Object.assign("
    script += "{pbytes: 2, gbytes: 2, obytes: 12, abytes: 2}, c)))));"
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True).stdout
    for case, js in zip(CALCULATOR_CASES, json.loads(out)):
        py = activations.calculator(**case)
        assert js == pytest.approx(py, rel=1e-12), case


def test_calculator_page_holds_the_labels():
    labels = {
        k: f"<{k}>"
        for k in (
            "layers",
            "hidden",
            "heads",
            "batch",
            "seq",
            "ranks",
            "stage",
            "flash",
            "checkpoint",
            "params",
            "model",
            "activations",
            "total",
        )
    }
    page = activations.calculator_html(labels)
    assert "<script>" in page and "distcourseMemory" in page
    assert all(label in page for label in labels.values())


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
