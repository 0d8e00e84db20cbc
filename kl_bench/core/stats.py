"""Statistics shared by the summary, the λ sweep, the gradients and the check gate: batch-means standard
errors, the batch jackknife, z scores with a rounding floor, and the heavy-tail classes.

See docs/statistics.md for the derivations.
"""
from __future__ import annotations

import math
from enum import Enum

from ..foundation.formatting import ROUNDING, count, fmt  # ROUNDING: one constant for the z scores' floor and printing


# |x| within 2^±SAFE_EXPONENT: x² (and a sum of many) is a normal float64, neither overflow nor underflow.
SAFE_EXPONENT = 500


def rescale_exponent(magnitude: float) -> int:
    """k such that values of this largest |x| divided by 2^k square without overflow or underflow: 0 (no
    scaling: the plain computation, bit for bit) within 2^±:data:`SAFE_EXPONENT`, and for 0, inf and NaN."""
    if not math.isfinite(magnitude) or magnitude == 0:
        return 0
    k = math.frexp(magnitude)[1]
    return k if abs(k) > SAFE_EXPONENT else 0


def times_two_to(x, k: int):
    """x · 2^k, exactly (a power of two), for floats, arrays and tensors alike: in two factors, since 2^k
    alone is out of float64's range past k = ±1023 while the product need not be."""
    if k == 0:
        return x
    half = k // 2
    return x * 2.0 ** half * 2.0 ** (k - half)


def mean_sd(values, ddof: int = 1):
    """(mean, standard deviation) over axis 0 of ``values`` ([n, K]) without overflow in the squares (nor in
    the sum): each column is divided by a power of two first where its largest |x| is beyond 2^±500
    (:func:`rescale_exponent`), which is exact; elsewhere the plain np.mean and np.std, bit for bit. With
    n ≤ ``ddof`` rows the standard deviation is NaN (no spread to measure), without numpy's warning."""
    import numpy as np
    x = np.asarray(values, dtype=np.float64)
    big = np.max(np.abs(x), axis=0) if x.shape[0] else np.zeros(x.shape[1:])
    k = np.vectorize(rescale_exponent, otypes=[np.int64])(big)
    scaled = np.ldexp(x, -k)
    if x.shape[0] <= ddof:
        return np.ldexp(np.mean(scaled, 0), k), np.full(x.shape[1:], np.nan)
    return np.ldexp(np.mean(scaled, 0), k), np.ldexp(np.std(scaled, 0, ddof=ddof), k)


def scaled(v):
    """(v · 2^−k, k) for a tensor: k from its largest |x| (:func:`rescale_exponent`; 0, and v itself, within
    2^±500), so that the scaled entries square, multiply and sum without overflow or underflow."""
    k = rescale_exponent(float(v.abs().max())) if v.numel() else 0
    return times_two_to(v, -k), k


def vector_norm(v) -> float:
    """‖v‖₂ of a tensor without overflow or underflow in the squares (:func:`scaled`; elsewhere the plain
    norm, bit for bit). The sum of squares stays within float64 for up to 2^24 entries of 2^500 each (a
    policy's [B, V] of up to 16M logits)."""
    x, k = scaled(v)
    return times_two_to(float(x.norm()), k)


def batch_means_se(deviations, weights):
    """Standard error of an overall mean from its batch means (docs/statistics.md#batch-means).

    ``deviations`` [K] (or [G, K] for G means at once, numpy): batch mean − overall mean; ``weights``
    [K]: n_k / N (sizes may differ). Var(mean) ≈ K/(K−1) Σ_k (n_k/N)² (m_k − m)². Works on torch
    tensors and numpy arrays; returns a float for [K], an array [G] for [G, K].
    """
    k = deviations.shape[-1]
    if deviations.ndim > 1:
        import numpy as np
        return np.sqrt(k / (k - 1) * (weights ** 2 * deviations ** 2).sum(axis=-1)) if k > 1 else \
            np.full(deviations.shape[:-1], math.nan)
    if k < 2:
        return math.nan
    return math.sqrt(k / (k - 1) * float((weights ** 2 * deviations ** 2).sum()))


def mean_and_se(sums, sizes) -> tuple[float, float]:
    """(per-draw mean, its batch-means SE) from per-batch sums [K] and batch sizes [K]."""
    n = float(sizes.sum())
    m = float(sums.sum()) / n
    return m, batch_means_se(sums / sizes - m, sizes / n)


def jackknife_se(leave_one_out) -> float:
    """Batch jackknife SE from the K leave-one-batch-out estimates: √((K−1)/K Σ (θ_i − θ̄)²)."""
    k = len(leave_one_out)
    if k < 2:
        return math.nan
    return float(math.sqrt((k - 1) / k * ((leave_one_out - leave_one_out.mean()) ** 2).sum()))


