"""benchmarks/stats.py: the bootstrap interval and the verdict it gives a target."""

from __future__ import annotations

import statistics

import pytest

from benchmarks import stats


def test_interval_lies_within_the_samples_and_around_the_mean():
    values = [0.88, 0.95, 0.99, 1.02, 0.97]
    low, high = stats.interval(values)
    assert min(values) <= low < statistics.fmean(values) < high <= max(values)


def test_interval_is_the_same_for_the_same_samples_and_seed():
    values = [1.0, 2.0, 3.0, 5.0]
    assert stats.interval(values) == stats.interval(values)


def test_interval_of_one_sample_or_equal_ones_is_that_value():
    assert stats.interval([0.97]) == (0.97, 0.97)
    assert stats.interval([2.0, 2.0, 2.0]) == (2.0, 2.0)


def test_interval_takes_any_statistic_of_any_samples():
    pairs = [(2.0, 1.0), (4.0, 2.0), (6.0, 3.0)]  # every ratio of sums is 2
    ratio = lambda ps: sum(a for a, _ in ps) / sum(b for _, b in ps)  # noqa: E731
    assert stats.interval(pairs, ratio) == pytest.approx((2.0, 2.0))


def test_interval_without_samples_is_an_error():
    with pytest.raises(ValueError, match="no samples"):
        stats.interval([])


@pytest.mark.parametrize(
    ("low", "high", "target", "at_least", "verdict"),
    [
        (0.97, 1.01, 0.97, True, "met"),
        (0.90, 0.96, 0.97, True, "missed"),
        (0.95, 0.99, 0.97, True, "not shown either way"),
        (1.2, 1.9, 2.0, False, "met"),
        (2.0, 2.5, 2.0, False, "missed"),
        (1.5, 2.5, 2.0, False, "not shown either way"),
    ],
)
def test_verdict(low, high, target, at_least, verdict):
    assert stats.verdict(low, high, target, at_least) == verdict
