"""The job's configuration: every flag of ``python -m distcourse.capstone``, checked before anything starts.

torchtitan reads a ``JobConfig`` from a TOML file; here one ``argparse`` parser plays that part.
The flags are the job's whole configuration: the same command line runs it as one process,
under torchrun, on two nodes or under SLURM.
"""

from __future__ import annotations

import argparse
import pathlib

COURSE_CHAPTERS = pathlib.Path(__file__).resolve().parents[3] / "chapters" / "en"
VOCAB = 256  # bytes: no tokenizer to train or ship, and any text in any language is valid input
DESCRIPTION = "Chapter 12: a small GPT trained on the course's own text, from the first step to a sample."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--corpus", type=pathlib.Path, default=COURSE_CHAPTERS, help="a text file, or a folder of them")
    p.add_argument("--held-out", type=float, default=0.1, help="the last fraction of the corpus, for evaluation only")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank and step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-windows", type=int, help="train on the first N windows only (short epochs)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per model replica (a 2-D mesh)")
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="auto: the GPU profile decides (bf16 on bf16 tensor cores, else fp16 with a loss scaler); fp32 on a CPU",
    )
    p.add_argument(
        "--max-norm", type=float, default=1.0, help="clip the gradients' total 2-norm to this (0: no clipping)"
    )
    p.add_argument(
        "--warmup", type=int, default=5, help="steps of linear learning-rate warm-up, then cosine to --steps"
    )
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decay, on the linear layers' weights only")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic GPU kernels (torch.use_deterministic_algorithms): bitwise-equal reruns and resumes",
    )
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss logs (one sync of the GPU each)")
    p.add_argument("--ckpt-dir", type=pathlib.Path, help="save here every --save-every steps; resume from it")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--sync-save", action="store_true", help="wait for each checkpoint (default: async_save)")
    p.add_argument(
        "--background-staging", action="store_true", help="async_save copies to CPU memory in the background too"
    )
    p.add_argument("--out", type=pathlib.Path, help="rank 0 writes metrics.jsonl, final.pt and sample.txt here")
    p.add_argument("--sample-bytes", type=int, default=160)
    p.add_argument("--prompt", default="Distributed training ")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="tqdm bar on rank 0")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    p.add_argument("--kill-at", type=int, help="attempt 0: SIGKILL the last rank at this step, after the saves begun")
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "steps", "tp", "save_every", "log_every", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.max_norm < 0 or args.weight_decay < 0:
        p.error("--warmup, --max-norm and --weight-decay cannot be negative")
    return args
