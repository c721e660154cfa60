"""The chapter 08 task with DeepSpeed, ZeRO stage 2 by default (``--zero-stage``).

    torchrun --standalone --nproc-per-node=2 -m distcourse.scripts.deepspeed_train --data data.pt --out result.json
    deepspeed --num_gpus 2 --module distcourse.scripts.deepspeed_train ...          (DeepSpeed's own launcher)

``deepspeed.init_distributed`` replaces ``torch.distributed.init_process_group``, and
``deepspeed.initialize`` turns model and config into an *engine* that owns the optimizer,
the gradient averaging and the ZeRO sharding: the loop calls ``engine(x)``,
``engine.backward(loss)`` and ``engine.step()``.
"""

import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import distcourse  # noqa: F401
from distcourse import libraries, number, tr
from distcourse.common.training import global_mean


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": libraries.BATCH,  # per rank, per step
        "gradient_accumulation_steps": 1,
        # torch_adam: PyTorch's own Adam, not DeepSpeed's fused kernel (which it would have
        # to compile first). DeepSpeed's "Adam" means AdamW unless told otherwise; with
        # weight_decay 0 both are plain Adam, the chapter's optimizer.
        "optimizer": {"type": "Adam", "params": {"lr": libraries.LR, "torch_adam": True, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,  # no progress lines
    }


def skip_cpu_kernel_build():
    """Stop DeepSpeed's CPU backend from compiling its shared-memory all-reduce (a minute of g++).

    DeepSpeed builds that C++ extension the first time it starts on a CPU; gloo does the
    job for a model this small. The dict is DeepSpeed's record of which ops can be built.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def full_weights(engine, stage: int) -> dict:
    """The whole model's weights, also under ZeRO-3, where every rank holds only a slice."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):  # all-gathers, then re-shards
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def main():
    libraries.use_script_language()
    args = libraries.script_arguments()
    on_gpus = torch.accelerator.device_count() >= libraries.WORLD_SIZE
    if on_gpus:
        # Before the process group: NCCL starts on the current GPU, GPU 0 unless set otherwise.
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    else:
        skip_cpu_kernel_build()
    deepspeed.init_distributed(dist_backend="nccl" if on_gpus else "gloo")
    ready = libraries.seconds_since_start()
    model = libraries.make_model()
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(args.zero_stage)
    )
    dataset = libraries.load_task(args.data)
    loader = DataLoader(dataset, batch_size=libraries.BATCH, sampler=DistributedSampler(dataset, shuffle=False))
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses, first = [], None
    for x, y, index in loader:
        first = index.tolist() if first is None else first
        loss = nn.functional.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)  # averages the gradients over the ranks (reduce-scatter from stage 2 on)
        engine.step()  # optimizer step on this rank's partition, then zeroes the gradients
        losses.append(global_mean(loss))  # the global batch's loss
    ranks = libraries.rank_facts(first)
    weights = full_weights(engine, args.zero_stage)
    backend = torch.distributed.get_backend()
    text = tr(
        "world size {world}, backend {backend}, ZeRO stage {stage}, optimizer {optimizer}, "
        "{steps} steps, final loss {loss}"
    )
    facts = {"world": world_size, "backend": backend, "stage": engine.zero_optimization_stage(), "steps": len(losses)}
    libraries.say(rank, text.format(**facts, optimizer=type(optimizer).__name__, loss=number(losses[-1], 6)))
    training = libraries.seconds_since_start() - ready
    text = tr("process start to process group {ready} s, engine and training {training} s")
    libraries.say(rank, text.format(ready=number(ready, 1), training=number(training, 1)))
    if rank == 0:
        result = libraries.record("deepspeed", losses, model, ranks)
        inner = type(optimizer.optimizer)  # the torch optimizer that ZeRO's wrapper steps on its partition
        result.update(
            weights=weights,
            version=deepspeed.__version__,
            zero_stage=engine.zero_optimization_stage(),
            wrapper=type(engine).__name__,
            optimizer=type(optimizer).__name__,
            inner_optimizer=f"{inner.__module__}.{inner.__name__}",
            accelerator=get_accelerator()._name,
        )
        libraries.save_result(args.out, result)
    torch.distributed.barrier()  # every rank is done with the groups before any rank leaves them
    torch.distributed.destroy_process_group()
    # DeepSpeed keeps C++ threads of its own that can still be joinable when the interpreter shuts
    # down; the C++ runtime then aborts a process whose work is finished ("terminate called without
    # an active exception", SIGABRT, seen in the course's CI). Everything is written by now, so
    # leave without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