def z_score(value: float, ref: float, se: float, scale: float) -> float:
    """(value − ref)/se with float64 rounding (ROUNDING × scale) added to the standard error in
    quadrature, so that a zero-noise quantity compares equal at rounding level and never gives NaN."""
    if not (math.isfinite(value) and math.isfinite(ref)):
        return 0.0 if value == ref else math.copysign(math.inf, value - ref) if not math.isnan(value - ref) else math.nan
    se_eff = math.hypot(se if math.isfinite(se) else 0.0, ROUNDING * abs(scale))
    if se_eff == 0:
        return 0.0 if value == ref else math.copysign(math.inf, value - ref)
    return (value - ref) / se_eff


def kish_ess(sum_w: float, sum_w2: float) -> float:
    """Kish's effective sample size (Σw)²/Σw² of draws with importance weights w, from Σw and Σw²: N for
    equal weights, near 1 when one draw carries the whole sum. 0 when every weight is 0 in float64 (they
    underflowed: no draw carries anything), 0 when Σw² overflowed; NaN for NaN sums."""
    if math.isnan(sum_w) or math.isnan(sum_w2):
        return math.nan
    if sum_w2 == 0 or math.isinf(sum_w2):
        return 0.0
    return sum_w * sum_w / sum_w2


class HeavyTail(str, Enum):
    """Why a row's measured spread cannot be trusted (summary.csv's ``heavy_tail``; empty: no reason)."""
    NONE = ""
    DEGENERATE = "degenerate IS weights (ESS < batches)"
    SUPPORT_MISS = "infinite IS weight (b misses q's support)"
    INFINITE_VARIANCE = "infinite variance"
    INFINITE_FOURTH = "infinite 4th moment"
    KURTOSIS = "kurtosis > draws"
    UNSTABLE = "unstable batches"

    def __str__(self) -> str:
        return self.value

    @property
    def exact(self) -> bool:
        """Found by the exact analysis (not a heuristic on the draws): the check gate skips std comparisons."""
        return self not in (HeavyTail.NONE, HeavyTail.UNSTABLE, HeavyTail.DEGENERATE)

    @property
    def unknown_mean(self) -> bool:
        """The measured mean and its SE say nothing (not only the spread): infinite variance, or importance
        weights so degenerate that a handful of draws carry the whole sum. The gate skips such rows, saying so."""
        return self in (HeavyTail.INFINITE_VARIANCE, HeavyTail.DEGENERATE)

    @property
    def explanation(self) -> str:
        return {
            HeavyTail.DEGENERATE: "importance weights so uneven that fewer than one effective draw falls in each "
                                  "batch (ESS: Kish's effective sample size of the weights, or N·std²/exact std² "
                                  "where the large weights were never drawn): the measured mean "
                                  "and its SE say nothing",
            HeavyTail.SUPPORT_MISS: "the importance weight q/b is infinite where the sampler never draws",
            HeavyTail.INFINITE_VARIANCE: "infinite variance (E_q[r²] = ∞)",
            HeavyTail.INFINITE_FOURTH: "an infinite 4th moment (the measured std converges slowly and is usually too low)",
            HeavyTail.KURTOSIS: "a kurtosis E[R⁴]/E[R²]² beyond the number of draws (the measured std is usually "
                                "far too low)",
            HeavyTail.UNSTABLE: "one batch carrying most of the sum of squares (a heavy tail)",
        }.get(self, "")


def classify_heavy_tail(*, support_miss_weighted: bool, exact_var: float, fourth_finite: bool,
                        kurtosis: float, draws: float, batch_sq, ess: float = math.nan) -> HeavyTail:
    """The first reason that applies: degenerate importance weights first (``ess``: the Kish effective
    sample size of the weights that multiply the row, NaN where none do; below the number of batches K,
    fewer than one effective draw falls in a batch, so neither the mean nor the batch-means SE means
    anything), then in order of certainty the exact findings, then the heuristic "one batch carries more
    than max(20%, 5/K) of Σ(f − c)²" on the per-batch sums of squares [K]."""
    if ess < batch_sq.shape[0]:          # False for NaN: no weights
        return HeavyTail.DEGENERATE
    if support_miss_weighted:
        return HeavyTail.SUPPORT_MISS
    if math.isinf(exact_var):
        return HeavyTail.INFINITE_VARIANCE
    if not fourth_finite:
        return HeavyTail.INFINITE_FOURTH
    if kurtosis > draws:
        return HeavyTail.KURTOSIS
    k = batch_sq.shape[0]
    total = float(batch_sq.sum())
    if k > 1 and total > 0 and float(batch_sq.max()) / total > max(0.2, 5 / k):
        return HeavyTail.UNSTABLE
    return HeavyTail.NONE


def unknown_reason(heavy: str, ess: float, draws: float, batches: float) -> str:
    """Why a row's mean is unknown (:attr:`HeavyTail.unknown_mean`), in words with its numbers: the
    gate's note and the tables' caption say the same."""
    if heavy == HeavyTail.DEGENERATE.value:
        return (f"degenerate importance weights: an effective sample size of {fmt(ess)} out of {count(draws)} "
                f"draws, below the {count(batches)} batches, so the mean and its SE say nothing")
    return f"{HeavyTail(heavy).explanation}: the SE estimates nothing"
