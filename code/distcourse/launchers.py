"""Launchers of chapter 07 without a cluster: a SLURM batch script run against stand-ins for
``srun``/``scontrol``, its ``#SBATCH`` options, and the command line torchrun (or the older
``torch.distributed.launch``) hands each worker.

Builds on: ``common/subprocesses.py`` (starting torchrun agents, used next to these in the chapter).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

# --------------------------------------------------------------------------------------
# SLURM: what a batch script would run, without a cluster
# --------------------------------------------------------------------------------------

SLURM_SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "slurm_train.sbatch"


def sbatch_options(script=SLURM_SCRIPT) -> dict[str, str]:
    """The ``#SBATCH --name=value`` lines of a batch script, as {name: value}."""
    options = {}
    for line in pathlib.Path(script).read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            options[m.group(1)] = m.group(2) or ""
    return options


def slurm_dry_run(
    script=SLURM_SCRIPT,
    nodes=("node-a", "node-b"),
    job_id: str = "4242",
    timeout: float = 10,
    srun_env: dict | None = None,
    args=(),
) -> list[list[str]]:
    """Run the batch script with stand-ins for ``scontrol`` and ``srun``; return srun's argument lists.

    ``args``: what follows the script's name on the ``sbatch`` command line.
    The stand-ins answer ``scontrol show hostnames`` with ``nodes`` and record every srun
    call instead of starting anything, so the test sees the exact commands a cluster would get.
    ``srun_env``: a dict whose keys name variables; filled with their values as srun saw them
    (None where unset), i.e. what the script exported for srun and torchrun. The script sees
    no SLURM_*/SRUN_* variable but the stand-ins' (not even inside a real job), so a
    variable the script forgets to export is missing here too.
    """
    options = sbatch_options(script)
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir, log = pathlib.Path(tmp, "bin"), pathlib.Path(tmp, "srun.jsonl")
        bin_dir.mkdir()
        _stub(
            bin_dir / "scontrol",
            'if sys.argv[1:3] == ["show", "hostnames"]:\n    print("\\n".join(os.environ["FAKE_NODES"].split(",")))',
        )
        _stub(
            bin_dir / "srun",
            'with open(os.environ["FAKE_SRUN_LOG"], "a") as f:\n'
            '    f.write(json.dumps([sys.argv[1:], dict(os.environ)]) + "\\n")',
        )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))},
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "FAKE_NODES": ",".join(nodes),
            "FAKE_SRUN_LOG": str(log),
            "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NODELIST": ",".join(nodes),
            "SLURM_NNODES": str(len(nodes)),
            "SLURM_CPUS_PER_TASK": options.get("cpus-per-task", "1"),
            "CKPT_DIR": str(pathlib.Path(tmp, "ckpt")),
        }
        subprocess.run(
            ["bash", str(script), *map(str, args)],
            env=env,
            cwd=tmp,
            check=True,
            timeout=timeout,
            capture_output=True,
            text=True,
        )
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        for name in srun_env or {}:
            srun_env[name] = calls[-1][1].get(name) if calls else None
        return [argv for argv, _ in calls]


def _stub(path: pathlib.Path, body: str) -> None:
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n{body}\n")
    path.chmod(0o755)


# --------------------------------------------------------------------------------------
# What a launcher hands its workers, computed without starting anything
# --------------------------------------------------------------------------------------


def worker_command(launcher: str, launcher_args: list[str], local_rank: int = 0) -> list[str]:
    """The argument list that ``launcher`` ("torchrun" or "torch.distributed.launch") gives a worker.

    Uses the launchers' own parsing code (``config_from_args``), so what this returns is
    what they would run, for the installed torch version.
    """
    from torch.distributed import launch
    from torch.distributed import run as torchrun_module
    from torch.distributed.elastic.utils import macros

    parse = {"torchrun": torchrun_module.parse_args, "torch.distributed.launch": launch.parse_args}[launcher]
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # config_from_args would set it (and print a banner) otherwise
    try:
        _, program, args = torchrun_module.config_from_args(parse(launcher_args))
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    program = os.path.basename(program) if isinstance(program, str) else program.__name__
    return [program, *macros.substitute(list(args), str(local_rank))]
