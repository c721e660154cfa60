"""Self-checks for the exercises of chapter 09.

Part 1: the learner writes ``block_bytes(batch, seq, hidden, heads)``, the bytes one
``common.models.Block`` with naive attention saves for backward in fp32. The check compares
the answer with what the saved-tensor hooks *measure* on real blocks, not with a formula.

Part 2: the learner writes ``collectives(layers, micro_batches, sync, reshard_after_forward)``,
the all-gathers and reduce-scatters of one FSDP2 accumulation step. The check runs each case
on 2 ranks and counts the collectives with ``CommDebugMode``.
"""

from __future__ import annotations

from ..activations import measure_block
from ..fsdp_training import measure_collectives
from ..runtime.i18n import tr
from ..runtime.launcher import launch
from . import verdict

# (batch, sequence, hidden, heads): small enough to measure in milliseconds
CASES = [(1, 8, 16, 2), (2, 16, 32, 4), (4, 8, 32, 2), (2, 32, 16, 4), (3, 24, 48, 6)]


def check_block_bytes(block_bytes) -> bool:
    """Run the learner's function on every case; print what is wrong, or that it is correct."""
    problems = []
    for batch, seq, hidden, heads in CASES:
        call = f"block_bytes({batch}, {seq}, {hidden}, {heads})"
        try:
            answer = block_bytes(batch, seq, hidden, heads)
        except Exception as exc:  # the learner's code: report, do not crash the notebook
            problems.append(tr("{call} raised {error}").format(call=call, error=repr(exc)))
            continue
        measured = measure_block(batch, seq, hidden, heads, attention="naive")
        if answer is None:
            problems.append(tr("{call} returned None: return a number of bytes").format(call=call))
        elif answer != measured:
            gap = measured - answer
            hint = ""
            if gap == heads * batch * seq * seq * 4 + seq * seq:
                hint = tr(" (the attention scores are missing: a·b·s² values, and the s² mask)")
            elif gap == seq * seq:
                hint = tr(" (the causal mask is missing: one byte per pair of positions)")
            elif gap == 16 * batch * seq:
                hint = tr(" (the LayerNorms' mean and 1/std per token are missing)")
            problems.append(
                tr("{call} = {answer}, measured {measured}{hint}").format(
                    call=call, answer=answer, measured=measured, hint=hint
                )
            )
    return verdict(problems, tr("Correct: your formula matches the measured bytes of every block."))


# (layers, micro_batches, sync, reshard_after_forward): each runs in a few milliseconds
COLLECTIVE_CASES = [(3, 1, "every", True), (3, 2, "last", True), (4, 3, "every", False), (2, 2, "last", False)]


def check_collectives(collectives) -> bool:
    """Compare the learner's counts with collectives counted in real 2-rank FSDP2 steps."""
    cases = [dict(layers=n, micro_batches=m, sync=s, reshard_after_forward=r) for n, m, s, r in COLLECTIVE_CASES]
    measured = launch(measure_collectives, world_size=2, kwargs={"cases": cases}, quiet=True)[0]
    problems = []
    for case, counted in zip(cases, measured, strict=True):
        call = "collectives({layers}, {micro_batches}, {sync!r}, {reshard_after_forward})".format(**case)
        try:
            answer = collectives(**case)
        except Exception as exc:  # the learner's code: report, do not crash the notebook
            problems.append(tr("{call} raised {error}").format(call=call, error=repr(exc)))
            continue
        if not isinstance(answer, dict):
            problems.append(tr("{call} returned {answer!r}: return a dict").format(call=call, answer=answer))
        elif {k: answer.get(k, 0) for k in counted} != counted:
            problems.append(
                tr("{call} = {answer}, measured {measured}").format(call=call, answer=answer, measured=counted)
            )
    return verdict(problems, tr("Correct: your counts match the collectives of every measured step."))
