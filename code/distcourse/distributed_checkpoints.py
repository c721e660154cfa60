"""Sharded checkpoints of chapter 05 (parts 4 and 5): ``torch.distributed.checkpoint`` (DCP).

Each rank writes and reads only its own shards; a checkpoint saved by N ranks loads on M,
or in one process; ``dcp.async_save`` writes while training goes on, through a ``Stateful``
object (``TrainingState``). ``weights_only_planner`` makes DCP's loads refuse pickled code.

Builds on: ``checkpoints.py`` (the chapter's model, ``make_model``).
Rank functions live here, not in the notebook, because rank processes import them by name.
"""

from __future__ import annotations

import pathlib
import threading
import time
import warnings

import torch
import torch.distributed as dist

from .checkpoints import make_model
from .common.timing import clock
from .runtime.hardware import rank_device
from .runtime.i18n import tr

# --------------------------------------------------------------------------------------
# 4. Sharded checkpoints: save on N ranks, load on M
# --------------------------------------------------------------------------------------


def weights_only_planner():
    """A DCP load planner that unpickles non-tensor entries with ``weights_only=True``.

    DCP stores entries that are not tensors (an optimizer's hyperparameters, say) as small
    pickles, and its default planner loads them with ``torch.load(..., weights_only=False)``.
    This one changes only that call.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            obj = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if not self.flatten_state_dict:
                self.state_dict[fqn] = obj
                return
            target, path = self.original_state_dict, self.mappings[fqn]  # e.g. ("optimizer", "param_groups", 0, "lr")
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = obj

    return WeightsOnlyLoadPlanner()


def _fsdp_model(device):
    """The chapter's MLP, each Linear sharded by FSDP2 over all ranks (dim 0 split)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = make_model().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(state: dict) -> dict:
    """Whole tensors gathered from the shards (a collective), on the CPU."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _full(value)
        elif hasattr(value, "full_tensor"):
            out[key] = value.full_tensor().cpu()
        elif isinstance(value, torch.Tensor):
            out[key] = value.cpu()
        else:
            out[key] = value
    return out


def dcp_save_sharded(directory, steps: int = 3):
    """Rank function: train a few steps with FSDP2, then save model and optimizer with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    device = rank_device()
    model = _fsdp_model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(16, 64, generator=generator).to(device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    local = {k: tuple(v.to_local().shape) for k, v in model_sd.items()}
    print(tr("local shards: {shapes}").format(shapes=local))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory)  # each rank writes its shards
    return {"local_shapes": local, "model": _full(model_sd), "optimizer": _full(optim_sd)}


def dcp_load_resharded(directory):
    """Rank function: load a DCP checkpoint into an FSDP2 model sharded over this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _fsdp_model(rank_device())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # empty shards of the right shapes
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=directory, planner=weights_only_planner())  # each rank reads only its slices
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    local = {k: tuple(v.to_local().shape) for k, v in state["model"].items()}
    print(tr("local shards: {shapes}").format(shapes=local))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"local_shapes": local, "model": _full(model_sd), "optimizer": _full(optim_sd)}


def dcp_layout(directory) -> list[dict]:
    """Which slice of which entry each file of a DCP checkpoint holds, read from its .metadata.

    DCP's reader unpickles .metadata with plain pickle (see the chapter): use this only on
    checkpoints you trust, such as one your own ranks have just written.
    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata()
    rows = [
        {
            "file": where.relative_path,
            "key": index.fqn,
            "bytes": where.length,
            "offset": None if index.offset is None else tuple(index.offset),
        }
        for index, where in metadata.storage_data.items()
    ]
    return sorted(rows, key=lambda r: (r["file"], r["key"]))


