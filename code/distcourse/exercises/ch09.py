"""Self-check for the exercise of chapter 09: the activation bytes of one transformer block.

The learner writes ``block_bytes(batch, seq, hidden, heads)``: the bytes one
``common.models.Block`` with naive attention saves for backward in fp32. The check compares
the answer with what the saved-tensor hooks *measure* on real blocks, not with a formula.
"""

from __future__ import annotations

from ..activations import measure_block
from ..runtime.i18n import tr
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
