"""The benchmarks' one statistic of uncertainty: a seeded 95% bootstrap interval, and its verdict.

A benchmark on this shared machine measures in pairs (baseline and Transom, alternating) and the
pairs scatter: a mean over a few pairs says little without its interval. `interval` resamples
the samples (values or pairs) with replacement, computes the statistic of each resample and
returns the 2.5th and 97.5th percentiles; with few samples it is narrower than the truth (with 3
it spans at most the samples' range), so read it as the least uncertainty there is. `verdict`
says whether an interval shows a target met, missed, or neither.

This module never measures anything and never reads the clock: same samples, same interval.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

RESAMPLES = 10_000


def interval(
    samples: Sequence[Any],
    statistic: Callable[[list[Any]], float] = statistics.fmean,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> tuple[float, float]:
    """95% bootstrap interval of `statistic` over `samples` (both ends the value itself for one
    sample)."""
    if not samples:
        raise ValueError("no samples")
    rng = random.Random(seed)
    values = sorted(statistic(rng.choices(list(samples), k=len(samples))) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def verdict(low: float, high: float, target: float, at_least: bool) -> str:
    """'met', 'missed' or 'not shown either way': whether [low, high] lies wholly on the target's
    good side (at or above it if `at_least`, else below it) or wholly on its bad side."""
    good = low >= target if at_least else high < target
    bad = high < target if at_least else low >= target
    return "met" if good else "missed" if bad else "not shown either way"
