"""The chapter 08 task with Hugging Face Accelerate.

    torchrun --standalone --nproc-per-node=2 -m distcourse.scripts.accelerate_train --data data.pt --out result.json

The training loop stays a plain PyTorch loop: ``accelerator.prepare`` wraps the model
(in DDP when there are several processes) and shards the DataLoader, and
``accelerator.backward`` replaces ``loss.backward``. ``Accelerator`` reads rank and world
size from the environment the launcher sets, so torchrun works as well as
``accelerate launch`` (which, for several GPUs, calls torchrun's code itself).
"""

import torch
from accelerate import Accelerator
from accelerate import __version__ as accelerate_version
from torch import nn
from torch.utils.data import DataLoader

import distcourse  # noqa: F401
from distcourse import libraries, number, tr


def main():
    libraries.use_script_language()
    args = libraries.script_arguments()
    accelerator = Accelerator(cpu=torch.cuda.device_count() < libraries.WORLD_SIZE)
    ready = libraries.seconds_since_start()
    model = libraries.make_model()
    optimizer = libraries.make_optimizer(model.parameters())
    # A plain sequential loader over *all* the data: prepare() gives each process every
    # num_processes-th batch (process 0: batches 0, 2, 4...; process 1: batches 1, 3, 5...).
    loader = DataLoader(libraries.load_task(args.data), batch_size=libraries.BATCH, shuffle=False)
    wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, first = [], None
    for x, y, index in loader:  # batches arrive on accelerator.device
        first = index.tolist() if first is None else first
        loss = nn.functional.cross_entropy(wrapped(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())  # the global batch's loss
    rank, world_size, backend = accelerator.process_index, accelerator.num_processes, torch.distributed.get_backend()
    ranks = libraries.rank_facts(first)
    text = tr(
        "world size {world}, backend {backend}, {kind}, model wrapped in {wrapper}, {steps} steps, final loss {loss}"
    )
    facts = {"world": world_size, "backend": backend, "kind": accelerator.distributed_type, "steps": len(losses)}
    libraries.say(rank, text.format(**facts, wrapper=type(wrapped).__name__, loss=number(losses[-1], 6)))
    training = libraries.seconds_since_start() - ready
    text = tr("process start to Accelerator {ready} s, training {training} s")
    libraries.say(rank, text.format(ready=number(ready, 1), training=number(training, 1)))
    if accelerator.is_main_process:
        result = libraries.record("accelerate", losses, accelerator.unwrap_model(wrapped), ranks)
        result.update(
            version=accelerate_version,
            wrapper=type(wrapped).__name__,
            distributed_type=str(accelerator.distributed_type),
        )
        libraries.save_result(args.out, result)
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
