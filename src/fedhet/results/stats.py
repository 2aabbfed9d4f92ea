"""The statistics behind every table: a seed summary with its confidence interval, a paired comparison of two
methods over the seeds they share, and average ranks over several settings. All of it is scipy's; nothing here
computes a statistic by hand.

- ``seed_summary``: mean, sample std (ddof=1) and the 95 % Student t interval of the mean (``ttest_1samp``).
- ``paired_difference``: the mean of the paired differences a - b, its 95 % percentile bootstrap interval
  (``bootstrap`` with ``paired=True``, a fixed generator, so a table is the same every time it is written) and
  Wilcoxon's signed-rank two-sided p-value (``wilcoxon``; exact for the few pairs seeds give).
- ``average_ranks``: per setting, rank 1 for the best value (ties get the average of their ranks, ``rankdata``),
  then each method's mean rank over the settings it has a value in.

The percentile bootstrap (rather than scipy's default BCa) because seeds are few: with every difference equal BCa
has no interval, while the percentile interval is that difference. With n pairs the bootstrap interval is never
wider than the differences' range, so with few seeds read it beside p: Wilcoxon's smallest two-sided p-value is
2 / 2**n (0.5 for 2 pairs, 0.25 for 3, 0.0625 for 5).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
RESAMPLES = 9999
BOOTSTRAP_SEED = 0  # the bootstrap's generator: the same runs give the same table
HIGHER, LOWER = "▲", "▼"  # the paired interval lies wholly above / below 0


class SeedSummary(NamedTuple):  # a tuple, so `mean, std, low, high, n = seed_summary(values)` reads too
    mean: float | None
    std: float | None  # sample std (ddof=1); None below two values
    ci_low: float | None  # the 95 % t interval of the mean; None below two values
    ci_high: float | None
    n: int


class PairedDifference(NamedTuple):
    """a - b over n pairs; every statistic None below two pairs (one pair says nothing about spread)."""

    mean: float | None
    ci_low: float | None
    ci_high: float | None
    p: float | None  # Wilcoxon signed-rank, two-sided; None also when every difference is 0
    n: int

    @property
    def marker(self) -> str:
        """▲ when the interval lies above 0, ▼ when below, else ""."""
        if self.ci_low is not None and self.ci_low > 0:
            return HIGHER
        if self.ci_high is not None and self.ci_high < 0:
            return LOWER
        return ""


def seed_summary(values: list[float | None]) -> SeedSummary:
    """Mean, sample std and 95 % t interval of the mean of the values present (None values are left out)."""
    present = np.array([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    n = len(present)
    if n == 0:
        return SeedSummary(None, None, None, None, 0)
    mean = float(present.mean())
    if n == 1:
        return SeedSummary(mean, None, None, None, 1)
    std = float(present.std(ddof=1))
    if std == 0:  # every seed agrees: the interval is the value (the t test itself would divide by 0)
        return SeedSummary(mean, 0.0, mean, mean, n)
    with warnings.catch_warnings():  # values equal but for rounding: scipy warns, the interval is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        low, high = stats.ttest_1samp(present, 0.0).confidence_interval(CONFIDENCE)
    return SeedSummary(mean, std, finite(low), finite(high), n)


def paired_difference(a: list[float], b: list[float]) -> PairedDifference:
    """The paired comparison of ``a`` with ``b`` (equal lengths, pair i = a[i], b[i]): mean of a - b, its 95 %
    percentile bootstrap interval and Wilcoxon's two-sided p-value."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs as many values in a as in b (got {len(a)} and {len(b)})")
    n = len(a)
    if n < 2:
        return PairedDifference(None, None, None, None, n)
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        interval = stats.bootstrap(
            (x, y),
            mean_difference,
            paired=True,
            vectorized=True,
            confidence_level=CONFIDENCE,
            n_resamples=RESAMPLES,
            method="percentile",
            rng=np.random.default_rng(BOOTSTRAP_SEED),
        ).confidence_interval
        p = stats.wilcoxon(x, y).pvalue if np.any(x != y) else math.nan  # no nonzero difference: no test
    return PairedDifference(float(np.mean(x - y)), finite(interval.low), finite(interval.high), finite(p), n)


def mean_difference(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x - y, axis=axis)


def average_ranks(
    table: dict[str, dict[str, float]], lower_is_better: bool = False
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """``table``: setting -> method -> value. Returns each method's rank per setting (1 = best, ties averaged) and
    its mean rank over the settings it has a value in. NaN values are left out of the ranking."""
    ranks: dict[str, dict[str, float]] = {}
    for setting, values in table.items():
        present = {m: v for m, v in values.items() if v is not None and not math.isnan(v)}
        if not present:
            continue
        scores = np.array(list(present.values()), dtype=float)
        ranked = stats.rankdata(scores if lower_is_better else -scores, method="average")
        ranks[setting] = {m: float(r) for m, r in zip(present, ranked, strict=True)}
    methods = list(dict.fromkeys(m for values in ranks.values() for m in values))
    average = {m: float(np.mean([r[m] for r in ranks.values() if m in r])) for m in methods}
    return ranks, average


def finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
