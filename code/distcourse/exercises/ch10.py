"""Self-check for the exercise of chapter 10: which collective a change of placement costs.

The learner writes ``collective_for(source, target)`` for placements of a 2-D tensor on a
1-D mesh ("Shard(0)", "Shard(1)", "Replicate()", "Partial()"). The check redistributes real
DTensors on 2 ranks, counts the collectives with ``CommDebugMode`` and compares.
"""

from __future__ import annotations

from ..runtime.i18n import tr
from ..runtime.launcher import launch
from ..tensor_parallel import redistribute_costs
from . import verdict

PAIRS = [
    ("Shard(0)", "Replicate()"),
    ("Shard(1)", "Replicate()"),
    ("Partial()", "Replicate()"),
    ("Partial()", "Shard(1)"),
    ("Replicate()", "Shard(1)"),
    ("Shard(1)", "Shard(0)"),
]
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", None)


def check_collective_for(collective_for) -> bool:
    """Compare the learner's answers with the collectives DTensor really issued."""
    measured = launch(redistribute_costs, world_size=2, kwargs={"pairs": PAIRS}, quiet=True)[0]
    problems = []
    for row in measured:
        call = f"collective_for({row['from']!r}, {row['to']!r})"
        try:
            answer = collective_for(row["from"], row["to"])
        except Exception as exc:  # the learner's code: report, do not crash the notebook
            problems.append(tr("{call} raised {error}").format(call=call, error=repr(exc)))
            continue
        issued = next(iter(row["collectives"]), None)
        # Shard -> another Shard is an all-to-all; on a CPU mesh DTensor all-gathers and slices instead
        right = {issued} | (
            {"all-to-all"} if row["from"].startswith("Shard") and row["to"].startswith("Shard") else set()
        )
        if answer not in KINDS:
            problems.append(
                tr("{call} returned {answer!r}: answer one of {kinds}").format(call=call, answer=answer, kinds=KINDS)
            )
        elif answer not in right:
            problems.append(
                tr("{call} = {answer!r}, DTensor issued {issued!r}").format(call=call, answer=answer, issued=issued)
            )
    return verdict(problems, tr("Correct: every change of placement costs what you said."))
