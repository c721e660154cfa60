"""The job's data: the course's own prose as bytes, windows of it, and a sampler that can resume mid-epoch.

torchtitan's ``dataloader`` component: a dataset, sharded over the data-parallel ranks only
(every rank of one tensor-parallel group reads the same samples), and a loader whose position
is part of the checkpoint.
"""

from __future__ import annotations

import json
import pathlib

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def corpus_text(path: pathlib.Path) -> str:
    """The text to train on: a text file, or the markdown cells of every notebook (but the
    first: its title, badge and links) and every ``.md``/``.txt`` file in a folder (sorted by
    name, so every rank reads the same corpus)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no corpus at {path}: pass --corpus with a text file or a folder of notebooks or text files"
        )
    files = sorted(p for p in path.iterdir() if p.suffix in (".ipynb", ".md", ".txt")) if path.is_dir() else [path]
    parts = []
    for f in files:
        if f.suffix == ".ipynb":
            cells = json.loads(f.read_text(encoding="utf-8"))["cells"]
            parts += ["".join(c["source"]) for c in cells[1:] if c["cell_type"] == "markdown"]
        else:
            parts.append(f.read_text(encoding="utf-8"))
    text = "\n\n".join(parts)
    if not text.strip():
        raise ValueError(f"the corpus at {path} holds no text")
    return text


def split_corpus(text: str, held_out: float) -> tuple[torch.Tensor, torch.Tensor]:
    """UTF-8 bytes as a uint8 tensor, cut in two: training text, then held-out text."""
    if not 0 < held_out < 1:
        raise ValueError(f"--held-out must be between 0 and 1, got {held_out}")
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]


class Windows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: the input, and the targets one byte later."""

    def __init__(self, data: torch.Tensor, seq_len: int, limit: int | None = None):
        self.data, self.seq_len = data, seq_len
        self.count = (len(data) - 1) // seq_len if limit is None else min(limit, (len(data) - 1) // seq_len)
        if self.count < 1:
            raise ValueError(f"{len(data)} bytes hold no window of {seq_len + 1}: use a bigger corpus or --seq-len")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        window = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start its epoch part-way through.

    After a resume at step s the epoch is already ``s % steps_per_epoch`` batches old; those
    samples must be skipped, not read and thrown away (a real corpus is big). The order of an
    epoch depends only on ``seed + epoch`` (``set_epoch``), so the samples that follow are
    exactly those the uninterrupted run saw.
    """

    skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def start_at(sampler: ResumableSampler, step: int, per_epoch: int, batch_size: int) -> None:
    """Point ``sampler`` at ``step``: that step's epoch (its shuffled order), minus the
    samples of this rank the epoch has already used."""
    sampler.set_epoch(step // per_epoch)
    sampler.skip = (step % per_epoch) * batch_size


def step_samples(dataset: Windows, dp_size: int, batch_size: int, step: int, seed: int = 0) -> list[list[int]]:
    """The windows (indices into ``dataset``) that each of ``dp_size`` ranks trains on at
    ``step``, by the rule ``train`` follows; one list per data-parallel rank."""
    shares = []
    for rank in range(dp_size):
        sampler = ResumableSampler(dataset, num_replicas=dp_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        start_at(sampler, step, len(sampler) // batch_size, batch_size)
        shares.append(list(sampler)[:batch_size])
    return shares


class StatefulLoader:
    """A ``DataLoader`` that knows where it stands: its position is a checkpoint entry.

    torchdata's ``StatefulDataLoader`` in small (chapter 05's ``ResumableSampler`` pattern):
    ``state_dict()`` is the epoch and how many samples of it the whole job (every
    data-parallel rank) has trained on; ``load_state_dict`` points the sampler there, and the
    next ``iter`` yields the rest of that epoch, then the loader moves to the next epoch. The
    position counts global samples, so a checkpoint resumes at another data-parallel size:
    each rank skips its share of them.
    """

    def __init__(self, loader: DataLoader, sampler: ResumableSampler, batch_size: int, dp_size: int):
        self.loader, self.sampler, self.batch_size, self.dp_size = loader, sampler, batch_size, dp_size
        self.epoch, self.batches = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples": self.batches * self.batch_size * self.dp_size}

    def load_state_dict(self, state: dict) -> None:
        global_batch = self.batch_size * self.dp_size
        if state["samples"] % global_batch:
            raise ValueError(
                f"the checkpoint's loader stands at sample {state['samples']} of its epoch, not a multiple of "
                f"this run's global batch ({global_batch}): resume with the global batch that wrote it"
            )
        self.epoch, self.batches = int(state["epoch"]), int(state["samples"]) // global_batch

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)  # the epoch's shuffled order ...
        self.sampler.skip = self.batches * self.batch_size  # ... minus what this rank has trained on
        for batch in self.loader:
            self.batches += 1
            yield batch
        self.epoch, self.batches = self.epoch + 1, 0


def make_loader(args, dataset: Windows, dp_size: int, dp_rank: int, device: torch.device):
    """The training windows for this rank: (sampler, its stateful loader, steps per epoch)."""
    # Every rank of one tp group reads the same samples: the sampler shards over "dp" only.
    sampler = ResumableSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True
    )
    per_epoch = len(sampler) // args.batch_size
    if per_epoch < 1:
        raise ValueError(f"{len(dataset)} windows give no batch of {args.batch_size} on each of {dp_size} ranks")
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,  # the workers outlive an epoch: no restart cost each epoch
        pin_memory=device.type == "cuda",  # page-locked buffers: the copy to the GPU can be asynchronous
    )
    return sampler, StatefulLoader(loader, sampler, args.batch_size, dp_size), per_epoch
