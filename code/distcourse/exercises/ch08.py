"""Self-check for the exercise of chapter 08: the largest model a ZeRO stage fits on a GPU.

The learner writes ``max_params(gpu_bytes, world_size, stage)``: the largest number of
parameters whose model states (mixed-precision Adam, 16 bytes per parameter, sharded
according to the ZeRO stage) fit in ``gpu_bytes`` on each of ``world_size`` GPUs.
Activations and buffers are left out, as in the chapter.
"""

from __future__ import annotations

from ..common.memory import MIXED_ADAM, zero_bytes
from ..runtime.i18n import number, tr

# (GPU memory in bytes, number of GPUs, ZeRO stage)
CASES = [
    (80e9, 1, 0),
    (80e9, 8, 0),
    (80e9, 8, 1),
    (80e9, 8, 2),
    (80e9, 8, 3),
    (24e9, 4, 1),
    (24e9, 4, 2),
    (24e9, 4, 3),
    (40e9, 64, 1),
    (16e9, 2, 3),
]
STAGE_NAMES = {0: "stage 0 (plain DDP)", 1: "stage 1", 2: "stage 2", 3: "stage 3 (FSDP)"}


def _stage_name(stage: int) -> str:
    """STAGE_NAMES[stage] in the notebook's language."""
    return {
        0: tr("stage 0 (plain DDP)"),
        1: tr("stage {s}").format(s=1),
        2: tr("stage {s}").format(s=2),
        3: tr("stage 3 (FSDP)"),
    }[stage]


def _per_rank(num_params: int, world_size: int, stage: int) -> float:
    return sum(zero_bytes(num_params, world_size, stage, MIXED_ADAM).values())


def _fits_exactly(answer, gpu_bytes: float, world_size: int, stage: int) -> bool:
    """``answer`` parameters fit, and one more would not (so no rounding puzzles)."""
    return _per_rank(answer, world_size, stage) <= gpu_bytes and _per_rank(answer + 1, world_size, stage) > gpu_bytes


def check_max_params(max_params) -> bool:
    """Run the learner's function on every case; print what is wrong, or that it is correct."""
    problems = []
    for gpu_bytes, world_size, stage in CASES:
        try:
            answer = max_params(gpu_bytes, world_size, stage)
        except Exception as exc:  # the learner's code: report, do not crash the notebook
            problems.append(
                tr("{call} raised {error}").format(
                    call=f"max_params({gpu_bytes:.0e}, {world_size}, {stage})", error=repr(exc)
                )
            )
            continue
        if answer is None:
            print(tr("Not yet: my_max_params returns None. Replace `pass` with your formula."))
            return False
        if not isinstance(answer, int) or isinstance(answer, bool):
            problems.append(
                tr("{call} returned {value}: a number of parameters is a whole number (use int(...) or //)").format(
                    call=f"max_params({gpu_bytes:.0e}, {world_size}, {stage})", value=repr(answer)
                )
            )
            continue
        if not _fits_exactly(answer, gpu_bytes, world_size, stage):
            too_many = _per_rank(answer, world_size, stage) > gpu_bytes
            verdict = (
                tr("{answer} parameters are too many: they do not fit")
                if too_many
                else tr("{answer} parameters are too few: more would fit")
            ).format(answer=number(answer))
            problems.append(
                tr(
                    "{gpus} GPU(s) of {gb} GB, ZeRO {stage}: {verdict} "
                    "(which of the 2 + 2 + 12 bytes are divided by the number of GPUs at this stage?)"
                ).format(gpus=world_size, gb=number(gpu_bytes / 1e9), stage=_stage_name(stage), verdict=verdict)
            )
    if problems:
        print(tr("Not yet:") + "\n  " + "\n  ".join(problems[:4]) + ("\n  ..." if len(problems) > 4 else ""))
        return False
    print(tr("Correct: all {n} cases fit exactly (and one more parameter would not).").format(n=len(CASES)))
    return True
