"""Activation memory in chapter 09: counted, predicted, and traded for compute.

1. ``saved_bytes``: the bytes autograd keeps for backward, counted exactly with
   ``torch.autograd.graph.saved_tensors_hooks`` (every tensor an operation saves passes
   through the hook; each memory block is counted once, parameters are left out);
2. ``block_formula``: the same number predicted from the shapes, operation by operation;
3. ``model_state_bytes``: weights, gradients and Adam's moments, counted after a step;
4. checkpointing: ``forward_backward`` runs a model with none, full or selective activation
   checkpointing and reports the saved bytes, the matrix products run in backward, the
   time and the gradients;
5. ``estimate_memory``: a whole FSDP2 training step's bytes per rank, estimated by PyTorch's
   ``FSDPMemTracker`` on fake tensors (no memory allocated, no real ranks), and
   ``measure_memory``, the same step for real, measured by the GPU's allocator;
6. ``calculator_html``: the formulas as a small page widget that needs no kernel, for both
   ways of splitting 16 bytes per parameter (``common.memory.LAYOUTS``).

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
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .common.distributed import pretend_ranks as pretend_ranks  # the chapter calls it from here
from .common.memory import LAYOUTS, block_formula, local_bytes, saved_bytes, zero_bytes
from .common.models import transformer
from .common.timing import clock
from .runtime.hardware import rank_device
from .runtime.i18n import tr

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

    Returns what is kept for backward (bytes), the matrix products run in forward and in backward,
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
    return {
        "saved": kept,
        "forward_matmuls": forward.count,
        "backward_matmuls": backward.count,
        "seconds": min(times),
        "grads": grads,
    }


# --------------------------------------------------------------------------------------
# Estimating a training step's memory before running it
# --------------------------------------------------------------------------------------

# FSDPMemTracker's names for what it counts, as the reader sees them.
TRACKED = ("Sharded Param", "Unsharded Param", "All Gather", "Sharded Grad", "Unsharded Grad", "OptState")
TRACKED += ("Activation", "Temp", "Reduce Scatter", "Inputs", "Buffer")


def tracked_label(kind: str) -> str:
    """What one of FSDPMemTracker's categories holds, in the reader's language."""
    words = {
        "Sharded Param": tr("sharded weights"),
        "Unsharded Param": tr("gathered weights of the computing unit"),
        "All Gather": tr("all-gather buffer"),
        "Sharded Grad": tr("sharded gradients"),
        "Unsharded Grad": tr("full-size gradients"),
        "OptState": tr("Adam states"),
        "Activation": tr("activations"),
        "Temp": tr("temporaries of backward"),
        "Reduce Scatter": tr("reduce-scatter buffer"),
        "Inputs": tr("input batch"),
        "Buffer": tr("buffers"),
        "Total": tr("total"),
    }
    return words.get(kind, kind)


def _snapshot(tracker, which: str, device_type: str) -> dict:
    """A tracker snapshot as ``{category name: bytes}`` for the device of that type."""
    for device, parts in tracker.get_tracker_snapshot(which).items():
        if device.type == device_type:
            return {getattr(k, "value", k): v for k, v in parts.items()}
    return {}


def estimate_memory(
    world_size: int = 8,
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    batch: int = 8,
    seq: int = 64,
    device_type: str = "cpu",
    steps: int = 2,
) -> dict:
    """Bytes one rank of FSDP2 training with Adam would hold, estimated without allocating them.

    The model, its shards, the batch and every intermediate are fake tensors (shape, dtype and
    device, no memory); the ranks are ``pretend_ranks``. ``FSDPMemTracker`` follows each
    tensor's storage as FSDP2 creates and frees it, by category. The model is ``transformer``,
    each block its own FSDP unit; ``steps`` steps, so that Adam's states exist in the last.
    Returns the categories at the peak (over all steps: the last one's, which holds Adam's
    states) and after the last optimizer step.
    """
    # Private modules: FakeTensorMode and FSDPMemTracker have no public import path yet.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with pretend_ranks(world_size):
        mesh = init_device_mesh(device_type, (world_size,))  # outside the fake mode: it reads real ranks
        with FakeTensorMode(), torch.device(device_type):
            model = transformer(hidden, heads, layers)
            for block in model:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.Adam(model.parameters())
            x = torch.randn(batch, seq, hidden)
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((x,))
            with tracker:
                for step in range(steps):
                    model(x).square().mean().backward()
                    optimizer.step()
                    after_step = _snapshot(tracker, "current", device_type)
                    optimizer.zero_grad()
                    if step == 0:  # forget the first step's per-module records: the tracker
                        tracker.reset_mod_stats()  # refuses a second forward of the root otherwise
        return {"peak": _snapshot(tracker, "peak", device_type), "after step": after_step}


def memory_check(gpu_count: int) -> dict:
    """How the GPU cell of section 9 checks the estimate on a machine with ``gpu_count`` GPUs.

    "world size": 2 when there are 2 GPUs, so that FSDP2 really all-gathers and reduce-scatters
    (at world size 1 it skips both: ``_fsdp_param_group.py``, ``unshard``), else 1 (None: no GPU);
    "compare": the allocator's statistic the estimate is compared with. ``FSDPMemTracker`` follows
    tensors, like the allocator's *active* bytes (blocks in use, rounded up to the allocator's
    block sizes); PyTorch's tests of the tracker compare with ``active_bytes.all.peak`` on real
    tensors. "tolerance": the relative gap allowed, theirs (10%).
    """
    world = min(2, gpu_count) or None
    return {"world size": world, "compare": "active", "tolerance": 0.1}


_PEAKS = {
    "allocated": "allocated_bytes.all.peak",
    "active": "active_bytes.all.peak",
    "reserved": "reserved_bytes.all.peak",
}


def _cuda_peaks(device) -> dict:
    stats = torch.cuda.memory_stats(device)
    return {name: stats[key] for name, key in _PEAKS.items()}


def measure_memory(*, layers: int, hidden: int, heads: int, batch: int, seq: int, snapshot: str | None = None) -> dict:
    """Rank function: the training ``estimate_memory`` describes, for real; on a GPU, its peak bytes.

    The caching allocator counts three peaks, each minus what it held before the model:
    "allocated" (bytes handed out), "active" (blocks in use, what ``FSDPMemTracker`` models) and
    "reserved" (what it took from the driver, free blocks included: the number that decides an
    out-of-memory error). "peak" is the active one; "totals" are the peaks without the
    subtraction. With ``snapshot`` (a file path, rank 0) the allocator also records every
    allocation with its stack and writes them there, for
    https://pytorch.org/memory_viz. On a CPU there is no allocator to ask: the peaks are None.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = rank_device()
    if device.type != "cuda":
        return {"peak": None, "peaks": None, "totals": None, "snapshot": None}
    nn.Linear(8, 8, device=device)(torch.randn(2, 8, device=device)).sum().backward()  # cuBLAS workspace: not ours
    torch.cuda.reset_peak_memory_stats(device)
    stats = torch.cuda.memory_stats(device)
    before = {name: stats[key.replace(".peak", ".current")] for name, key in _PEAKS.items()}
    snapshot = snapshot if dist.get_rank() == 0 else None
    if snapshot:  # a private API, the only way to record the allocator's history
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = transformer(hidden, heads, layers).to(device)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(batch, seq, hidden, device=device)
    for _ in range(2):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    totals = _cuda_peaks(device)
    peaks = {name: totals[name] - before[name] for name in totals}
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"peak": peaks["active"], "peaks": peaks, "totals": totals, "snapshot": snapshot}


