"""Self-check of chapter 06's exercise: a 1F1B schedule for any number of stages.

A function written in a notebook cannot be sent to rank processes, so the check runs the
learner's schedule on the in-process simulation of a pipeline
(:func:`distcourse.model_parallel.simulate`): forward 1 unit, backward 2 units, free
communication. A correct 1F1B order is valid (every forward and backward once, no
deadlock), keeps at most ``p - s`` micro-batches in flight on stage ``s``, and finishes as
early as GPipe.
"""

from __future__ import annotations

from ..model_parallel import check_order, gpipe_order, peak_in_flight, simulate, step_seconds
from ..runtime.i18n import number, tr

CASES = [(p, m) for p in (2, 3, 4) for m in sorted({p, p + 1, 2 * p, 8})]


def check_one_f_one_b(order) -> bool:
    """``order(stage, p, m)`` -> list of ("F", i) / ("B", i): stage ``stage``'s actions in 1F1B order."""
    for p, m in CASES:
        where = tr("with p={p} stages and m={m} micro-batches").format(p=p, m=m)
        try:
            orders = [list(order(s, p, m)) for s in range(p)]
            for s, stage_order in enumerate(orders):
                check_order(stage_order, m, s)
            events = simulate(orders)
        except Exception as exc:  # the learner's function raised, or its schedule is invalid
            print(tr("Not yet: {where}, {error}").format(where=where, error=f"{type(exc).__name__}: {exc}"))
            return False
        for s, stage_events in enumerate(events):
            if peak_in_flight(stage_events) > p - s:
                print(
                    tr(
                        "Not yet: {where}, stage {s} holds the activations of {held} "
                        "micro-batches at once; 1F1B holds at most p - s = {most}. Start backwards earlier."
                    ).format(where=where, s=s, held=peak_in_flight(stage_events), most=p - s)
                )
                return False
        gpipe = step_seconds(simulate([gpipe_order(s, p, m) for s in range(p)]))
        if step_seconds(events) > gpipe + 1e-9:
            print(
                tr(
                    "Not yet: {where}, the step takes {units} time units, GPipe only {gpipe}. "
                    "Let each stage run enough forwards before its first backward to keep the pipeline full."
                ).format(where=where, units=number(step_seconds(events)), gpipe=number(gpipe))
            )
            return False
    print(
        tr(
            "Correct: your 1F1B schedule is as fast as GPipe and keeps at most p - s micro-batches "
            "in flight on stage s, for 2 to 4 stages."
        )
    )
    return True
