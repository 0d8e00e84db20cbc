"""Batch-size planning: what a batch of n draws buys, in a normal approximation.

A batch mean of n draws has bias b = E[f] − KL and standard deviation σ/√n.
"""
from __future__ import annotations

import math

from scipy import stats

Z95 = stats.norm.ppf(0.975)


def prob_within(bias: float, std: float, true: float, n: float, rel: float = 0.1) -> float:
    """P(|batch mean − true| ≤ rel·|true|) for a batch of n draws (normal approximation)."""
    tol = rel * abs(true)
    if std == 0:
        return 1.0 if abs(bias) <= tol else 0.0
    s = std / math.sqrt(n)
    return float(stats.norm.cdf((tol - bias) / s) - stats.norm.cdf((-tol - bias) / s))


def n_for_rel_error(bias: float, std: float, true: float, rel: float = 0.1, prob: float = 0.95) -> float:
    """Smallest n with P(|batch mean − true| ≤ rel·|true|) ≥ prob. inf when the bias alone exceeds
    the tolerance (no batch size helps), when std is infinite, or when true is 0 or infinite."""
    if not (math.isfinite(true) and true != 0 and math.isfinite(bias) and math.isfinite(std)):
        return math.inf
    tol = rel * abs(true)
    if abs(bias) >= tol:
        return math.inf
    if std == 0:
        return 1.0
    if prob_within(bias, std, true, 1, rel) >= prob:
        return 1.0
    lo, hi = 1.0, 2.0
    while prob_within(bias, std, true, hi, rel) < prob:
        lo, hi = hi, hi * 2
        if hi > 1e30:
            return math.inf
    while hi - lo > 1:          # P is increasing in n: bisect on integers
        mid = math.floor((lo + hi) / 2)
        lo, hi = (mid, hi) if prob_within(bias, std, true, mid, rel) < prob else (lo, mid)
    return float(hi)


def rmse(bias: float, std: float, n: int) -> float:
    """Root-mean-square error of a batch mean of n draws: √(b² + σ²/n)."""
    if not (math.isfinite(bias) and math.isfinite(std)):
        return math.inf
    return math.sqrt(bias * bias + std * std / n)
