"""Chapter 12: a small GPT trained on the course's own text, from the first step to a sample.

    python -m distcourse.capstone                                        # one process
    torchrun --standalone --nproc-per-node 2 -m distcourse.capstone      # FSDP2 over 2 ranks
    torchrun --standalone --nproc-per-node 4 -m distcourse.capstone --tp 2   # (dp 2, tp 2) mesh
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:PORT -m distcourse.capstone             # on each of two nodes
    sbatch code/distcourse/scripts/slurm_train.sbatch -m distcourse.capstone --steps 5000   # SLURM

One job, chosen by the launcher's flags: like chapter 07's ``train.py`` it runs distributed
when the launcher set ``RANK``. It is also a rank function: ``launch(capstone.main, 4,
args=(argv,))`` runs it on ranks whose process group is already initialised.

The job is split the way torchtitan splits its trainer, one file per part a reader looks for:

- ``config.py``: every flag (torchtitan's job config);
- ``data.py``: the corpus, its windows, a ``DataLoader`` with workers over a sampler that
  resumes mid-epoch;
- ``parallelize.py``: the GPT on a (dp, tp) mesh (TP, activation checkpointing, FSDP2, in that
  order) and its precision;
- ``model.py``: the loss, and sampling text from the trained model;
- ``checkpointing.py``: asynchronous DCP saves, exact resume, resharding on load, the export;
- ``metrics.py``: rank 0's logs, the tagged lines code reads back, ``metrics.jsonl``;
- ``train.py``: the loop (``main``, ``setup``, ``train_step``, evaluation);
- ``__main__.py``: ``python -m distcourse.capstone``.

Its sentences are in the reader's language (``DISTCOURSE_LANG`` for the program, the
notebook's for ``launch``); what code reads back has a line of its own, a fixed tag and
JSON, in every language: ``result {...}``, ``resume {...}``, ``kill {...}``.
"""

from __future__ import annotations

from .checkpointing import checkpoint_dir, export, latest_complete, load_state, loaded_model, save, state_of
from .config import COURSE_CHAPTERS, VOCAB, parse_args
from .data import ResumableSampler, Windows, corpus_text, make_loader, split_corpus, start_at, step_samples
from .metrics import flush, read_metrics, tag
from .model import generate, gpt, loss_of
from .parallelize import autocast, build_model, checkpoint_blocks
from .train import deterministic, main, resume_resharded

__all__ = [
    "COURSE_CHAPTERS",
    "VOCAB",
    "ResumableSampler",
    "Windows",
    "autocast",
    "build_model",
    "checkpoint_blocks",
    "checkpoint_dir",
    "corpus_text",
    "deterministic",
    "export",
    "flush",
    "generate",
    "gpt",
    "latest_complete",
    "load_state",
    "loaded_model",
    "loss_of",
    "main",
    "make_loader",
    "parse_args",
    "read_metrics",
    "resume_resharded",
    "save",
    "split_corpus",
    "start_at",
    "state_of",
    "step_samples",
    "tag",
]
