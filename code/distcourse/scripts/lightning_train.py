"""The chapter 08 task with PyTorch Lightning, ``strategy="ddp"`` on 2 devices.

    python -m distcourse.scripts.lightning_train --data data.pt --out result.json

Run it as a script, not from a notebook: with ``strategy="ddp"`` Lightning starts rank 0
in this process and re-runs this very command line for rank 1 (with LOCAL_RANK=1 in its
environment). The training code has no distributed calls: the Trainer starts the process
group, wraps the model in DDP and lets backward average the gradients.
"""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import distcourse  # noqa: F401  (first: makes torchvision importable, which Lightning imports)
from distcourse import libraries, number, tr


class DigitsModule(pl.LightningModule):
    def __init__(self, dataset):
        super().__init__()
        self.model = libraries.make_model()
        self.dataset, self.losses, self.first_batch, self.wrapper = dataset, [], None, None

    def train_dataloader(self):
        # Called once the process group exists. Lightning would otherwise put in a DistributedSampler
        # that *shuffles* (seed 0), even for shuffle=False; our own sampler keeps the chapter's order.
        sampler = DistributedSampler(self.dataset, shuffle=False)
        return DataLoader(self.dataset, batch_size=libraries.BATCH, sampler=sampler)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        if self.first_batch is None:
            self.first_batch = index.tolist()
            self.wrapper = type(self.trainer.strategy.model).__name__  # what Lightning trains through
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.losses.append(self.all_gather(loss.detach()).mean().item())  # the global batch's loss
        return loss  # Lightning calls backward (DDP averages the gradients) and optimizer.step

    def configure_optimizers(self):
        return libraries.make_optimizer(self.parameters())


def default_training_sampler(trainer, dataset):
    """The sampler Lightning would have injected into a plain DataLoader(shuffle=False)."""
    from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
    from lightning.pytorch.trainer.states import RunningStage

    loader = _process_dataloader(trainer, trainer.state.fn, RunningStage.TRAINING, DataLoader(dataset, shuffle=False))
    return [type(loader.sampler).__name__, loader.sampler.shuffle, loader.sampler.seed]


def main():
    libraries.use_script_language()
    args = libraries.script_arguments()
    dataset = libraries.load_task(args.data)
    module = DigitsModule(dataset)
    trainer = pl.Trainer(
        strategy="ddp",
        devices=libraries.WORLD_SIZE,
        accelerator="gpu" if torch.cuda.device_count() >= libraries.WORLD_SIZE else "cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ready = libraries.seconds_since_start()
    trainer.fit(module)
    rank, world_size, backend = trainer.global_rank, trainer.world_size, torch.distributed.get_backend()
    ranks = libraries.rank_facts(module.first_batch)
    text = tr("world size {world}, backend {backend}, model wrapped in {wrapper}, {steps} steps, final loss {loss}")
    facts = {"world": world_size, "backend": backend, "wrapper": module.wrapper, "steps": len(module.losses)}
    libraries.say(rank, text.format(**facts, loss=number(module.losses[-1], 6)))
    fit = libraries.seconds_since_start() - ready
    libraries.say(
        rank, tr("process start to Trainer {ready} s, fit {fit} s").format(ready=number(ready, 1), fit=number(fit, 1))
    )
    if rank == 0:
        result = libraries.record("lightning", module.losses, module.model, ranks)
        launcher = trainer.strategy.launcher
        result.update(
            version=pl.__version__,
            wrapper=module.wrapper,
            launcher=[type(launcher).__name__, launcher.is_interactive_compatible],
            default_sampler=default_training_sampler(trainer, dataset),
        )
        libraries.save_result(args.out, result)


if __name__ == "__main__":
    main()
