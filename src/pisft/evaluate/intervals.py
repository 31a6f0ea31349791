"""Statistics for evaluation: pooled errors per episode and bootstrap confidence intervals.

Errors are accumulated per episode as (sum of errors, number of valid elements), so that a
figure over any set of episodes is the pooled mean `sum(S_e) / sum(N_e)`: every valid action
element weighs the same, whatever the episode length. The bootstrap resamples *episodes*
(frames of one episode are strongly correlated, so resampling frames would understate the
uncertainty) with a seeded generator, and pairs the two models on the same resamples, so the
interval of the ratio fine-tuned / base accounts for the episodes both models found hard.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    level: float = 0.95


def pooled_mean(sums: np.ndarray, counts: np.ndarray) -> float:
    """sum(sums) / sum(counts); NaN when nothing was counted."""
    total = float(np.sum(counts))
    return float(np.sum(sums)) / total if total > 0 else float("nan")


def bootstrap_indices(n_items: int, n_samples: int, seed: int) -> np.ndarray:
    """(n_samples, n_items) indices drawn with replacement, reproducible for a seed."""
    if n_items < 1:
        raise ValueError("bootstrap needs at least one item")
    rng = np.random.default_rng(np.random.SeedSequence([seed, n_items, n_samples]))
    return rng.integers(0, n_items, size=(n_samples, n_items))


def _percentile_interval(values: np.ndarray, level: float) -> Interval:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return Interval(float("nan"), float("nan"), level)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(values, [alpha, 1.0 - alpha])
    return Interval(float(low), float(high), level)


def bootstrap_pooled_mean(sums: np.ndarray, counts: np.ndarray, *, n_samples: int, seed: int,
                          level: float = 0.95) -> Interval:
    """Percentile interval of the pooled mean over episodes resampled with replacement."""
    sums, counts = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    idx = bootstrap_indices(len(sums), n_samples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    return _percentile_interval(means, level)


def bootstrap_paired_ratio(sums_a: np.ndarray, sums_b: np.ndarray, counts: np.ndarray, *,  # noqa: ARG001 - cancels in the ratio
                           n_samples: int, seed: int, level: float = 0.95) -> Interval:
    """Interval of pooled_mean(b) / pooled_mean(a), both models on the same resampled episodes.

    `counts` is shared: both models are scored on the same frames and valid steps.
    """
    sums_a = np.asarray(sums_a, dtype=np.float64)
    sums_b = np.asarray(sums_b, dtype=np.float64)
    idx = bootstrap_indices(len(sums_a), n_samples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = sums_b[idx].sum(axis=1) / sums_a[idx].sum(axis=1)
    return _percentile_interval(ratios, level)


def wilson_interval(successes: int, trials: int, level: float = 0.95) -> Interval:
    """Wilson score interval of a success rate (closed-loop evaluation): unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n successes, which is what
    a handful of trials per task gives."""
    if trials < 1:
        return Interval(float("nan"), float("nan"), level)
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    p = successes / trials
    denom = 1.0 + z * z / trials
    center = (p + z * z / (2 * trials)) / denom
    half = z * np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return Interval(float(max(0.0, center - half)), float(min(1.0, center + half)), level)


def success_fields(successes: int, trials: int, level: float = 0.95) -> dict:
    """A success rate and its Wilson interval as scalars (`success_rate`, `success_rate_ci_low/_high`, as
    `dvc metrics diff` compares them); None when there were no trials."""
    ci = wilson_interval(successes, trials, level) if trials else None
    return {"success_rate": successes / trials if trials else None,
            "success_rate_ci_low": ci.low if ci else None, "success_rate_ci_high": ci.high if ci else None}
