"""Activation memory in chapter 09: counted, predicted, and traded for compute.

1. ``saved_bytes``: the bytes autograd keeps for backward, counted exactly with
   ``torch.autograd.graph.saved_tensors_hooks`` (every tensor an operation saves passes
   through the hook; each memory block is counted once, parameters are left out);
2. ``block_formula``: the same number predicted from the shapes, operation by operation;
3. ``model_state_bytes``: weights, gradients and Adam's moments, counted after a step;
4. checkpointing: ``forward_backward`` runs a model with none, full or selective activation
   checkpointing and reports the saved bytes, the matrix products run in backward, the
   time and the gradients;
5. ``calculator_html``: the same formulas as a small page widget that needs no kernel.

``saved_bytes`` and ``block_formula`` live in ``common/memory.py`` (chapter 10 and the
capstone count with them too); this module imports them, so ``activations.saved_bytes`` works.

Why hooks and not a memory profiler: on a CPU, allocator statistics (RSS, tracemalloc)
mix activations with everything else the process allocates; the hooks see exactly what
backward will need, on any device.
"""

from __future__ import annotations

import functools
import json

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .common.memory import block_formula, local_bytes, saved_bytes, zero_bytes
from .common.models import transformer
from .common.timing import clock

MODES = ("none", "full", "selective")


def measure_block(batch: int, seq: int, hidden: int = 64, heads: int = 4, attention: str = "naive") -> int:
    """Bytes one block saves on a random input of that shape (counted by the hooks)."""
    model = transformer(hidden, heads, layers=1, attention=attention)
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    counted, _ = saved_bytes(lambda: model(x), model.parameters())
    return counted  # x included: the first LayerNorm keeps the block's input


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Weights, gradients and optimizer state in bytes, counted tensor by tensor after a step."""

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    grads = [p.grad for p in params if p.grad is not None]
    return {"params": local_bytes(params), "grads": local_bytes(grads), "optimizer": local_bytes(state)}


# --------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _save_matmuls(ctx, op, *args, **kwargs):
    """Selective checkpointing policy: keep what the matrix products produce (expensive to
    recompute), recompute everything else (LayerNorm, GELU, softmax: cheap, memory-bound)."""
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class CountMatmuls(TorchDispatchMode):
    """Counts the matrix products torch runs while it is active, and the bytes they produce."""

    def __init__(self):
        super().__init__()
        self.count = self.output_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.count += 1
            self.output_bytes += out.numel() * out.element_size()
        return out


def run_blocks(model: nn.Sequential, x: torch.Tensor, mode: str = "none") -> torch.Tensor:
    """The forward pass through ``model``'s blocks with the chosen checkpointing.

    full: each block keeps only its input; backward runs the block's forward again.
    selective: each block keeps its matrix products' outputs and recomputes the rest.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for block in model:
        if mode == "none":
            x = block(x)
        elif mode == "full":
            x = checkpoint(block, x, use_reentrant=False)
        else:
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            x = checkpoint(block, x, use_reentrant=False, context_fn=context)
    return x


def forward_backward(
    mode: str, batch: int = 8, seq: int = 64, hidden: int = 64, heads: int = 4, layers: int = 4, repeats: int = 5
):
    """Forward and backward passes of the same model and input with checkpointing ``mode``.

    Returns what is kept for backward (bytes), the matrix products run during backward,
    the fastest of ``repeats`` timed passes (after one untimed warm-up) and the gradients
    (to compare the modes bitwise). What the hooks cannot see: selective checkpointing keeps
    the outputs it must save in storage of its own, so those bytes are counted as the
    matrix products produce them in the forward pass.
    """
    model = transformer(hidden, heads, layers)
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(0))
    with CountMatmuls() as forward:
        hooked, out = saved_bytes(lambda: run_blocks(model, x, mode), list(model.parameters()))
    with CountMatmuls() as backward:
        out.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    times = []
    for attempt in range(repeats + 1):  # timed without the hooks and counters, which cost time of their own
        model.zero_grad()
        started = clock()  # the model is on the CPU: clock() reads the time as it is
        run_blocks(model, x, mode).square().mean().backward()
        if attempt:  # the first pass warms up the allocator and the kernels: not timed
            times.append(clock() - started)
    kept = hooked + (forward.output_bytes if mode == "selective" else 0)
    return {"saved": kept, "backward_matmuls": backward.count, "seconds": min(times), "grads": grads}


# --------------------------------------------------------------------------------------
# The calculator widget
# --------------------------------------------------------------------------------------

