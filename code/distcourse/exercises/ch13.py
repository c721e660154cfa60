"""Self-checks for the exercises of chapter 13.

Pipeline schedules (``13-pipeline-parallel``):

* ``check_all_gathers``: the learner predicts how many all-gathers one FSDP2 unit inside a
  pipeline stage issues in a step, from the stage's order of forwards and backwards; the check
  compares with ``pipeline_schedules.predicted_all_gathers``, whose rule the chapter checked
  against the all-gathers four ranks really issued;
* ``check_clip_scale``: the factor every stage multiplies its gradients by when clipping by
  the norm of the whole model, given each stage's own gradient norm.
"""

from __future__ import annotations

import math

from ..model_parallel import gpipe_order
from ..pipeline_schedules import one_f_one_b_order, predicted_all_gathers
from ..runtime.i18n import tr
from . import verdict


def _orders() -> list[tuple[str, list[tuple]]]:
    cases = []
    for p in (2, 3, 4):
        for m in (p, 8):
            for s in range(p):
                cases.append((f"GPipe p={p} m={m} stage {s}", [(k, s, i) for k, i in gpipe_order(s, p, m)]))
                cases.append((f"1F1B p={p} m={m} stage {s}", one_f_one_b_order(s, p, m)))
    return cases


def check_all_gathers(all_gathers) -> bool:
    """``all_gathers(order, reshard_after_forward)`` -> all-gathers of one FSDP2 unit in the step."""
    problems = []
    for name, order in _orders():
        for reshard in (True, False):
            call = f"{name}, reshard_after_forward={reshard}"
            try:
                answer = all_gathers(order, reshard)
            except Exception as exc:  # the learner's code: report, do not crash the notebook
                problems.append(tr("{call} raised {error}").format(call=call, error=repr(exc)))
                continue
            right = predicted_all_gathers(order, reshard)
            if answer != right:
                problems.append(
                    tr("{call}: you said {answer}, the rules give {right}").format(
                        call=call, answer=answer, right=right
                    )
                )
        if len(problems) > 3:
            break
    return verdict(problems[:4], tr("Correct: you predict every all-gather of a unit inside a pipeline stage."))


def check_clip_scale(clip_scale) -> bool:
    """``clip_scale(stage_norms, max_norm)`` -> the factor each stage multiplies its gradients by."""
    cases = [([0.8, 1.0], 0.5), ([3.0, 4.0], 10.0), ([0.3, 0.4, 1.2], 1.0), ([2.0], 1.0)]
    problems = []
    for norms, max_norm in cases:
        total = math.sqrt(sum(n * n for n in norms))
        right = min(1.0, max_norm / (total + 1e-6))  # clip_grads_with_norm_: max_norm / (norm + 1e-6), at most 1
        call = f"clip_scale({norms}, {max_norm})"
        try:
            answer = float(clip_scale(norms, max_norm))
        except Exception as exc:  # the learner's code
            problems.append(tr("{call} raised {error}").format(call=call, error=repr(exc)))
            continue
        if not math.isclose(answer, right, rel_tol=1e-6):
            problems.append(
                tr("{call} = {answer:.6g}, expected {right:.6g}").format(call=call, answer=answer, right=right)
            )
    return verdict(problems, tr("Correct: every stage scales by the same factor, from the norm of the whole model."))


# Experts and layouts (``13-routed-experts-and-layouts``):
#
# * ``check_switch_aux_loss``: the load-balancing loss of a group from its router probabilities and
#   chosen experts, compared with ``experts.aux_loss`` on even, random and collapsed routings;
# * ``check_dropped_choices``: the choices past their expert's capacity, compared with ``experts.route``.


def _routings():
    """(name, logits) for a group of 32 tokens and 8 experts: even first choices, random, collapsed."""
    import torch

    g = torch.Generator().manual_seed(13)
    even = torch.zeros(32, 8)
    even[torch.arange(32), torch.arange(32) % 8] = 4.0  # each expert first choice of 4 tokens
    collapsed = torch.randn(32, 8, generator=g)
    collapsed[:, 0] += 20.0
    rand = torch.randn(32, 8, generator=g) * 2
    return [(tr("even"), even), (tr("random"), rand), (tr("collapsed"), collapsed)]


def check_switch_aux_loss(switch_aux_loss) -> bool:
    """``switch_aux_loss(probs, chosen)`` -> alpha · E · sum_i f_i · P_i with alpha = 0.01."""
    from ..common.numerics import close
    from ..experts import aux_loss, route

    problems = []
    for name, logits in _routings():
        r = route(logits, top_k=2, slots=None)
        right = aux_loss(r["load"], r["probs"].sum(0), 32, 2, alpha=0.01).item()
        try:
            answer = float(switch_aux_loss(r["probs"], r["chosen"]))
        except Exception as exc:  # the learner's code: report, do not crash the notebook
            problems.append(tr("{call} raised {error}").format(call=f"switch_aux_loss ({name})", error=repr(exc)))
            continue
        if not close(answer, right, terms=32 * 8):
            problems.append(
                tr("{name} routing: you said {answer:.6g}, Switch's formula gives {right:.6g}").format(
                    name=name, answer=answer, right=right
                )
            )
    return verdict(problems, tr("Correct: your loss is Switch Transformer's, on every routing."))


def check_dropped_choices(dropped_choices) -> bool:
    """``dropped_choices(chosen, num_experts, factor)`` -> choices past their expert's capacity."""
    from ..experts import capacity, dropped, route

    problems = []
    for name, logits in _routings():
        for factor in (0.5, 1.0, 1.25, 2.0):
            r = route(logits, top_k=2, slots=capacity(32, 8, 2, factor))
            right = dropped(r["load"], capacity(32, 8, 2, factor))
            call = f"dropped_choices ({name}, factor={factor})"
            try:
                answer = int(dropped_choices(r["chosen"], 8, factor))
            except Exception as exc:  # the learner's code
                problems.append(tr("{call} raised {error}").format(call=call, error=repr(exc)))
                continue
            if answer != right:
                problems.append(tr("{call} = {answer}, expected {right}").format(call=call, answer=answer, right=right))
    return verdict(problems[:4], tr("Correct: you count every dropped choice."))
