"""The one percentile: linear between closest ranks, as numpy and statistics compute it."""

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.deploy.stats import percentile

FINITE = st.floats(-1e9, 1e9, allow_nan=False)


@given(st.lists(FINITE, min_size=2, max_size=50), st.integers(1, 99))
def test_matches_statistics_inclusive_quantiles(values, q):
    want = statistics.quantiles(values, n=100, method="inclusive")[q - 1]
    assert math.isclose(percentile(values, q / 100), want, rel_tol=1e-9, abs_tol=1e-6)


@given(st.lists(FINITE, min_size=1, max_size=50))
def test_ends_and_median(values):
    assert percentile(values, 0) == min(values) and percentile(values, 1) == max(values)
    assert math.isclose(
        percentile(values, 0.5), statistics.median(values), rel_tol=1e-9, abs_tol=1e-6
    )


def test_empty_is_nan_and_q_is_checked():
    assert math.isnan(percentile([], 0.5))
    for q in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError):
            percentile([1.0], q)
