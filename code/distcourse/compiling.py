"""torch.compile in chapter 09 (second part): graphs, graph breaks, compile cost, caches,
and compiling models that DDP or FSDP2 train.

1. ``explain``: how many graphs TorchDynamo captured from a module and why it broke;
   ``Branchy`` breaks on a Python ``if`` over a tensor's value, ``Branchless`` does not;
2. ``compile_cost``: the first call of a compiled model (tracing + compiling) against its
   steady step, and the largest difference to eager outputs and gradients;
3. ``inductor_compile``: a compile with the default backend, Inductor, which writes C++
   kernels and caches them on disk (``TORCHINDUCTOR_CACHE_DIR``); reports cache hits;
4. rank functions: ``ddp_train`` (DDP, eager or compiled: the DDP optimizer splits the graph
   at the gradient buckets) and ``fsdp_train`` (FSDP2 with every block compiled on its own).

Compiled examples use the ``aot_eager`` backend where the point is the graph, not the
kernels: it traces forward and backward as Inductor does but runs PyTorch's own kernels,
so it compiles in about a second instead of ten on a 2-core CPU, and gives bitwise the
same numbers as eager. Rank functions live here because rank processes import them by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .common.models import mlp, transformer
from .common.sharded import rank_batch
from .common.timing import clock, first_and_steady
from .common.training import global_mean, wrap_ddp
from .runtime.hardware import rank_device

BACKENDS = ("eager", "aot_eager", "inductor")


# --------------------------------------------------------------------------------------
# 1. Graphs and graph breaks
# --------------------------------------------------------------------------------------


class Branchy(nn.Module):
    """Doubles its hidden layer when its mean is large: decided by a Python ``if``."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, width), nn.Linear(width, 4)

    def forward(self, x):
        h = self.fc1(x).relu()
        if h.mean() > 0.2:  # Python needs a bool: the tensor's value, known only when it runs
            h = h * 2
        return self.fc2(h)


class Branchless(Branchy):
    """The same function with the choice made inside the graph by ``torch.where``."""

    def forward(self, x):
        h = self.fc1(x).relu()
        h = torch.where(h.mean() > 0.2, h * 2, h)  # both sides computed, one kept: no Python bool
        return self.fc2(h)


def explain(module: nn.Module, *inputs) -> dict:
    """TorchDynamo's account of one call: graphs captured, breaks, and the reason of each."""
    torch._dynamo.reset()  # forget earlier compiles, so the count is this module's alone
    report = torch._dynamo.explain(module)(*inputs)
    return {
        "graphs": report.graph_count,
        "breaks": report.graph_break_count,
        "reasons": [_first_line(r.reason) for r in report.break_reasons],
    }


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0]


# --------------------------------------------------------------------------------------
# 2. What compiling costs, and whether it changes the numbers
# --------------------------------------------------------------------------------------


def _step_inputs(seed: int = 0, batch: int = 8, seq: int = 32, hidden: int = 64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, hidden, generator=generator)