# --------------------------------------------------------------------------------------
# The calculator widget
# --------------------------------------------------------------------------------------


def layout_label(layout: str) -> str:
    """How each ``LAYOUTS`` entry splits 16 bytes per parameter, in the reader's language."""
    words = {
        "pytorch": tr("PyTorch autocast / FSDP2: fp32 weights and gradients, Adam m and v (4 + 4 + 8)"),
        "master weights": tr(
            "DeepSpeed / Megatron: 16-bit weights and gradients, fp32 master weights, m and v (2 + 2 + 12)"
        ),
    }
    return words[layout]


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
    layout: str = "pytorch",
    abytes: int = 2,
    flash: bool = True,
    checkpoint: bool = False,
) -> dict:
    """What the widget computes, in Python: bytes per GPU for a stack of ``Block``s.

    Model states: 12·h² weights per block (qkv 3h², proj h², MLP 8h²; biases and norms
    left out), times the bytes per parameter of each part in ``LAYOUTS[layout]``, sharded by
    the ZeRO ``stage``. Activations: ``block_formula`` per block in ``abytes`` bytes per value;
    with full checkpointing every block keeps only its input and one block at a time is
    recomputed in backward.
    """
    params = 12 * layers * hidden * hidden
    model = sum(zero_bytes(params, ranks, stage, LAYOUTS[layout]).values())
    per_layer = block_formula(batch, seq, hidden, heads, "sdpa" if flash else "naive", abytes)
    kept = batch * seq * hidden * abytes
    activations = layers * kept + per_layer if checkpoint else layers * per_layer
    return {"params": params, "model": model, "activations": activations, "total": model + activations}


