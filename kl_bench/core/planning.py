"""Batch-size planning: what a batch of n draws buys, in a normal approximation.

A batch mean of n draws has bias b = E[f] − KL and standard deviation σ/√n.
"""
from __future__ import annotations

import math

from ..foundation.formatting import num

RMSE_SIZES = (64, 1024, 16384)


def _norm_cdf(x: float) -> float:
    from scipy import special        # imported where used: keeps `import kl_bench` fast
    return special.ndtr(x)           # stats.norm.cdf without importing scipy.stats (1 s)


def prob_within(bias: float, std: float, true: float, n: float, rel: float = 0.1) -> float:
    """P(|batch mean − true| ≤ rel·|true|) for a batch of n draws (normal approximation)."""
    tol = rel * abs(true)
    if std == 0:
        return 1.0 if abs(bias) <= tol else 0.0
    s = std / math.sqrt(n)
    return float(_norm_cdf((tol - bias) / s) - _norm_cdf((-tol - bias) / s))


def n_for_rel_error(bias: float, std: float, true: float, rel: float = 0.1, prob: float = 0.95) -> float:
    """Smallest n with P(|batch mean − true| ≤ rel·|true|) ≥ prob. inf when the bias alone exceeds
    the tolerance (no batch size helps), when std is infinite, or when true is infinite; where true is 0
    (p = q), 1 when every draw is exactly 0 (bias and std 0: any batch is exact), else inf."""
    settled = _settled(bias, std, true, rel)
    if settled is not None:
        return settled
    if prob_within(bias, std, true, 1, rel) >= prob:
        return 1.0
    lo, hi = 1.0, 2.0
    while prob_within(bias, std, true, hi, rel) < prob:
        lo, hi = hi, hi * 2
        if hi > 1e30:
            return math.inf
    while hi - lo > 1:          # P is increasing in n: bisect on integers
        mid = math.floor((lo + hi) / 2)
        if mid in (lo, hi):     # past 2^53 the midpoint no longer moves in float64: stop, never loop
            break
        lo, hi = (mid, hi) if prob_within(bias, std, true, mid, rel) < prob else (lo, mid)
    return float(hi)


def never_reason(rel_bias: float, std: float, rel: float = 0.1) -> str:
    """Why :func:`n_for_rel_error` found no batch size ("never"): the variance is infinite (no batch mean
    settles, whatever its bias), the bias alone exceeds ±rel, or the variance is finite but so large that
    the search's 10^30 draws do not reach ±rel; "" where no reason is known (NaN)."""
    if isinstance(std, (int, float)) and math.isinf(std):
        return "the variance is infinite"
    if not (isinstance(rel_bias, (int, float)) and math.isfinite(rel_bias)):
        return ""
    return f"the bias alone exceeds ±{rel:.0%}" if abs(rel_bias) > rel else "the variance needs more than 10^30 draws"


def never_words(rows, rel: float = 0.1) -> str:
    """The reasons of the "never" rows among ``rows`` (mappings with n_for_10pct, exact_rel_bias and
    exact_std; a DataFrame's rows from iterrows), joined by "or", each once: "the variance is infinite or the
    bias alone exceeds ±10%"; "" where no row is "never"."""
    words = dict.fromkeys(never_reason(num(r.get("exact_rel_bias")), num(r.get("exact_std")), rel)
                          for r in rows if math.isinf(num(r.get("n_for_10pct"))))
    return " or ".join(w for w in words if w)


def _settled(bias: float, std: float, true: float, rel: float) -> float | None:
    """The batch size where no search is needed: 1 (every draw exact: std 0 within the tolerance, or a
    truth of 0 met exactly), inf (no batch helps); None otherwise."""
    if true == 0 and bias == 0 and std == 0:
        return 1.0
    if not (math.isfinite(true) and true != 0 and math.isfinite(bias) and math.isfinite(std)) \
            or abs(bias) >= rel * abs(true):
        return math.inf
    return 1.0 if std == 0 else None


def rmse(bias: float, std: float, n: int) -> float:
    """Root-mean-square error of a batch mean of n draws: √(b² + σ²/n)."""
    if not (math.isfinite(bias) and math.isfinite(std)):
        return math.inf
    return math.sqrt(bias * bias + std * std / n)


def add_planning(row: dict, group: int = 1) -> None:
    """Fill n_for_10pct and rmse_b{64,1024,16384} of a summary row, from the exact bias and std where
    they are known, else from the measured ones. ``group``: draws per value of the row (B for a
    token-mean row: a batch of n draws holds n/B of its values; below B draws there is none)."""
    true = row["true_kl"]
    mean = row["exact_mean"] if math.isfinite(row["exact_mean"]) else row.get("mean", math.nan)
    std = row["exact_std"] if not math.isnan(row["exact_std"]) else row.get("std", math.nan)
    bias = mean - true if math.isfinite(true) else math.nan
    if math.isnan(true):            # no truth (model continuations, logged log-probs): nothing to plan for
        row["n_for_10pct"] = math.nan
        row.update({f"rmse_b{n}": math.nan for n in RMSE_SIZES})
        return
    row["n_for_10pct"] = group * n_for_rel_error(bias, std, true)
    for n in RMSE_SIZES:
        row[f"rmse_b{n}"] = rmse(bias, std, n // group) if n >= group else math.nan