def compile_cost(backend: str = "aot_eager", steps: int = 8, layers: int = 2) -> dict:
    """Forward + backward of a small transformer, compiled with ``backend``, against eager.

    Returns the seconds of the first call (which traces and compiles), the median seconds
    of the following calls, the same for eager, how many graphs Dynamo had compiled after
    each call, and the largest absolute difference of outputs and gradients between
    compiled and eager.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    torch._dynamo.reset()
    eager, compiled = transformer(hidden=64, heads=4, layers=layers), transformer(hidden=64, heads=4, layers=layers)
    compiled_fn = torch.compile(compiled, backend=backend)
    x = _step_inputs()
    from torch._dynamo.utils import counters

    counters.clear()
    result = {}
    for name, fn in (("eager", eager), ("compiled", compiled_fn)):
        seconds, graphs = [], []
        for _ in range(steps):
            started = clock()
            out = fn(x)
            out.square().mean().backward()
            seconds.append(clock() - started)
            graphs.append(counters["stats"]["unique_graphs"])  # graphs Dynamo has compiled so far
        result[name] = first_and_steady(seconds) | {"out": out, "graphs after each call": graphs}
    result["output_gap"] = (result["eager"].pop("out") - result["compiled"].pop("out")).abs().max().item()
    result["grad_gap"] = max(
        (a.grad - b.grad).abs().max().item() for a, b in zip(eager.parameters(), compiled.parameters(), strict=True)
    )
    return result


def _gated_gelu(x):
    return F.gelu(x) * torch.sigmoid(x) + 1  # three element-wise operations: one fused kernel


def inductor_compile() -> dict:
    """Compile a small function with Inductor and report where its kernels are cached.

    Inductor's FX-graph cache keys the compiled code by the graph, the inputs' shapes and
    dtypes, and the versions of torch and the compiler. A miss costs the C++ compile; a hit
    loads the kernel from ``cache_dir``. Call twice: the second call always hits.
    """
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    torch._dynamo.reset()  # forget the compiled function in memory; the disk cache stays
    counters.clear()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    started = clock()
    out = torch.compile(_gated_gelu, backend="inductor")(x)
    seconds = clock() - started
    eager = _gated_gelu(x)
    return {
        "seconds": seconds,
        "cache hits": counters["inductor"]["fxgraph_cache_hit"],
        "cache misses": counters["inductor"]["fxgraph_cache_miss"],
        "cache_dir": cache_dir(),
        "gap to eager": (out - eager).abs().max().item(),
        "output": out,
        "eager output": eager,
    }


# --------------------------------------------------------------------------------------
# 3. Compiled models under DDP and FSDP2 (rank functions)
# --------------------------------------------------------------------------------------


class Net(nn.Module):
    """An MLP inside a module of the course's own.

    TorchDynamo starts tracing at a frame of user code; ``nn.Sequential.forward`` lives in
    torch itself, which Dynamo skips as a starting frame after DDP's own graph break, so a
    bare ``nn.Sequential`` under a compiled DDP would simply run eagerly.
    """

    def __init__(self, width: int = 512, depth: int = 3):
        super().__init__()
        self.body = mlp(width=width, depth=depth, seed=0)  # ~2.3 MB of fp32 weights

    def forward(self, x):
        return self.body(x)


class _Counting:
    """A backend that counts the graphs it is given and hands them to ``aot_eager``."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)


def ddp_train(compiled: bool = True, bucket_cap_mb: float = 25.0, steps: int = 12) -> dict:
    """Rank function: DDP training of ``Net``, eager or compiled, with a given bucket size.

    Compiled, TorchDynamo's DDP optimizer cuts the forward graph where DDP's gradient
    buckets end, so that each bucket's all-reduce can start while backward is still
    running through the graphs before it. The graphs follow DDP's buckets, except that
    Dynamo always caps its first piece at DDP's *default* first-bucket size (1 MiB), while
    DDP, given ``bucket_cap_mb``, makes its first bucket that size too. Returns the global
    losses, the seconds of the first and later steps, the graphs compiled and the buckets
    DDP made.
    """
    device = rank_device()
    model = wrap_ddp(Net().to(device), device, bucket_cap_mb=bucket_cap_mb)
    backend = _Counting()
    forward = torch.compile(model, backend=backend) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, seconds = [], []
    for step in range(steps):
        started = clock(device)  # on a GPU: after the previous step's kernels have run
        x, y = (t.to(device) for t in rank_batch(rank, world, step))  # chapter 08's batches
        loss = F.cross_entropy(forward(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seconds.append(clock(device) - started)
        losses.append(global_mean(loss))
    # DDP starts with one bucket and re-forms its buckets in the order gradients arrived;
    # its logging data (refreshed at step 10) says how many it ended up with.
    buckets = len(model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", "))
    timed = first_and_steady(seconds)
    return {
        "losses": losses,
        "first_step": timed["first"],
        "steady_step": timed["steady"],
        "graphs": backend.graphs,
        "buckets": buckets,
    }


def fsdp_train(compiled: bool = True, layers: int = 4, steps: int = 4) -> dict:
    """Rank function: FSDP2 on a transformer, each block its own unit and, if ``compiled``, its own graph.

    Per-block compile keeps FSDP2's all-gathers and reduce-scatters outside the compiled
    graphs, between the blocks, where its hooks run them; and since all blocks have the same
    code and shapes, their graphs are shared. Here ``fully_shard`` comes first and
    ``block.compile()`` after; torchtitan compiles each block first (``fullgraph=True``) and
    shards the compiled module, which also keeps the hooks outside.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = rank_device()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch._dynamo.reset()
    model = transformer(hidden=64, heads=4, layers=layers).to(device)
    backend = _Counting()
    for block in model:
        fully_shard(block, mesh=mesh)
        if compiled:
            block.compile(backend=backend)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
    losses, seconds = [], []
    for _ in range(steps):
        started = clock(device)  # on a GPU: after the previous step's kernels have run
        x = torch.randn(4, 16, 64, generator=generator).to(device)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seconds.append(clock(device) - started)
        losses.append(global_mean(loss))
    timed = first_and_steady(seconds)
    return {"losses": losses, "first_step": timed["first"], "steady_step": timed["steady"], "graphs": backend.graphs}