_UPDATE_JS = """
(function () {
  const ids = ["layers", "hidden", "heads", "batch", "seq", "ranks", "stage"];
  const text = TEXT, layouts = LAYOUTS_BYTES;
  const fmt = (x, d) => new Intl.NumberFormat(text.language,
                                              {minimumFractionDigits: d, maximumFractionDigits: d}).format(x);
  const gb = x => fmt(x / 1e9, 1) + " " + text.gb;
  function update() {
    const v = {abytes: 2};
    ids.forEach(k => v[k] = Number(document.getElementById("UID-" + k).value));
    v.stage = Math.max(0, Math.min(3, Math.round(v.stage)));
    v.flash = document.getElementById("UID-flash").checked;
    v.checkpoint = document.getElementById("UID-checkpoint").checked;
    const results = Object.keys(layouts).map(name => [name, distcourseMemory(Object.assign({}, v,
      {pbytes: layouts[name][0], gbytes: layouts[name][1], obytes: layouts[name][2]}))]);
    const first = results[0][1];
    const lines = [text.params + ": " + fmt(first.params / 1e9, 2) + " " + text.billion + " · " +
                   text.activations + ": " + gb(first.activations)];
    results.forEach(([name, r]) => lines.push(text.layouts[name] + ": " + text.model + " " + gb(r.model) +
                                              " · " + text.total + " " + gb(r.total)));
    document.getElementById("UID-out").textContent = lines.join("\\n");
  }
  document.querySelectorAll("[id^=UID-]").forEach(e => e.addEventListener("input", update));
  update();
})();
"""


def calculator_html(labels: dict, defaults: dict | None = None, language: str = "en") -> str:
    """A form that recomputes ``calculator`` in the browser as the reader types; no kernel.

    ``labels`` are the visible texts, already in the chapter's language; ``language`` writes
    the numbers the way its readers do. One line per ``LAYOUTS`` entry: at ZeRO-3 both give
    the same total, at stages 1 and 2 they do not.
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
    text = {k: labels[k] for k in ("params", "model", "activations", "total")}
    text |= {"language": language, "gb": tr("GB"), "billion": tr("billion")}
    text["layouts"] = {name: layout_label(name) for name in LAYOUTS}
    layouts = {name: [b["params"], b["grads"], b["optimizer"]] for name, b in LAYOUTS.items()}
    update = _UPDATE_JS.replace("TEXT", json.dumps(text, ensure_ascii=False)).replace("UID", uid)
    script = f"<script>\n{_CALCULATOR_JS}{update.replace('LAYOUTS_BYTES', json.dumps(layouts))}</script>"
    return (
        f'<div class="distcourse-calculator" style="border:1px solid #ccc;padding:8px;border-radius:4px">'
        f"<div>{fields}</div><div>{boxes}</div>"
        f'<p id="{uid}-out" style="font-weight:bold;margin:6px 0 0 0;white-space:pre-line"></p></div>{script}'
    )


def calculator_js() -> str:
    """The widget's JavaScript function, for tests that run it outside a browser."""
    return _CALCULATOR_JS
