"""Self-checks for the exercises of chapter 11.

Part 1: ``who_is_behind(last_seq)`` names the ranks whose last flight-recorder sequence number
is lower than the others'. The check records real ranks (4 processes, ranks 1 and 3 skip the
last collective) and asks about the whole group and about subsets of its ranks.

Part 2: ``find_slow_rank(per_rank)`` names the straggler from per-rank timings gathered in a
real run (one rank, picked at random, loads its data more slowly).
"""

from __future__ import annotations

import random

from ..debugging import behind, flight_recorder
from ..profiling import straggler_times
from ..runtime.i18n import tr
from ..runtime.launcher import launch
from . import verdict


def check_who_is_behind(who_is_behind) -> bool:
    """Compare the learner's answer with what the flight records of real ranks show."""
    # gloo on every machine, as in the chapter: the demo dumps gloo's records itself
    records = list(launch(flight_recorder, world_size=4, kwargs={"skip": [1, 3]}, backend="gloo", quiet=True))
    (group,) = behind(records)
    last = behind(records)[group]["last seq per rank"]
    problems = []
    for ranks in ([0, 1, 2, 3], [0, 1], [0, 2], [1, 3], [0, 1, 3]):
        case = {r: last[r] for r in ranks}
        expected = behind([records[r] for r in ranks])[group]["behind"]
        try:
            answer = who_is_behind(dict(case))
        except Exception as exc:  # the learner's code: report, do not crash the notebook
            problems.append(tr("{call} raised {error}").format(call=f"who_is_behind({case})", error=repr(exc)))
            continue
        if answer is None or list(answer) != expected:
            problems.append(
                tr("{call} = {answer}, measured {measured}").format(
                    call=f"who_is_behind({case})", answer=answer, measured=expected
                )
            )
    return verdict(problems, tr("Correct: you found the ranks that fell behind in every case."))


def check_find_slow_rank(find_slow_rank) -> bool:
    """Run 4 ranks, one of them (chosen at random) slower; the learner's function must find it."""
    slow = random.randrange(4)
    per_rank = launch(straggler_times, world_size=4, kwargs={"slow_rank": slow, "extra": 0.03}, quiet=True)[0][
        "per rank"
    ]
    try:
        answer = find_slow_rank(per_rank)
    except Exception as exc:  # the learner's code: report, do not crash the notebook
        return verdict([tr("{call} raised {error}").format(call="find_slow_rank(per_rank)", error=repr(exc))], "")
    problems = (
        []
        if answer == slow
        else [tr("find_slow_rank(per_rank) = {answer}, the slow rank was {slow}").format(answer=answer, slow=slow)]
    )
    return verdict(problems, tr("Correct: rank {slow} was the slow one.").format(slow=slow))