def dcp_load_single_process(model, optimizer, directory):
    """Load a DCP checkpoint into an ordinary model and optimizer, here, without a process group.

    Returns the loaded state as plain CPU tensors, keyed like the saved one.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # the layout we want: whole tensors
    state = {"model": model_sd, "optimizer": optim_sd}
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes a single process: that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=directory, planner=weights_only_planner(), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": _full(model_sd), "optimizer": _full(optim_sd)}


# --------------------------------------------------------------------------------------
# 5. Saving while training goes on: dcp.async_save and Stateful
# --------------------------------------------------------------------------------------


class TrainingState:
    """Model, optimizer and step as one object DCP saves and loads (the ``Stateful`` protocol).

    ``dcp.save`` and ``dcp.async_save`` call ``state_dict()`` on every entry that has both
    methods, and ``dcp.load`` calls ``load_state_dict()`` after filling that dict in place:
    the caller hands DCP live objects instead of converting dicts by hand around every call.
    """

    def __init__(self, model, optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # sharded entries stay sharded
        return {"model": model_sd, "optimizer": optim_sd, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.step = state["step"]


def _snapshot(state: dict) -> dict:
    """Whole tensors on the CPU, copied: later training steps cannot change them (a collective)."""
    import copy

    return copy.deepcopy(_full(state))


def _gated_writer(path, gate):
    """A ``FileSystemWriter`` whose background write starts only once ``gate`` is set.

    The training loop sets it right after it has recorded whether ``async_save`` returned
    before its checkpoint was written: so that answer holds by construction, not by whether
    the small write happens to finish before the main thread looks. (Were ``async_save`` to
    wait for the write, it would never return.)
    """
    from torch.distributed.checkpoint import FileSystemWriter

    class GatedWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            if not gate.wait(timeout=120):
                raise TimeoutError("the checkpoint write was never released")
            return super().write_data(plan, planner)

    return GatedWriter(path)


def dcp_async_save_while_training(directory, steps: int = 8, save_at=(3, 6)):
    """Rank function: FSDP2 training that checkpoints with ``dcp.async_save`` and keeps training.

    The saves get a gloo process group of their own: ``async_save`` runs collectives in a
    background thread, and on the default group they would interleave with the training's
    own collectives in a different order on each rank (a hang or an abort). At most one save
    is in flight: the previous one's ``.result()`` is waited for before the next starts.
    Afterwards every checkpoint is loaded into a fresh model and optimizer, through the same
    ``Stateful`` object, and returned next to what was saved.
    """
    import torch.distributed.checkpoint as dcp

    device = rank_device()
    model = _fsdp_model(device)
    app = TrainingState(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    save_group = dist.new_group(backend="gloo")  # every rank creates it; only the saves use it
    generator = torch.Generator().manual_seed(dist.get_rank())
    pending, saves, expected = None, [], {}
    for _ in range(steps):
        x = torch.randn(16, 64, generator=generator).to(device)
        model(x).square().mean().backward()
        app.optimizer.step()
        app.optimizer.zero_grad()
        app.step += 1
        if pending is not None and not pending.done():
            saves[-1]["steps while writing"] += 1  # a step that ran while the checkpoint was written
        if app.step in save_at:
            if pending is not None:
                pending.result()  # the previous save is complete (and raises here if it failed)
            expected[app.step] = _snapshot(app.state_dict())  # what this checkpoint must hold
            start = clock(device)  # after this step's kernels: the save's own time
            gate = threading.Event()
            writer = _gated_writer(pathlib.Path(directory) / f"step-{app.step}", gate)
            pending = dcp.async_save({"app": app}, storage_writer=writer, process_group=save_group)
            record = {
                "step": app.step,
                "returned after": clock(device) - start,
                "still writing on return": not pending.done(),
                "steps while writing": 0,
            }
            gate.set()  # only now may the background thread write the files
            pending.add_done_callback(lambda _, r=record, t=start: r.update({"written after": time.perf_counter() - t}))
            saves.append(record)
    pending.result()
    final = _snapshot(app.state_dict())

    loaded = {}
    for step in save_at:
        fresh_model = _fsdp_model(device)
        fresh = TrainingState(fresh_model, torch.optim.Adam(fresh_model.parameters(), lr=1e-3))
        dcp.load({"app": fresh}, checkpoint_id=pathlib.Path(directory) / f"step-{step}", planner=weights_only_planner())
        loaded[step] = _snapshot(fresh.state_dict())
    dist.destroy_process_group(save_group)
    return {"saves": saves, "expected": expected, "loaded": loaded, "final": final}
