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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

Values = torch.Tensor | float | int | Iterable | Mapping


def _tensors(values: Values) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values.detach().to("cpu", torch.float64)]
    if isinstance(values, (float, int)):
        return [torch.tensor(float(values), dtype=torch.float64)]
    if isinstance(values, Mapping):
        return [t for key in sorted(values, key=str) for t in _tensors(values[key])]
    return [t for value in values for t in _tensors(value)]


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
    tensors = [t for t in _tensors(values) if t.numel()]
    return max((t.abs().max().item() for t in tensors), default=0.0)


def gap(actual: Values, expected: Values) -> float:
    """The largest absolute difference between two structures of the same shape."""
    pairs = list(zip(_tensors(actual), _tensors(expected), strict=True))
    return max(((a - e).abs().max().item() for a, e in pairs if e.numel()), default=0.0)


def relative_gap(actual: Values, expected: Values) -> float:
    """:func:`gap` divided by the expected values' :func:`magnitude` (0 when both are 0)."""
    scale = magnitude(expected)
    difference = gap(actual, expected)
    return difference / scale if scale else (math.inf if difference else 0.0)


def close(actual: Values, expected: Values, *, terms: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``actual`` equals ``expected`` up to the rounding of sums of ``terms`` terms in ``dtype``.

    The bound is relative to the expected values' largest magnitude, so a gradient of
    size 1e-3 and a loss of size 3 are held to the same number of correct digits.
    """
    return relative_gap(actual, expected) <= rounding_bound(dtype, terms)


def assert_close(actual: Values, expected: Values, *, terms: int, dtype: torch.dtype = torch.float32, what=""):
    """:func:`close`, raising an ``AssertionError`` that shows the gap and the bound."""
    ratio, bound = relative_gap(actual, expected), rounding_bound(dtype, terms)
    if not ratio <= bound:
        label = f"{what}: " if what else ""
        raise AssertionError(
            f"{label}relative gap {ratio:.3g} exceeds the rounding bound {bound:.3g} "
            f"({terms} terms in {dtype}; largest expected magnitude {magnitude(expected):.3g})"
        )
