"""The rounding bound of ``common.numerics``: it accepts reordered sums and catches real differences."""

import numpy as np
import pytest
import torch

from distcourse.common import numerics

pytestmark = pytest.mark.numerics

N = 10**5


def two_orders(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    """One float32 sum of ``n`` positive terms, added front to back and back to front."""
    x = torch.rand(n, generator=torch.Generator().manual_seed(0)).numpy()
    # numpy's float32 cumsum adds one term at a time, in order (torch's accumulates in float64)
    return torch.tensor(np.cumsum(x)[-1]), torch.tensor(np.cumsum(x[::-1])[-1])


def test_a_reordered_sum_passes_with_its_length_and_fails_without():
    forward, backward = two_orders()
    exact = torch.rand(N, generator=torch.Generator().manual_seed(0)).double().sum()
    assert numerics.relative_gap(forward, exact) <= numerics.rounding_bound(torch.float32, N)  # Higham's bound holds
    assert numerics.relative_gap(forward, backward) > numerics.rounding_bound(torch.float32, 1)  # the gap is real
    assert numerics.close(forward, backward, terms=N)
    assert not numerics.close(forward, backward, terms=1)
    numerics.assert_close(forward, backward, terms=N)
    with pytest.raises(AssertionError, match="sum of 1e5 terms: relative gap .* exceeds the rounding bound"):
        numerics.assert_close(forward, backward, terms=1, what="sum of 1e5 terms")


def test_a_real_difference_is_caught_even_with_a_generous_count():
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    wrong = weights.clone()
    wrong[3, 5] += 1e-3 * weights.abs().max()  # a bug a thousand times smaller than the values
    assert numerics.close(weights, weights.clone(), terms=1)
    assert not numerics.close(wrong, weights, terms=64 * 64)


def test_the_bound_is_relative_to_the_magnitude_and_grows_with_the_dtype():
    forward, backward = two_orders()
    for scale in (1e-6, 1.0, 1e6):  # the verdict does not depend on the units
        assert numerics.close(forward * scale, backward * scale, terms=N)
        assert not numerics.close(forward * scale, backward * scale, terms=1)
    assert numerics.rounding_bound(torch.float32, 1) == 16 * 2**-24  # at least 16 u
    assert numerics.rounding_bound(torch.float32, 1000) == 1000 * 2**-24
    assert numerics.rounding_bound(torch.bfloat16, 1000) == 1000 * 2**-8
    assert numerics.rounding_bound(torch.float64, 1000) == 1000 * 2**-53
    with pytest.raises(ValueError, match="at least 1"):
        numerics.rounding_bound(torch.float32, 0)


def test_structures_are_compared_leaf_by_leaf_without_broadcasting():
    a = {"w": torch.ones(2, 3), "b": [torch.zeros(3), 2.0]}
    assert numerics.gap(a, {"w": torch.ones(2, 3), "b": [torch.zeros(3), 2.5]}) == 0.5
    assert numerics.magnitude(a) == 2.0
    assert numerics.relative_gap(0.0, 0.0) == 0.0 and numerics.relative_gap(1.0, 0.0) == float("inf")
    with pytest.raises(ValueError, match="shapes differ"):
        numerics.gap(torch.ones(3, 1), torch.ones(3))
    with pytest.raises(ValueError, match="different keys"):
        numerics.gap({"w": 1.0}, {"v": 1.0})
    with pytest.raises(ValueError, match="2 values vs 3"):
        numerics.gap([1.0, 2.0], [1.0, 2.0, 3.0])


def test_nan_never_passes():
    assert not numerics.close(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), terms=N)
    with pytest.raises(AssertionError):
        numerics.assert_close(torch.tensor(float("nan")), torch.tensor(1.0), terms=N)


def test_every_check_can_be_logged_with_its_gap_and_bound(tmp_path, monkeypatch):
    log = tmp_path / "numerics.tsv"
    monkeypatch.setenv("DISTCOURSE_NUMERICS_LOG", str(log))
    numerics.assert_close(torch.ones(3), torch.ones(3), terms=100, what="ones")
    assert not numerics.close(2.0, 1.0, terms=1)
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert [(line[3], line[5]) for line in lines] == [("100", "ones"), ("1", "")]
    assert float(lines[0][0]) == 0.0 and float(lines[1][1]) == 1.0  # gap / bound, then the relative gap
