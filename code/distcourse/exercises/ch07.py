"""Self-checks for the exercises of chapter 07: global ranks, and a torchrun command line.

Both run in the notebook's own process and start nothing: the command line is parsed
with torchrun's own argument parser, exactly as ``torchrun`` would read it.
"""

from __future__ import annotations

import contextlib
import io
import shlex

from ..runtime.i18n import tr
from . import verdict

# (node_rank, local_rank, nproc_per_node) -> global rank, as torchrun numbers workers
# when every node runs the same number of them.
_RANK_CASES = [(0, 0, 1), (1, 0, 1), (0, 3, 4), (1, 0, 4), (1, 3, 4), (2, 1, 4), (3, 7, 8), (5, 2, 3)]


def check_global_rank(global_rank) -> bool:
    """Exercise: ``global_rank(node_rank, local_rank, nproc_per_node)``."""
    problems = []
    for node, local, nproc in _RANK_CASES:
        expected = node * nproc + local
        try:
            got = global_rank(node, local, nproc)
        except Exception as exc:
            problems.append(
                tr("{call} raised {error}").format(call=f"global_rank({node}, {local}, {nproc})", error=repr(exc))
            )
            continue
        if got != expected:
            problems.append(
                tr("{call} returned {value}").format(call=f"global_rank({node}, {local}, {nproc})", value=repr(got))
            )
    if not problems:  # every worker of a 3-node x 4-process job gets its own rank 0..11
        ranks = sorted(global_rank(n, local, 4) for n in range(3) for local in range(4))
        if ranks != list(range(12)):
            problems.append(tr("3 nodes x 4 processes give ranks {ranks}, not 0..11 once each").format(ranks=ranks))
    return verdict(problems[:4], tr("Correct: node rank times processes per node, plus the local rank."))


# The cluster of the command-line exercise.
LAYOUT = {"nodes": 4, "gpus_per_node": 8, "head_node": "gpu-node-01", "port": 29500, "job_id": "777"}


def check_torchrun_command(command: str) -> bool:
    """Exercise: the torchrun command to run on every node of LAYOUT, for ``-m distcourse.train``."""
    from torch.distributed.run import get_args_parser

    problems = []
    words = shlex.split(command or "")
    if not words:
        print(tr("Not yet:") + "\n  - " + tr("my_command is empty: write the torchrun command line there"))
        return False
    if words[:3] == ["python", "-m", "torch.distributed.run"]:
        words = ["torchrun"] + words[3:]
    if not words or words[0] != "torchrun":
        print(tr("Not yet:") + "\n  - " + tr("the command should start with torchrun"))
        return False
    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):  # argparse reports errors there, then exits
            args = get_args_parser().parse_args(words[1:])
    except SystemExit:
        error = (message.getvalue().strip().splitlines() or ["?"])[-1]
        print(tr("Not yet:") + "\n  - " + tr("torchrun cannot parse these arguments: {error}").format(error=error))
        return False
    want = {
        "--nnodes": (args.nnodes, str(LAYOUT["nodes"])),
        "--nproc-per-node": (args.nproc_per_node, str(LAYOUT["gpus_per_node"])),
        "--rdzv-backend": (args.rdzv_backend, "c10d"),
        "--rdzv-endpoint": (args.rdzv_endpoint, f"{LAYOUT['head_node']}:{LAYOUT['port']}"),
        "--rdzv-id": (args.rdzv_id, LAYOUT["job_id"]),
    }
    for flag, (got, expected) in want.items():
        if got != expected:
            problems.append(
                tr("{flag} is {got}, expected {expected}").format(flag=flag, got=repr(got), expected=repr(expected))
            )
    if args.standalone:
        problems.append(tr("--standalone runs a single-node job: it ignores the rendezvous you need here"))
    if not (args.module and args.training_script == "distcourse.train"):
        problems.append(tr("run the module with -m distcourse.train (after the torchrun options)"))
    return verdict(problems, tr("Correct: the same command on all 4 nodes; the rendezvous assigns node ranks."))
