"""DistributedDataParallel, one behaviour at a time (chapter 04, notebook ``04-ddp``).

Rank functions (run by ``distcourse.launch``) and the helpers the notebook checks them
with, by section of the chapter:

2. ``DistributedSampler``: ``sampler_orders``, ``sampler_demo``;
3. 2 ranks x B = 1 process x 2B: ``ddp_gradients``, ``reference_gradients``;
4. gradient accumulation and ``no_sync``: ``CommCounter``, ``counting_hook``, ``accumulated_gradients``;
5. buckets: ``bucket_timeline``.

Sections 6-11 (``04-ddp-in-practice``) are in ``ddp_in_practice.py``. Section 1's ``mp.spawn``
program is a script: ``distcourse/scripts/ddp_spawn_example.py``. A rank's share of a batch and
the comparison of replicas (``my_share``, ``params_of``, ``grads_of``, ``max_gap``) are in
``common/replicas.py``. The model and the data are chapter 02's (``data_parallel.mlp``,
scikit-learn's digits). The notebook loads the data and sends tensors to the ranks, so that
no rank has to import scikit-learn.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DistributedSampler

from .common.models import mlp
from .common.replicas import grads_of, my_share
from .common.training import wrap_ddp as wrap  # this rank's device, device_ids only on a GPU
from .runtime.i18n import tr

# --- 2. DistributedSampler ----------------------------------------------------------------


def sampler_orders(size: int, epochs: int = 3, set_epoch: bool = True, drop_last: bool = False):
    """The indices this rank's ``DistributedSampler`` yields in each of ``epochs`` epochs.

    The sampler asks the process group for the rank and the world size. It shuffles
    with a generator seeded by ``seed + epoch``: the same permutation on every rank,
    of which each rank takes every W-th element.
    """
    sampler = DistributedSampler(range(size), shuffle=True, seed=0, drop_last=drop_last)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # without it, the epoch stays 0: the same order every time
        orders.append(list(sampler))
    return orders


def sampler_demo(configs: dict) -> dict:
    """``sampler_orders(**kwargs)`` for each named configuration, in one launch."""
    return {name: sampler_orders(**kwargs) for name, kwargs in configs.items()}


# --- 3. Two ranks x B = one process x 2B --------------------------------------------------


def ddp_gradients(x, y, model_kwargs: dict) -> dict:
    """Gradients of this rank's share of the batch: first local (``no_sync``), then through DDP."""
    ddp = wrap(mlp(**model_kwargs))
    xs, ys, index = my_share(x, y)
    with ddp.no_sync():  # backward without the all-reduce: this rank's own gradient
        F.cross_entropy(ddp(xs), ys).backward()
    local = grads_of(ddp.module)
    ddp.zero_grad()
    F.cross_entropy(ddp(xs), ys).backward()  # DDP averages the gradients during backward
    return {"samples": index, "local": local, "ddp": grads_of(ddp.module)}


def reference_gradients(x, y, model_kwargs: dict) -> list[torch.Tensor]:
    """One process, the whole batch, mean loss: the gradients DDP must reproduce."""
    model = mlp(**model_kwargs)
    F.cross_entropy(model(x), y).backward()
    return grads_of(model)


# --- 4. Counting all-reduces (a communication hook), gradient accumulation ----------------


class CommCounter:
    """State of :func:`counting_hook`: one entry per bucket DDP handed to the hook."""

    def __init__(self, events: list | None = None):
        self.buckets: list[int] = []  # number of gradient values in each all-reduced bucket
        self.events = events  # optional shared timeline (see bucket_timeline)

    @property
    def calls(self) -> int:
        return len(self.buckets)


def counting_hook(counter, bucket):  # no type hints: DDP checks them, and these would be strings
    """A DDP communication hook: note the bucket, then all-reduce it as DDP would.

    DDP calls the hook once per bucket, as soon as every gradient in it is ready;
    ``allreduce_hook`` is PyTorch's own default (divide by the world size, all-reduce).
    """
    counter.buckets.append(bucket.buffer().numel())
    if counter.events is not None:
        counter.events.append(("all-reduce", bucket.index()))
    return default_hooks.allreduce_hook(None, bucket)


def accumulated_gradients(x, y, micro_batches: int, model_kwargs: dict) -> dict:
    """Gradient accumulation over ``micro_batches`` per rank, with and without ``no_sync``.

    Each micro-batch's loss is divided by ``micro_batches``, so that the accumulated
    gradient is the mean over the rank's whole share, as one big backward would give.
    """
    xs, ys, _ = my_share(x, y)
    out = {}
    for use_no_sync in (False, True):
        ddp, counter = wrap(mlp(**model_kwargs)), CommCounter()
        ddp.register_comm_hook(counter, counting_hook)
        pieces = list(zip(xs.chunk(micro_batches), ys.chunk(micro_batches)))
        for i, (xm, ym) in enumerate(pieces):
            last = i == len(pieces) - 1
            # no_sync: backward only adds to .grad; the all-reduce waits for the last micro-batch
            skip = ddp.no_sync() if use_no_sync and not last else contextlib.nullcontext()
            with skip:
                (F.cross_entropy(ddp(xm), ym) / micro_batches).backward()
        out["no_sync" if use_no_sync else "plain"] = {"grads": grads_of(ddp.module), "all_reduces": counter.calls}
    return out


# --- 5. Buckets ---------------------------------------------------------------------------


def bucket_timeline(x, y, caps_mb, model_kwargs: dict, steps: int = 3, **ddp_kwargs) -> dict:
    """For each ``bucket_cap_mb``: buckets per backward, their sizes, and the order of events.

    The timeline interleaves ``("gradient", <parameter name>)`` (a tensor hook on each
    parameter) with ``("all-reduce", <bucket index>)`` (the communication hook), for the
    last step; :func:`event_text` says them in words. Buckets of a DDP model are fixed after
    the first backward, which runs with one single bucket while DDP records the order
    gradients arrive in (unless ``find_unused_parameters=True`` is among ``ddp_kwargs``:
    then the first backward already uses buckets of the capped size).
    """
    xs, ys, _ = my_share(x, y)
    out = {}
    for cap in caps_mb:
        ddp, events = wrap(mlp(**model_kwargs), bucket_cap_mb=cap, **ddp_kwargs), []
        for name, p in ddp.module.named_parameters():
            p.register_hook(lambda grad, name=name: events.append(("gradient", name)))
        counter = CommCounter(events)
        ddp.register_comm_hook(counter, counting_hook)
        per_step = []
        for _ in range(steps):
            events.clear()
            before = counter.calls
            F.cross_entropy(ddp(xs), ys).backward()
            per_step.append(counter.calls - before)
        last = counter.buckets[-per_step[-1] :]
        out[cap] = {"buckets_per_step": per_step, "bucket_sizes": last, "timeline": list(events)}
    return out


def event_text(event: tuple) -> str:
    """One event of :func:`bucket_timeline` as the chapter's table shows it."""
    kind, what = event
    if kind == "gradient":
        return tr("gradient of {name} computed").format(name=what)
    return tr("all-reduce of bucket {index} starts").format(index=what)
