"""How far apart two floating-point computations of the same quantity may be.

Two ranks, two processes or two kernels that compute the same sums in a different
order round differently. How much depends on the dtype and on how many terms each
sum adds, not on the machine: the classical bound for a sum of ``n`` terms is
``n * u`` times the terms' magnitude, with ``u = eps / 2`` the unit roundoff
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2).
A test that compares with a fixed ``1e-5`` passes on the CPU it was written on and
fails on one whose vectorised kernels (AVX2, AVX-512, NEON) sum in another order.

Comparisons here are relative to the magnitude of the expected values, as
``torch.testing.assert_close`` is, and the tolerance is derived, never tuned to what
one machine printed. Use exact equality only where the same kernels run on the
same inputs in the same order by construction, and say so where you do.

``terms`` counts the additions behind one compared value. Errors of successive sums add
up, so for a chain of them (a matrix product, then another) it is the sum of their
lengths: ``x W1ᵀ W2ᵀ`` sums over W1's inputs, then over W2's. A training step of an MLP
adds along its layers forward and again backward, then over the batch for the loss and
the weight gradients: ``2 * (inputs + hidden units + classes) + batch``. Rounding errors
of random signs mostly cancel (the typical error grows like the square root of the
length), so the bound leaves headroom without hiding a real mistake, which is usually
larger than ``1e-3`` of the values.

With ``DISTCOURSE_NUMERICS_LOG=<file>`` in the environment, every :func:`close` and
:func:`assert_close` appends its gap and bound to that file: how near each check comes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping

import torch

Values = torch.Tensor | float | int | Iterable | Mapping


def _pairs(actual: Values, expected: Values, where: str = "") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching leaves of two structures, as float64 CPU tensors; a different structure is an error."""
    if isinstance(expected, Mapping):
        # keys compared as text: a dict read back from JSON has "3" where the original had 3
        actual = {str(k): v for k, v in actual.items()} if isinstance(actual, Mapping) else {}
        expected = {str(k): v for k, v in expected.items()}
        if set(actual) != set(expected):
            raise ValueError(f"{where or 'values'}: different keys: {sorted(actual)} vs {sorted(expected)}")
        return [p for key in sorted(expected) for p in _pairs(actual[key], expected[key], f"{where}[{key}]")]
    if isinstance(expected, (torch.Tensor, float, int)):
        a, e = (torch.as_tensor(v).detach().to("cpu", torch.float64) for v in (actual, expected))
        if a.shape != e.shape:  # no broadcasting: a (n, 1) result is not a (n,) one
            raise ValueError(f"{where or 'values'}: shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
        return [(a, e)]
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        raise ValueError(f"{where or 'values'}: {len(actual)} values vs {len(expected)}")
    return [p for i, (a, e) in enumerate(zip(actual, expected)) for p in _pairs(a, e, f"{where}[{i}]")]


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u = eps / 2``: the largest relative error of one rounded operation in ``dtype``."""
    return torch.finfo(dtype).eps / 2


def rounding_bound(dtype: torch.dtype = torch.float32, terms: int = 1) -> float:
    """Relative difference allowed between two orders of evaluating sums of ``terms`` terms.

    ``terms * u``, the worst case of recursive summation, and at least ``16 u`` so that a
    short chain of elementwise operations (an activation, a scale) also fits.
    """
    if terms < 1:
        raise ValueError(f"terms must be at least 1, got {terms}")
    return max(16, terms) * unit_roundoff(dtype)


def magnitude(values: Values) -> float:
    """The largest absolute value among ``values`` (tensors, numbers, or lists/dicts of them)."""
    leaves = [e for _, e in _pairs(values, values) if e.numel()]
    return max((e.abs().max().item() for e in leaves), default=0.0)


def gap(actual: Values, expected: Values) -> float:
    """The largest absolute difference between two structures of the same shape (NaN counts as inf)."""
    gaps = [(a - e).abs().nan_to_num(math.inf).max().item() for a, e in _pairs(actual, expected) if e.numel()]
    return max(gaps, default=0.0)


def relative_gap(actual: Values, expected: Values) -> float:
    """:func:`gap` divided by the expected values' :func:`magnitude` (0 when both are 0)."""
    scale = magnitude(expected)
    difference = gap(actual, expected)
    return difference / scale if scale else (math.inf if difference else 0.0)


def _checked(actual: Values, expected: Values, terms: int, dtype: torch.dtype, what: str) -> tuple[float, float]:
    """The relative gap and the bound; appended to ``$DISTCOURSE_NUMERICS_LOG`` when it is set."""
    relative, bound = relative_gap(actual, expected), rounding_bound(dtype, terms)
    if path := os.environ.get("DISTCOURSE_NUMERICS_LOG"):
        with open(path, "a") as log:
            log.write(f"{relative / bound:.3g}\t{relative:.3g}\t{bound:.3g}\t{terms}\t{dtype}\t{what}\n")
    return relative, bound


def close(actual: Values, expected: Values, *, terms: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``actual`` equals ``expected`` up to the rounding of sums of ``terms`` terms in ``dtype``.

    The bound is relative to the expected values' largest magnitude, so a gradient of
    size 1e-3 and a loss of size 3 are held to the same number of correct digits.
    """
    relative, bound = _checked(actual, expected, terms, dtype, "")
    return relative <= bound


def assert_close(actual: Values, expected: Values, *, terms: int, dtype: torch.dtype = torch.float32, what=""):
    """:func:`close`, raising an ``AssertionError`` that shows the gap and the bound."""
    relative, bound = _checked(actual, expected, terms, dtype, what)
    if not relative <= bound:
        label = f"{what}: " if what else ""
        raise AssertionError(
            f"{label}relative gap {relative:.3g} exceeds the rounding bound {bound:.3g} "
            f"({terms} terms in {dtype}; largest expected magnitude {magnitude(expected):.3g})"
        )
