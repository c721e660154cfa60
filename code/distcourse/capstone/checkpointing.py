"""The job's checkpoints: asynchronous DCP saves, the newest complete one on resume, another layout on load.

torchtitan's ``CheckpointManager`` in small: what a checkpoint holds (``state_of``), where it
goes (``checkpoint_dir``), which one to resume from (``latest_complete``), the save itself
(``save``: ``dcp.async_save`` with a gloo group of its own), the load at another world size
(``loaded_model``: DCP reshards on load) and the final export for one-process inference.
"""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist

from ..common.checkpoint_files import atomic_save
from ..common.models import gpt
from ..common.timing import clock
from .config import VOCAB
from .parallelize import build_model


def checkpoint_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / f"step-{step:06d}"


def latest_complete(root: pathlib.Path | None) -> tuple[int, pathlib.Path | None, list[str]]:
    """The newest checkpoint that finished (DCP writes ``.metadata`` last, after every rank's
    shards), and the names of newer ones that did not: a save cut short by a kill."""
    if root is None or not root.exists():
        return 0, None, []
    found = sorted(root.glob("step-*"))
    complete = [d for d in found if (d / ".metadata").exists()]
    if not complete:
        return 0, None, [d.name for d in found]
    newest = complete[-1]
    return int(newest.name.split("-")[1]), newest, [d.name for d in found if d.name > newest.name]


def agreed_checkpoint(root: pathlib.Path | None, group=None) -> tuple[int, pathlib.Path | None, list[str]]:
    """``latest_complete`` as rank 0 sees it, on every rank.

    On a shared file system with attribute caching, ranks of different nodes can disagree for a
    moment about whether a ``.metadata`` file exists, and would resume from different steps.
    So rank 0 looks, and one ``broadcast_object_list`` tells the others."""
    if not dist.is_initialized():
        return latest_complete(root)
    found = [latest_complete(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0, group=group)
    return found[0]


def state_of(model, optimizer, extra: dict | None = None) -> dict:
    """What a checkpoint holds: the model and optimizer (sharded, DTensor entries under FSDP2),
    and the ``state_dict()`` of every object in ``extra`` (the learning-rate schedule, the data
    loader's position, fp16's loss scale)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state} | {
        name: thing.state_dict() for name, thing in (extra or {}).items()
    }


def load_state(path: pathlib.Path, model, optimizer, group, extra: dict | None = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = state_of(model, optimizer, extra)
    dcp.load(state, checkpoint_id=path, process_group=group)  # each rank reads its own shards
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for name, thing in (extra or {}).items():
        thing.load_state_dict(state[name])


def model_weights(path: pathlib.Path) -> dict:
    """The model's tensors of a DCP checkpoint, in one process, without the optimizer's.

    ``dcp_to_torch_save`` reads everything, AdamW's two moments included (about 16 bytes per
    parameter in all with fp32 weights). A partial load reads only the entries asked for: empty
    tensors of the saved shapes and dtypes (from the metadata), filled by ``dcp.load`` without a
    process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    model = {
        name.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in saved.items()
        if name.startswith("model.")
    }
    dcp.load({"model": model}, checkpoint_id=path, no_dist=True)
    return model


def save(args, job, run):
    """Start a DCP save of this step and return a future (None once done, with ``--sync-save``).

    ``async_save`` copies the state to CPU memory ("staging", synchronous by default) and
    returns; a background thread writes the files while training goes on. One save at a
    time: the previous one must be finished before the next is staged. ``run.saves`` gets
    one record per save: the seconds the loop waited, and after how many the checkpoint
    was complete (the returned future resolves only once that is recorded).

    With ``--background-staging`` the copy to CPU memory runs in the background too
    (``DefaultStager``): ``async_save`` then returns an ``AsyncSaveResponse`` of two futures,
    and the loop must wait for ``staging_completion`` before the next optimizer step changes
    the parameters being copied (``train_step`` does); ``upload_completion`` is the old future.
    """
    import concurrent.futures

    import torch.distributed.checkpoint as dcp

    if run.saving is not None:
        run.saving.result()
    path, state = checkpoint_dir(args.ckpt_dir, run.step), state_of(job.model, job.optimizer, job.extra)
    record = {"step": run.step}
    run.saves.append(record)
    start = clock(job.device)  # after this step's kernels: the save's own time
    if args.sync_save:
        dcp.save(state, checkpoint_id=path, process_group=job.ckpt_group)
        record.update({"waited": clock(job.device) - start, "writing on return": False})
        record["complete after"] = record["waited"]
        return None
    written = dcp.async_save(state, checkpoint_id=path, process_group=job.ckpt_group, async_stager=job.stager)
    if job.stager is not None:  # background staging: an AsyncSaveResponse, not a future
        run.staging, written = written.staging_completion, written.upload_completion
    record.update({"waited": clock(job.device) - start, "writing on return": not written.done()})
    recorded = concurrent.futures.Future()

    def complete(future) -> None:  # in DCP's writer thread, when the files are written
        record["complete after"] = clock() - start
        if future.exception() is not None:
            recorded.set_exception(future.exception())
        else:
            recorded.set_result(future.result())

    written.add_done_callback(complete)
    return recorded


def background_stager(device: torch.device):
    """``--background-staging``: DCP's ``DefaultStager``, which copies the state to CPU memory
    in a thread of its own; pinned (page-locked) memory and non-blocking copies on a GPU."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    gpu = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_non_blocking_copy=gpu))


def loaded_model(args, device: torch.device, world_size: int) -> dict:
    """Build the model for this layout and load the newest complete checkpoint of
    ``args.ckpt_dir`` into it: each rank reads only the slices its own shards need.

    Returns the step, this rank's local shape of every parameter and the mesh dimensions it is
    spread over, and, on rank 0, the whole tensors gathered from the shards (a collective:
    every rank calls it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor import DTensor

    step, path, _ = latest_complete(args.ckpt_dir)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {args.ckpt_dir}")
    model, _, _ = build_model(args, device, world_size)
    state = {"model": get_model_state_dict(model)}  # the optimizer's entries stay on disk: a partial load
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    local = {
        name: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape) for name, p in model.named_parameters()
    }
    meshes = {  # the mesh dimensions each parameter is spread over
        name: tuple(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else ()
        for name, p in model.named_parameters()
    }
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    master = not dist.is_initialized() or dist.get_rank() == 0
    return {"step": step, "local shapes": local, "meshes": meshes, "model": full if master else None}


def export(model, args, master: bool):
    """The trained weights as one plain GPT on rank 0 (gathered from every shard), saved as
    ``final.pt`` for one-process inference; None on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # only rank 0 keeps the gathered tensors
    state = get_model_state_dict(model, options=options)
    if not master:
        return None
    final = gpt(None, vocab=VOCAB, hidden=args.hidden, heads=args.heads, layers=args.layers)
    final.load_state_dict(state)
    if args.out:
        atomic_save(state, args.out / "final.pt")
    return final