# The formulas of this module in JavaScript, so the widget works in a static page.
_CALCULATOR_JS = """
function distcourseMemory(v) {
  const P = 12 * v.layers * v.hidden * v.hidden;            // parameters of the blocks (weights)
  const states = {0: [v.pbytes, v.gbytes, v.obytes], 1: [v.pbytes, v.gbytes, v.obytes / v.ranks],
                  2: [v.pbytes, v.gbytes / v.ranks, v.obytes / v.ranks],
                  3: [v.pbytes / v.ranks, v.gbytes / v.ranks, v.obytes / v.ranks]}[v.stage];
  const model = P * (states[0] + states[1] + states[2]);
  const tokens = v.batch * v.seq;
  let perLayer = tokens * (16 * v.hidden * v.abytes + 16);
  perLayer += v.flash ? v.heads * tokens * 4 : v.heads * v.batch * v.seq * v.seq * v.abytes + v.seq * v.seq;
  const checkpointed = tokens * v.hidden * v.abytes;     // full checkpointing: each block keeps its input
  const activations = v.checkpoint ? v.layers * checkpointed + perLayer : v.layers * perLayer;
  return {params: P, model: model, activations: activations, total: model + activations};
}
"""


def calculator(
    *,
    layers: int,
    hidden: int,
    heads: int,
    batch: int,
    seq: int,
    ranks: int = 1,
    stage: int = 0,
    pbytes: float = 2,
    gbytes: float = 2,
    obytes: float = 12,
    abytes: int = 2,
    flash: bool = True,
    checkpoint: bool = False,
) -> dict:
    """What the widget computes, in Python: bytes per GPU for a stack of ``Block``s.

    Model states: 12·h² weights per block (qkv 3h², proj h², MLP 8h²; biases and norms
    left out), times the bytes per parameter of each part, sharded by the ZeRO ``stage``.
    Activations: ``block_formula`` per block; with full checkpointing every block keeps only
    its input and one block at a time is recomputed in backward.
    """
    params = 12 * layers * hidden * hidden
    model = sum(zero_bytes(params, ranks, stage, {"params": pbytes, "grads": gbytes, "optimizer": obytes}).values())
    per_layer = block_formula(batch, seq, hidden, heads, "sdpa" if flash else "naive", abytes)
    kept = batch * seq * hidden * abytes
    activations = layers * kept + per_layer if checkpoint else layers * per_layer
    return {"params": params, "model": model, "activations": activations, "total": model + activations}


def calculator_html(labels: dict, defaults: dict | None = None) -> str:
    """A form that recomputes ``calculator`` in the browser as the reader types; no kernel.

    ``labels`` are the visible texts, already in the chapter's language.
    """
    values = {"layers": 32, "hidden": 4096, "heads": 32, "batch": 1, "seq": 4096, "ranks": 8, "stage": 3}
    values.update(defaults or {})
    uid = "memcalc"
    fields = "".join(
        f'<label style="display:inline-block;margin:2px 10px 2px 0">{labels[k]} '
        f'<input type="number" min="0" id="{uid}-{k}" value="{values[k]}" style="width:6em"></label>'
        for k in ("layers", "hidden", "heads", "batch", "seq", "ranks", "stage")
    )
    boxes = "".join(
        f'<label style="margin-right:12px"><input type="checkbox" id="{uid}-{k}"{" checked" if on else ""}> '
        f"{labels[k]}</label>"
        for k, on in (("flash", True), ("checkpoint", False))
    )
    script = f"""
<script>
{_CALCULATOR_JS}
(function () {{
  const ids = ["layers", "hidden", "heads", "batch", "seq", "ranks", "stage"];
  const labels = {json.dumps({k: labels[k] for k in ("params", "model", "activations", "total")})};
  function update() {{
    const v = {{pbytes: 2, gbytes: 2, obytes: 12, abytes: 2}};
    ids.forEach(k => v[k] = Number(document.getElementById("{uid}-" + k).value));
    v.stage = Math.max(0, Math.min(3, Math.round(v.stage)));
    v.flash = document.getElementById("{uid}-flash").checked;
    v.checkpoint = document.getElementById("{uid}-checkpoint").checked;
    const r = distcourseMemory(v);
    const gb = x => (x / 1e9).toFixed(1) + " GB";
    document.getElementById("{uid}-out").textContent =
      labels.params + ": " + (r.params / 1e9).toFixed(2) + "B · " + labels.model + ": " + gb(r.model) +
      " · " + labels.activations + ": " + gb(r.activations) + " · " + labels.total + ": " + gb(r.total);
  }}
  document.querySelectorAll("[id^={uid}-]").forEach(e => e.addEventListener("input", update));
  update();
}})();
</script>"""
    return (
        f'<div class="distcourse-calculator" style="border:1px solid #ccc;padding:8px;border-radius:4px">'
        f"<div>{fields}</div><div>{boxes}</div>"
        f'<p id="{uid}-out" style="font-weight:bold;margin:6px 0 0 0"></p></div>{script}'
    )


def calculator_js() -> str:
    """The widget's JavaScript function, for tests that run it outside a browser."""
    return _CALCULATOR_JS
